"""What every measuring run records beside its numbers: each model's dtype, the process's peak
memory, the machine; ratios summarised by their geometric mean; results written per kind of
machine (a newer run on the same kind replaces the older)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..machine import machine_info, machine_kind
from ..runtime import SpecRuntime

__all__ = ["dtypes_of", "geomean", "in_turn", "peak_rss_mb", "write_result"]


def dtypes_of(runtime: SpecRuntime) -> dict[str, Any]:
    """Each model's dtype and why (``runtime.precision``), or just the dtype; a draft's entry
    also says how many rows of its head its logits cover (``head_rows``, None: all)."""
    dtypes = dict(runtime.precision) or {
        role: str(next(model.parameters()).dtype).removeprefix("torch.")
        for role, model in (("target", runtime.target), ("draft", runtime.draft))
        if model is not None
    }
    if runtime.draft is not None:
        draft = dtypes["draft"]
        draft = dict(draft) if isinstance(draft, dict) else {"dtype": draft}
        dtypes["draft"] = {**draft, "head_rows": runtime.draft_head_rows}
    return dtypes


def peak_rss_mb() -> float | None:
    """Peak resident memory of this process in MiB (None where the OS does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return round(peak * scale / 2**20, 1)


def in_turn(names: Sequence[str], turn: int) -> list[str]:
    """The order methods run in on the ``turn``-th task: each first in turn. A host drifts
    within minutes, and a method that always ran last on each task read 8% slower than the
    same drafts alternated with it one to one."""
    shift = turn % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of ratios (0.0 for none; a zero ratio counts as 1e-9, not as log 0)."""
    items = [max(v, 1e-9) for v in values]
    return math.exp(sum(math.log(v) for v in items) / len(items)) if items else 0.0


def write_result(result: dict[str, Any], out_dir: Path, stem: str, started: float) -> Path:
    """A benchmark script's JSON (``out_dir/<stem>_<machine kind>.json``: a newer run on the
    same kind of machine replaces it): its numbers, then the process's peak resident memory,
    the seconds since ``started`` and the machine it ran on."""
    machine = machine_info()
    full = {
        **result,
        "peak_rss_mb": peak_rss_mb(),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}_{machine_kind(machine)}.json"
    path.write_text(json.dumps(full, indent=1) + "\n")
    return path
