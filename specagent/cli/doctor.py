"""``specagent doctor``: what this machine is and what runs on it, in one report.

The first command to run on a new machine, and what a bug report should contain. It prints the
machine (CPU model, ISA flags, cores, memory, accelerator), the installed engines and their
versions, and proves each engine here without fetching anything, each in a child process so
that a native crash is reported, never suffered:

- transformers: a tiny seeded model's forwards of 1, 2 and 16 tokens in float32 and bfloat16;
- llama.cpp: a small quantized GGUF written on the spot, whose matrices llama.cpp repacks,
  through the engine's probe, which says which fast paths run here and which crashed, with the
  signal.

Each engine's check is its own (``engines.tools.EngineTools.check``).

Then what earlier runs measured and chose on this machine (``machine.ProbeStore``): dtype
choices, compiled steps, llama.cpp's fast paths per model file, step-cost curves. The exit
status is 0 when at least one engine runs, 1 when none does.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["doctor_report", "run_doctor"]


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


def _usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count()


def machine_section() -> dict[str, Any]:
    from ..machine import machine_info, machine_kind

    info = dict(machine_info())
    info["kind"] = machine_kind(info)
    info["usable_cores"] = _usable_cores()
    info["memory_gib"] = _memory_gib()
    return info


def recorded_section() -> dict[str, Any]:
    """What earlier runs measured and chose on this machine, from its probe store."""
    from ..catalog import cache_dir
    from ..machine import ProbeStore

    store = ProbeStore(cache_dir() / "probes")
    entries = store.entries()
    sections: dict[str, Any] = {"file": str(store.path)}
    for key, value in sorted(entries.items()):
        kind = key.split(":", 1)[0]
        if kind.startswith("dtype"):
            role = key.split(":")[1]
            sections.setdefault("dtype", []).append({"role": role, **_short(value)})
        elif kind == "compiled-step":
            sections.setdefault("compiled_steps", []).append(_short(value))
        elif kind == "llama.cpp-fast-paths":
            sections.setdefault("llama_cpp_fast_paths", []).append(value)
        elif kind.startswith(("verify", "draft")):
            curve = {"curve": kind.split("-")[0], "costs": value.get("costs")}
            if value.get("settings"):
                curve["settings"] = value["settings"]
            sections.setdefault("step_costs", []).append(curve)
    return sections


def _short(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {"value": value}
    return {k: v for k, v in value.items() if k in ("dtype", "compiled", "reason")}


def doctor_report(
    checks: dict[str, Callable[[], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The whole report as data (``--json`` prints it as it is)."""
    if checks is None:
        from ..engines import LOADERS
        from ..engines.tools import engine_tools

        checks = {name: engine_tools(name).check for name in LOADERS}
    return {
        "machine": machine_section(),
        "engines": {name: check() for name, check in checks.items()},
        "recorded": recorded_section(),
    }


def _print(report: dict[str, Any]) -> None:
    machine = report["machine"]
    print("specagent doctor: this machine and what runs on it (include it in a bug report)\n")
    print("machine")
    print(
        f"  cpu: {machine['cpu']} (family/model {machine['cpu_family_model']}, "
        f"kind {machine['kind']})"
    )
    print(
        f"  isa flags: {' '.join(machine['isa_flags']) or 'none of note'}; torch's cpu "
        f"capability: {machine['cpu_capability']}"
    )
    print(
        f"  cores: {machine['usable_cores']} usable of {machine['cpu_count']}; memory: "
        f"{machine['memory_gib']} GiB; accelerator: {machine['accelerator'] or 'none'}"
    )
    print(
        f"  python {machine['python']}, torch {machine['torch']} ({machine['blas']}), "
        f"transformers {machine['transformers']}, llama-cpp-python "
        f"{machine['llama_cpp_python'] or 'not installed'}"
    )
    print("\nengines")
    for name, engine in report["engines"].items():
        print(f"  {name}: {'runs' if engine['runs'] else 'DOES NOT RUN'}: {engine['detail']}")
        if engine.get("system_info"):
            print(f"    built for: {engine['system_info']}")
        for choice in (engine.get("fast_paths") or {}).values():
            print(f"    {'on ' if choice['enabled'] else 'off'} {choice['reason']}")
    recorded = report["recorded"]
    print(f"\nrecorded on this machine ({recorded['file']})")
    if len(recorded) == 1:
        print("  nothing yet: a model's first load here measures and records its choices")
    for entry in recorded.get("dtype", []):
        print(f"  {entry['role']} dtype: {entry.get('dtype')} ({entry.get('reason')})")
    for entry in recorded.get("compiled_steps", []):
        state = "compiled" if entry.get("compiled") else "eager"
        print(f"  steps: {state} ({entry.get('reason')})")
    for entry in recorded.get("llama_cpp_fast_paths", []):
        for choice in entry.get("paths", {}).values():
            print(f"  llama.cpp, {entry.get('model')}: {choice['reason']}")
    for entry in recorded.get("step_costs", []):
        costs = ", ".join(f"{c:g}" for c in entry.get("costs") or [])
        print(f"  {entry['curve']} costs (one target step = 1, by tokens): {costs}")
        if entry.get("settings"):
            print(f"    kernels: {json.dumps(entry['settings'])}")


def run_doctor(
    as_json: bool = False, checks: dict[str, Callable[[], dict[str, Any]]] | None = None
) -> int:
    """Print the report; 0 when some engine runs here, 1 when none does. ``checks``: each
    engine's check (default: transformers and llama.cpp)."""
    report = doctor_report(checks)
    if as_json:
        print(json.dumps(report, indent=1, default=str))
    else:
        _print(report)
    runs = any(engine["runs"] for engine in report["engines"].values())
    if not runs:
        print("\nno engine runs on this machine: see the lines above", file=sys.stderr)
    return 0 if runs else 1
