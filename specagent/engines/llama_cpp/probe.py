"""Prove llama.cpp's optional fast paths on this machine before the engine uses them.

Some of what llama.cpp turns on by itself kills the process where it does not work: a source
build with native flags compiles ggml's AMX kernels, a model's quantized weights are repacked
for them at load ("extra buffer types"), and on some machines (Intel Xeon guests where the
tiles are not usable) every forward of two or more tokens then dies by SIGILL or SIGSEGV, with
no message and no exception. A crash outweighs any speed-up, so each such path is proven in a
child process first (``probe_child``): the model is loaded with the path and without it, the
engine's forwards run (a prompt, a batch of 2 and 16 new tokens over two sequences, a one-token
step), and the logits are compared. A path whose child dies, raises or gives other logits
stays off, and says why.

The verdict is kept in the machine's ``ProbeStore`` (its file is per machine fingerprint),
keyed by the llama.cpp build, the model file and the context's settings, so only the first load
of a model on a machine pays for the child (seconds; reported). ``repack`` and
``flash_attention`` take ``"auto"`` (prove, then use), ``True`` (use unproven) or ``False``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ...errors import ModelLoadError
from ...machine import ProbeStore, config_key, describe_exit, python_child
from .library import build_info

__all__ = [
    "FAST_PATHS",
    "MAX_RELATIVE_ERROR",
    "FastPaths",
    "PathChoice",
    "Switch",
    "choose_fast_paths",
]

log = logging.getLogger("specagent.engines.llama_cpp")

Switch = Literal["auto"] | bool

FAST_PATHS: dict[str, str] = {
    "repack": "weight repacking",
    "flash_attention": "flash attention",
}
"""Each optional path the engine may turn on, and how messages name it. Order matters: where
two paths each pass alone but fail together, the first is kept."""

MAX_RELATIVE_ERROR = 0.25
"""How far a path's logits may be from the safe configuration's: the RMS of the difference over
the spread of the safe logits, per row. Other kernels round differently (flash attention's f16
products: 0.02 to 0.07 on Qwen2.5-Coder 0.5B and 1.5B Q4_K_M); a broken kernel gives noise
(about 1.4: uncorrelated logits) or nothing finite."""

PROBE_VERSION = 1
"""Part of the verdict's key: a change to what the child runs proves every path again."""

CHILD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PathChoice:
    """Whether one fast path is used, and why."""

    enabled: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "reason": self.reason}


@dataclass(frozen=True)
class FastPaths:
    """The engine's fast paths for one model file on this machine."""

    choices: dict[str, PathChoice]
    probe_s: float | None = None
    """Seconds the child processes took in this load (None: nothing was proven now)."""
    stored: bool = False
    """The verdict was read from the machine's store (an earlier load proved it)."""

    def enabled(self, name: str) -> bool:
        return self.choices[name].enabled

    def to_json(self) -> dict[str, Any]:
        return {
            "paths": {name: choice.to_json() for name, choice in self.choices.items()},
            "probe_s": self.probe_s,
            "stored": self.stored,
        }


@dataclass(frozen=True)
class _Outcome:
    """What one configuration did in a child."""

    ok: bool
    stage: str = ""
    """The last thing the child said it was doing."""
    why: str = ""
    """For a failure: ``crashed ... (signal 11, SIGSEGV)``, ``failed ... (its error)``."""
    logits: np.ndarray | None = None


