"""``specagent audit``'s output: the calls and the per-policy summaries as a table, CSV or
JSON (one document with both)."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["print_audit"]

CALL_COLUMNS = (
    "at",
    "endpoint",
    "key_name",
    "tenant",
    "policy",
    "mode",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms",
    "tokens_per_s",
    "acceptance_rate",
    "divergence",
)
SUMMARY_COLUMNS = (
    "policy",
    "calls",
    "errors",
    "p50_latency_ms",
    "p95_latency_ms",
    "tokens_per_s",
    "mean_acceptance",
    "mean_divergence",
    "p95_divergence",
    "fallbacks",
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if hasattr(value, "isoformat"):
        return value.isoformat(timespec="seconds")
    from ..audit.rows import text_cell  # (the audit command has SQLAlchemy; the CLI needs not)

    # A user value is the caller's text: its escape sequences must not drive the terminal.
    return str(text_cell(str(value), None))


def _table(title: str, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    print(title)
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    if not rows:
        print("(none)")
    print()


def print_audit(
    calls: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]], fmt: str
) -> None:
    if fmt == "json":
        document = {"calls": list(calls), "policies": list(summaries)}
        print(json.dumps(document, indent=1, default=_cell))
        return
    if fmt == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(["section", *CALL_COLUMNS])
        for row in calls:
            writer.writerow(["call", *(_cell(row.get(c)) for c in CALL_COLUMNS)])
        writer.writerow(["section", *SUMMARY_COLUMNS])
        for row in summaries:
            writer.writerow(["policy", *(_cell(row.get(c)) for c in SUMMARY_COLUMNS)])
        return
    _table("per policy", SUMMARY_COLUMNS, summaries)
    _table(f"calls (newest first, {len(calls)})", CALL_COLUMNS, calls)
