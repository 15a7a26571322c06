"""One ``specagent_calls`` row from what a front door knows of a call: numbers and names, never
the prompt or the output (nor anything that could restore them). Every text cell is printable
and fits its column: front doors refuse control characters already, and a row that still had
one would cost the database's whole batch (PostgreSQL refuses a NUL)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import String

from .schema import CALLS

__all__ = ["call_row", "text_cell"]

_LENGTHS = {c.name: c.type.length for c in CALLS.columns if isinstance(c.type, String)}


def call_row(
    *,
    front_door: str,
    status: str | int,
    endpoint: str | None = None,
    result: Any = None,
    key_name: str | None = None,
    tenant: object = None,
    policy: str | None = None,
    mode: str | None = None,
    engine: str | None = None,
    model: str | None = None,
    error_id: str | None = None,
    prompt_tokens: int | None = None,
    trace_id: str | None = None,
) -> dict[str, Any]:
    """The row of a call that ended now: ``result`` (a ``GenerationResult``) where it ran to
    the end, else what was known when it was refused or failed."""
    at = datetime.now(timezone.utc)
    row: dict[str, Any] = {
        "id": str(uuid.uuid4()),
        "at": at,
        "minute": at.replace(second=0, microsecond=0),
        "front_door": front_door,
        "endpoint": endpoint,
        "key_name": key_name,
        "tenant": str(tenant) if tenant is not None else None,
        "policy": policy,
        "mode": mode,
        "engine": engine,
        "model": model,
        "status": str(status),
        "error_id": error_id,
        "prompt_tokens": prompt_tokens,
        "trace_id": trace_id,
    }
    if result is not None:
        stats, usage = result.stats, result.usage
        row.update(
            policy=stats.policy,
            mode=stats.mode,
            prompt_tokens=usage.input_tokens,
            completion_tokens=usage.output_tokens,
            latency_ms=round(stats.latency_s * 1000.0, 3),
            ttft_ms=round(stats.ttft_s * 1000.0, 3),
            tokens_per_s=round(stats.tokens_per_s, 3),
            acceptance_rate=stats.acceptance_rate if stats.num_draft_tokens else None,
            tokens_per_forward=stats.mean_acceptance_length,
            divergence=stats.divergence,
            fell_back_to_lossless=bool(stats.fell_back_to_lossless),
            accepted_by_source=dict(stats.accepted_by_source),
            trace_id=getattr(result, "trace_id", None) or trace_id,
        )
    for name, length in _LENGTHS.items():
        row[name] = text_cell(row.get(name), length)
    return row


def text_cell(value: Any, length: int | None) -> Any:
    """``value`` as a cell: a string's control characters escaped (``\\x00``), cut to
    ``length``; anything else as it is."""
    if not isinstance(value, str):
        return value
    if not value.isprintable():
        value = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in value)
    return value[:length] if length else value