def choose_fast_paths(
    path: Path,
    asked: Mapping[str, Switch],
    *,
    threads: int,
    batch_tokens: int,
    store: ProbeStore | None,
    child: Sequence[str] | None = None,
) -> FastPaths:
    """Which of ``FAST_PATHS`` to use for the GGUF at ``path``: those asked ``True``, and those
    asked ``"auto"`` that a child process proved here (kept in ``store``; measured again where
    it is None). ``child`` is the command that runs ``probe_child`` (its SPEC is appended;
    default: this Python on the script). Raises ``ModelLoadError`` where even the safe
    configuration dies: then nothing this engine can choose would run."""
    for name, value in asked.items():
        if name not in FAST_PATHS or value not in ("auto", True, False):
            msg = f"llama.cpp engine option {name}={value!r}: expected 'auto', True or False"
            raise ModelLoadError(msg)
    switches = {name: asked.get(name, "auto") for name in FAST_PATHS}
    autos = [name for name, value in switches.items() if value == "auto"]
    forced = {name: bool(value) for name, value in switches.items() if value != "auto"}
    asked_for = {
        name: PathChoice(on, f"{FAST_PATHS[name]} {'on' if on else 'off'}: asked for")
        for name, on in forced.items()
    }
    if not autos:
        return FastPaths(asked_for)
    key = _verdict_key(path, forced, threads, batch_tokens)
    kept = _kept_choices(store.get(key) if store is not None else None, autos)
    if kept is not None:
        return FastPaths({**asked_for, **kept}, stored=True)
    started = time.perf_counter()
    log.info(
        "proving llama.cpp's %s on this machine in a child process before using them%s",
        " and ".join(FAST_PATHS[name] for name in autos),
        " (once per machine and model file)" if store is not None else "",
    )
    prover = _Prover(path, threads, batch_tokens, list(child or _default_child()))
    choices = prover.decide(autos, forced)
    probe_s = time.perf_counter() - started
    log.info(
        "llama.cpp's fast paths decided in %.1f s%s: %s",
        probe_s,
        " (kept for this machine)" if store is not None else "",
        ", ".join(f"{FAST_PATHS[n]} {'on' if c.enabled else 'off'}" for n, c in choices.items()),
    )
    if store is not None:
        store.put(
            key,
            {
                "model": path.name,
                "paths": {name: choice.to_json() for name, choice in choices.items()},
                "probe_s": round(probe_s, 2),
            },
        )
    return FastPaths({**asked_for, **choices}, probe_s=probe_s)


def _default_child() -> list[str]:
    script = str(Path(__file__).with_name("probe_child.py"))
    return python_child(f"import runpy\nrunpy.run_path({script!r}, run_name='__main__')")


def _kept_choices(kept: Any, autos: Sequence[str]) -> dict[str, PathChoice] | None:
    """A stored verdict on ``autos``, or None where there is none or it is not of the shape
    written here (a damaged or foreign file: the paths are proven again, never trusted)."""
    paths = kept.get("paths") if isinstance(kept, dict) else None
    if not isinstance(paths, dict) or set(paths) != set(autos):
        return None
    choices = {}
    for name, choice in paths.items():
        if not (
            isinstance(choice, dict)
            and isinstance(choice.get("enabled"), bool)
            and isinstance(choice.get("reason"), str)
        ):
            log.warning("the stored verdict on llama.cpp's %s is malformed; proving again", name)
            return None
        choices[name] = PathChoice(choice["enabled"], choice["reason"])
    return choices


