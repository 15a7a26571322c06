"""What machine this is, and what was measured on it.

Machines of one kind differ (Intel or AMD, which BLAS paths are fast, native bf16 or not), so the
step costs, the linear kernels and the dtype are measured where the runtime runs. Measuring takes
a minute on a 1.5B model on a 2-core CPU; ``ProbeStore`` keeps the results in the cache directory,
one JSON file per machine fingerprint (CPU model and flags, thread count, accelerator, torch and
transformers versions) and entry per model shape and dtype, so later loads on the same machine
skip it. Anything that changes the machine's answer changes the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ProbeStore",
    "config_key",
    "describe_exit",
    "machine_info",
    "machine_kind",
    "python_child",
]

_ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "asimd",
    "sve",
    "bf16",
    "i8mm",
)
"""The CPU flags that decide which matrix kernels (and dtypes) are fast."""


@lru_cache(maxsize=1)
def machine_info() -> dict[str, Any]:
    """The facts a benchmark result or a cached measurement must name: CPU model and the ISA
    flags that matter for matrix kernels, threads, accelerator, BLAS and library versions."""
    import transformers

    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    family: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and cpu in ("", platform.machine(), platform.processor()):
                    cpu = value.strip()
                elif name in ("cpu family", "model") and name not in family:
                    family[name] = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the platform's own name is all there is
        pass
    config = torch.__config__.show()
    blas = next((b for b in ("MKL", "OpenBLAS", "Accelerate", "BLIS") if b in config), "unknown")
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_family_model": "/".join(family.get(k, "?") for k in ("cpu family", "model")),
        "isa_flags": sorted(f for f in _ISA_FLAGS if f in flags),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "blas": blas,
        "mkl_version": _mkl_version(config),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_python": _installed("llama-cpp-python"),
        "python": platform.python_version(),
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def _mkl_version(config: str) -> str | None:
    for line in config.splitlines():
        if "Math Kernel Library Version" in line:
            return line.split("Version", 1)[1].split("-")[0].strip()
    return None


def _installed(distribution: str) -> str | None:
    """An installed distribution's version, without importing it (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def machine_kind(info: dict[str, Any] | None = None) -> str:
    """A short name for the kind of machine ``info`` (``machine_info()``) describes, for naming
    result files: the accelerator (``h200``), else the CPU's generation where it is known
    (``zen3``, ``zen4``, ``zen5``, ``xeon-amx``), else a slug of its model name."""
    info = info if info is not None else machine_info()
    accelerator = info.get("accelerator")
    if accelerator:
        words = [w for w in str(accelerator).lower().replace("-", " ").split() if w != "nvidia"]
        return next((w for w in words if any(c.isdigit() for c in w)), "_".join(words)) or "gpu"
    cpu = str(info.get("cpu", "")).lower()
    family, _, model = str(info.get("cpu_family_model", "")).partition("/")
    flags = set(info.get("isa_flags", []))
    if "amd" in cpu and family.isdigit() and model.isdigit():
        if family == "25":
            return "zen4" if 16 <= int(model) < 32 or int(model) >= 96 else "zen3"
        if family == "26":
            return "zen5"
    if "intel" in cpu and "amx_bf16" in flags:
        return "xeon-amx"
    slug = "".join(c if c.isalnum() else "-" for c in cpu).strip("-")
    return "-".join(part for part in slug.split("-") if part)[:40] or "cpu"


def fingerprint() -> str:
    """A short hash of everything in ``machine_info`` that changes measured speed."""
    info = machine_info()
    keep = {k: info[k] for k in info if k != "python"}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def config_key(config: Any, *parts: object) -> str:
    """A key for measurements of a model architecture: its config without the fields that do not
    change speed, and any extra ``parts`` (dtype, device, lengths). Weights do not change speed,
    so two checkpoints of one architecture share their measurements."""
    described = config.to_dict() if hasattr(config, "to_dict") else {"config": str(config)}
    for noise in ("_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype"):
        described.pop(noise, None)
    payload = json.dumps([described, [str(p) for p in parts]], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


class ProbeStore:
    """Measurements of this machine, kept as JSON under ``directory`` (one file per machine).

    At most ``max_entries``, the least recently written dropped first: every model file,
    setting and version keys entries of its own, and the file is read whole at every load and
    rewritten at every write, so one that only grew would slow every start (a dropped entry
    costs a measurement when next wanted, nothing else)."""

    def __init__(self, directory: Path, max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.path = Path(directory) / f"machine-{fingerprint()}.json"
        self.max_entries = max_entries

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # absent, or written by something else: measure again
            return {}
        return data if isinstance(data, dict) else {}

    def entries(self) -> dict[str, Any]:
        """Everything recorded for this machine (``specagent doctor`` shows it)."""
        return _entries_of(self._read())

    def get(self, key: str) -> Any | None:
        """What is recorded under ``key`` (None: nothing, or a file not of this shape: its
        reader measures again)."""
        return self.entries().get(key)

    def put(self, key: str, value: Any) -> None:
        """Record ``value`` under ``key`` (the newest entry: entries are kept in the order
        they were written); a failed write only costs a later re-measurement."""
        data = self._read()
        data["machine"] = machine_info()
        entries = _entries_of(data)
        entries.pop(key, None)
        entries[key] = value
        for old in list(entries)[: max(0, len(entries) - self.max_entries)]:
            del entries[old]
        data["entries"] = entries
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=self.path.parent, delete=False, suffix=".tmp", encoding="utf-8"
            ) as tmp:
                json.dump(data, tmp, indent=1)
            os.replace(tmp.name, self.path)
        except OSError:
            pass


def _entries_of(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a store file's entries (none where the file is not of this shape)."""
    entries = data.get("entries", {})
    return dict(entries) if isinstance(entries, dict) else {}


def python_child(code: str) -> list[str]:
    """The command that runs ``code`` in a child Python importing what this process imports
    and nothing from the working directory: isolated (``-I``: no ``PYTHON*`` variables, no
    working or script directory on the path; a planted ``json.py`` is never run), with this
    process's import path handed over, less the entry for where it was started from."""
    path = list(sys.path)
    if path and path[0] in ("", ".", os.getcwd()):
        path = path[1:]
    return [sys.executable, "-I", "-c", f"import sys\nsys.path[:] = {path!r}\n{code}"]


def describe_exit(stage: str, code: int | None, stderr: str) -> str:
    """How a child process ended that did not finish: ``crashed in STAGE (signal 11,
    SIGSEGV)``, ``failed in STAGE (its last error line)``, ``hung in STAGE (...)``."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"crashed {_at(stage)} (signal {-code}, {name})"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    detail = last[:200] if last else f"exit status {code}"
    if code is None:
        return f"hung {_at(stage)} ({detail})"
    if "ModuleNotFoundError" in stderr or "ImportError" in stderr:
        return f"failed {_at(stage)}: the child process could not import a module ({detail})"
    return f"failed {_at(stage)} ({detail})"


def _at(stage: str) -> str:
    return stage if stage.startswith(("loading", "creating", "starting")) else f"in {stage}"
