"""The audit store: one row per call in a real database (SQLite by default, PostgreSQL for a
team), written off the event loop and the decoding worker, readable by the BI tools a business
already uses.

Which key called which policy, when, with what result and what quality: ``specagent_calls``
holds, per call that ran or was refused, the key's name (never the key), the tenant, policy,
mode, engine, model, status, token counts, latency, time to first token, acceptance, tokens
per forward, divergence, fallback, accepted tokens by source and the OpenTelemetry trace id;
never a prompt or an output. ``specagent_policy_minutes`` is a view per minute and policy.
``specagent serve`` writes one by default (``--audit``); ``SpecRuntime(audit=...)`` records the
calls made through the SDK and LangChain. ``docs/audit.md`` documents every column.
"""

from __future__ import annotations

import os
from pathlib import Path

from .query import parse_since, policy_summaries, read_calls
from .rows import call_row
from .schema import CALLS, MINUTES_VIEW, SCHEMA_VERSION
from .store import AuditStore, masked, masked_url, row_bound

__all__ = [
    "CALLS",
    "MINUTES_VIEW",
    "SCHEMA_VERSION",
    "AuditStore",
    "call_row",
    "default_audit_url",
    "masked",
    "masked_url",
    "open_audit",
    "parse_since",
    "policy_summaries",
    "read_calls",
    "row_bound",
]


def default_audit_url() -> str:
    """``sqlite:///$XDG_DATA_HOME/specagent/audit.sqlite`` (``~/.local/share`` where unset):
    kept data, not a cache."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return f"sqlite:///{Path(base) / 'specagent' / 'audit.sqlite'}"


def open_audit(audit: str | AuditStore | None, **options: object) -> AuditStore | None:
    """An ``AuditStore`` from a database URL, or the store given (None: no audit)."""
    if audit is None or isinstance(audit, AuditStore):
        return audit
    if isinstance(audit, str):
        return AuditStore(audit, **options)  # type: ignore[arg-type]
    raise TypeError(f"audit must be a database URL or an AuditStore, got {type(audit).__name__}")