def _verdict_key(path: Path, forced: Mapping[str, bool], threads: int, batch_tokens: int) -> str:
    """The build, the model file (where it is and which bytes: size and date) and what the
    child ran with."""
    stat = path.stat()
    model = {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return "llama.cpp-fast-paths:" + config_key(
        {"probe": PROBE_VERSION, "build": build_info(), "model": model},
        sorted(forced.items()),
        threads,
        batch_tokens,
    )


class _Prover:
    def __init__(self, path: Path, threads: int, batch_tokens: int, child: list[str]) -> None:
        self.path = path
        self.threads = threads
        self.batch_tokens = batch_tokens
        self.child = child

    def decide(self, autos: list[str], forced: Mapping[str, bool]) -> dict[str, PathChoice]:
        base = {**dict.fromkeys(autos, False), **forced}
        configs = [base] + [{**base, name: True} for name in autos]
        outcomes = self.run(configs)
        safe = outcomes[0]
        if not safe.ok or safe.logits is None:
            off = " and ".join(FAST_PATHS[name] for name in autos)
            msg = (
                f"llama.cpp {safe.why} on {self.path.name} on this CPU even with {off} off; "
                "no configuration of this engine runs here (try engine='transformers'; "
                "`specagent doctor` shows what was probed)"
            )
            raise ModelLoadError(msg)
        choices: dict[str, PathChoice] = {}
        for name, outcome in zip(autos, outcomes[1:], strict=True):
            choices[name] = self.verdict(name, outcome, safe.logits)
        passing = [name for name in autos if choices[name].enabled]
        if len(passing) > 1:
            together = self.run([{**base, **dict.fromkeys(passing, True)}])[0]
            joint = self.verdict(
                " and ".join(FAST_PATHS[n] for n in passing), together, safe.logits
            )
            if not joint.enabled:
                for name in passing[1:]:
                    choices[name] = PathChoice(
                        False,
                        f"{FAST_PATHS[name]} passed alone but not together with "
                        f"{FAST_PATHS[passing[0]]} ({joint.reason}): loaded without it",
                    )
        return choices

    def verdict(self, name: str, outcome: _Outcome, safe: np.ndarray) -> PathChoice:
        label = FAST_PATHS.get(name, name)
        if not outcome.ok or outcome.logits is None:
            return PathChoice(False, f"{label} {outcome.why} on this CPU: loaded without it")
        error = relative_error(safe, outcome.logits)
        if not error <= MAX_RELATIVE_ERROR:  # NaN included
            return PathChoice(
                False,
                f"{label} gave other logits than the safe configuration on this CPU (relative "
                f"error {error:.3g} > {MAX_RELATIVE_ERROR}): loaded without it",
            )
        return PathChoice(
            True,
            f"{label} proven on this CPU (a prompt, 2- and 16-token batches over two "
            f"sequences and a 1-token step match the safe configuration: relative error "
            f"{error:.2g})",
        )

    def run(self, configs: list[dict[str, bool]]) -> list[_Outcome]:
        """Each configuration's outcome; a child that dies is followed by a new one for the
        configurations it did not reach."""
        outcomes: list[_Outcome] = []
        while len(outcomes) < len(configs):
            outcomes.extend(self._child(configs[len(outcomes) :]))
        return outcomes

    def _child(self, configs: list[dict[str, bool]]) -> list[_Outcome]:
        with tempfile.TemporaryDirectory(prefix="specagent-probe-") as out:
            spec = {
                "path": str(self.path),
                "threads": self.threads,
                "batch_tokens": self.batch_tokens,
                "out": out,
                "configs": configs,
            }
            try:
                done = subprocess.run(
                    [*self.child, json.dumps(spec)],
                    capture_output=True,
                    text=True,
                    timeout=CHILD_TIMEOUT_S,
                    check=False,
                )
                stdout, stderr, code = done.stdout, done.stderr, done.returncode
            except subprocess.TimeoutExpired as exc:
                stdout = _text(exc.stdout)
                stderr, code = f"did not finish within {CHILD_TIMEOUT_S:.0f} s", None
            outcomes: list[_Outcome] = []
            stage = "starting"
            for line in stdout.splitlines():
                try:
                    said = json.loads(line)
                except ValueError:
                    continue
                if said.get("done"):
                    index = int(said["config"])
                    logits = np.load(Path(out) / f"{index}.npy")
                    outcomes.append(_Outcome(True, stage, logits=logits))
                elif "stage" in said:
                    stage = str(said["stage"])
            if len(outcomes) == len(configs):
                return outcomes
            outcomes.append(_Outcome(False, stage, describe_exit(stage, code, stderr)))
            return outcomes


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def relative_error(safe: np.ndarray, other: np.ndarray) -> float:
    """The largest per-row RMS of ``other - safe`` over the RMS spread of ``safe``'s row."""
    if safe.shape != other.shape:
        return float("inf")
    if not np.isfinite(other).all():
        return float("nan")
    safe64, other64 = safe.astype(np.float64), other.astype(np.float64)
    spread = np.sqrt(((safe64 - safe64.mean(axis=-1, keepdims=True)) ** 2).mean(axis=-1))
    diff = np.sqrt(((other64 - safe64) ** 2).mean(axis=-1))
    return float((diff / np.maximum(spread, 1e-6)).max())
