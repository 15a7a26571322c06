"""``ServerOptions``: what a server enforces beside its keys (sizes, budgets, deadlines,
concurrency, metrics, the dashboard, the audit store, stored responses)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ServerOptions"]


@dataclass(frozen=True)
class ServerOptions:
    max_body_bytes: int = 1 << 20
    """Larger request bodies get 413 before they are parsed."""
    default_policy: str | None = None
    """Policy of calls that name none and whose tags route nowhere (None: the runtime's
    lossless default)."""
    metrics: Callable[[], bytes] | None = None
    """Prometheus text of the runtime's instruments (``specagent.server.metrics``)."""
    metrics_public: bool = False
    """Serve ``/metrics`` without a key (for a scraper on a private network). By default it
    needs a key that may use every policy: the metrics name the model and every policy."""
    max_tokens: int = 4096
    """The most new tokens a call may ask for (a key's ``max_tokens`` replaces it); a call
    that asks for none gets its policy's default."""
    timeout_s: float | None = 600.0
    """Each call's deadline, queueing included (a key's ``timeout_s`` replaces it); None:
    none."""
    max_concurrent: int | None = None
    """Calls in flight per key, for keys that set no ``max_concurrent`` of their own. None: a
    quarter of the runtime's decoding slots (``max_active``; at least one), so that no key
    alone fills them and other keys' calls always progress."""
    max_reproducible: int = 2
    """Reproducible calls in flight per key, for keys that set no ``max_reproducible``: each
    runs alone and, on llama.cpp, in a context of its own."""
    meter_provider: Any = None
    """Where the server's own HTTP metric goes (``metrics.HttpMetrics``; ``specagent serve``
    passes the runtime's, so ``/metrics`` shows it). None: not recorded."""
    dashboard: bool = True
    """Serve ``/dashboard`` and its data (numbers per policy, behind the key check)."""
    reports_dir: Path | None = None
    """Where ``specagent eval`` wrote its HTML reports: the dashboard links them (for a key
    that may use every policy)."""
    audit: Any = None
    """The ``specagent.audit.AuditStore`` every call's row goes to (ran or refused; None: no
    audit)."""
    audit_required: bool = False
    """Refuse calls (503) while the audit store cannot record them: no record, no call."""
    allowed_hosts: tuple[str, ...] | None = None
    """The names a request's ``Host`` header may give (None: any). ``specagent serve --no-auth``
    sets the loopback names and the address it listens on, so that a web page, or a DNS name
    rebound to the loopback, cannot drive a developer's open server from a browser."""
    store_responses: bool = True
    """Keep Responses API responses (``store``, the default there) for ``previous_response_id``
    and ``GET /v1/responses/{id}``, in memory, each key's apart. False: a request that asks to
    store or to continue one is refused (400)."""
    responses_retention_s: float = 3600.0
    """How long a stored response is kept."""
    responses_max_bytes_per_key: int = 16 << 20
    """What one key's stored responses may hold; its oldest make room for new ones."""
    responses_max_bytes: int = 256 << 20
    """What all keys' stored responses may hold together; the oldest anywhere go first."""
