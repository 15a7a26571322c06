"""Reading the audit store: a window's calls and per-policy summaries (``specagent audit``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine

from .schema import CALLS

__all__ = ["parse_since", "policy_summaries", "read_calls"]

_SPAN = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(value: str | None) -> datetime | None:
    """``1h``, ``30m``, ``7d`` (that long ago) or an ISO date or time (UTC where it names no
    zone); None: since the start."""
    if not value:
        return None
    span = _SPAN.match(value.strip())
    if span:
        seconds = float(span.group(1)) * _UNITS[span.group(2)]
        return datetime.now(timezone.utc) - timedelta(seconds=seconds)
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        msg = f"--since takes a span (30m, 1h, 7d) or an ISO date or time, got {value!r}"
        raise ValueError(msg) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _filtered(since: datetime | None, policy: str | None, key: str | None) -> Any:
    query = select(CALLS)
    if since is not None:
        query = query.where(CALLS.c.at >= since)
    if policy is not None:
        query = query.where(CALLS.c.policy == policy)
    if key is not None:
        query = query.where(CALLS.c.key_name == key)
    return query


def read_calls(
    engine: Engine,
    *,
    since: datetime | None = None,
    policy: str | None = None,
    key: str | None = None,
    limit: int | None = 100,
) -> list[dict[str, Any]]:
    """The calls of the window, newest first (``limit``: at most that many)."""
    query = _filtered(since, policy, key).order_by(CALLS.c.at.desc())
    if limit is not None:
        query = query.limit(limit)
    with engine.connect() as connection:
        return [dict(row._mapping) for row in connection.execute(query)]


def policy_summaries(
    engine: Engine,
    *,
    since: datetime | None = None,
    policy: str | None = None,
    key: str | None = None,
) -> list[dict[str, Any]]:
    """Per policy over the window: calls, errors, latency p50/p95, tokens/s, acceptance,
    divergence mean/p95 and fallbacks (calls refused before a policy was known: ``policy``
    None)."""
    columns = [
        CALLS.c.policy,
        CALLS.c.status,
        CALLS.c.latency_ms,
        CALLS.c.completion_tokens,
        CALLS.c.acceptance_rate,
        CALLS.c.divergence,
        CALLS.c.fell_back_to_lossless,
    ]
    query = _filtered(since, policy, key).with_only_columns(*columns)
    groups: dict[str | None, list[Any]] = {}
    with engine.connect() as connection:
        for row in connection.execute(query):
            groups.setdefault(row.policy, []).append(row)
    out = []
    for name in sorted(groups, key=lambda p: (p is None, p or "")):
        rows = groups[name]
        latencies = sorted(r.latency_ms for r in rows if r.latency_ms is not None)
        divergences = sorted(r.divergence for r in rows if r.divergence is not None)
        acceptances = [r.acceptance_rate for r in rows if r.acceptance_rate is not None]
        tokens = sum(r.completion_tokens or 0 for r in rows if r.latency_ms is not None)
        out.append(
            {
                "policy": name,
                "calls": len(rows),
                "errors": sum(1 for r in rows if r.status not in ("ok", "200")),
                "p50_latency_ms": _rank(latencies, 0.5),
                "p95_latency_ms": _rank(latencies, 0.95),
                "tokens_per_s": round(tokens * 1000.0 / sum(latencies), 2) if latencies else None,
                "mean_acceptance": _mean(acceptances),
                "mean_divergence": _mean(divergences),
                "p95_divergence": _rank(divergences, 0.95),
                "fallbacks": sum(1 for r in rows if r.fell_back_to_lossless),
            }
        )
    return out


def _rank(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (as the per-minute view computes it)."""
    if not values:
        return None
    return round(values[max(0, math.ceil(q * len(values)) - 1)], 3)


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None
