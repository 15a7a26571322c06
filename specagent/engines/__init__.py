"""Engines: what runs a model's forward passes behind the decoding core's ``Runner`` seam.

- ``transformers``: any Hugging Face causal LM as a torch module (``engines.transformers``: its
  runner, with its CPU tuning and compiled steps, decided at load);
- ``llama.cpp``: a GGUF file as shipped (``engines.llama_cpp``), the fastest engine on a CPU.

``choose_engine`` decides which one a source gets: ``auto`` takes llama.cpp for a GGUF model
(a ``.gguf`` path or a catalog name) on a CPU when llama-cpp-python is installed, transformers
otherwise. A model object of another engine than transformers offers ``runner(vocab_size)``,
``vocab_size``, ``context_window``, ``num_layers``, ``eos_token_ids()``, ``weight_bytes`` and
``key()``; the runtime asks nothing else of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ..catalog import CATALOG
from ..errors import ModelLoadError

__all__ = [
    "ENGINES",
    "EngineChoice",
    "EngineName",
    "choose_engine",
    "describe",
    "is_engine_model",
    "kv_budget",
    "runner_for",
]

EngineName = Literal["auto", "transformers", "llama.cpp"]
ENGINES: tuple[str, ...] = ("auto", "transformers", "llama.cpp")


@dataclass(frozen=True)
class EngineChoice:
    engine: str
    """``transformers`` or ``llama.cpp``."""
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"engine": self.engine, "reason": self.reason}


def is_gguf_source(source: str) -> bool:
    """A ``.gguf`` file or a catalog name (catalog models are published as GGUF files)."""
    return source in CATALOG or source.lower().endswith(".gguf")


def choose_engine(engine: str, source: str, device: torch.device) -> EngineChoice:
    """Which engine runs ``source`` on ``device``, and why."""
    from .llama_cpp import available

    if engine not in ENGINES:
        raise ModelLoadError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    gguf = is_gguf_source(source)
    if engine == "transformers":
        return EngineChoice("transformers", "asked for")
    if engine == "llama.cpp":
        if not gguf and not Path(source).is_file():
            raise ModelLoadError(
                f"the llama.cpp engine runs GGUF files; {source!r} is neither a .gguf file nor "
                "a catalog model"
            )
        if not available():
            raise ModelLoadError(
                'the llama.cpp engine needs llama-cpp-python: pip install "specagent[gguf]"'
            )
        return EngineChoice("llama.cpp", "asked for")
    if not gguf:
        return EngineChoice("transformers", "not a GGUF model")
    if device.type != "cpu":
        return EngineChoice(
            "transformers", f"a GGUF model on {device.type}: transformers' GPU path"
        )
    if not available():
        return EngineChoice(
            "transformers",
            'a GGUF model on a CPU, but llama-cpp-python is not installed ("specagent[gguf]")',
        )
    return EngineChoice("llama.cpp", "a GGUF model on a CPU: llama.cpp decodes it fastest")


def is_engine_model(model: Any) -> bool:
    """A model another engine than transformers loaded (it makes its own runners)."""
    return not isinstance(model, torch.nn.Module) and callable(getattr(model, "runner", None))


def runner_for(model: Any, vocab_size: int | None = None, **options: Any) -> tuple[Any, Any | None]:
    """The decoding core's runner over ``model`` (``decoding.engine.Runner``) and, for the
    transformers engine, its compiled-step decision (``engines.transformers.build_runner``,
    which takes ``options``; another engine's model makes its own runner and takes none)."""
    if is_engine_model(model):
        return model.runner(vocab_size), None
    from .transformers import build_runner

    return build_runner(model, vocab_size, **options)


def describe(choice: Mapping[str, Any]) -> list[str]:
    """``SpecRuntime.engine_choice`` in lines for a person (the demo's header, ``models info``,
    the server's start-up line, ``doctor``): the engine and why, then each fast path a model
    runs with or without and why (``llama_cpp.probe``), and what proving them cost."""
    lines = [f"engine: {choice.get('engine')} ({choice.get('reason')})"]
    for role, paths in (choice.get("fast_paths") or {}).items():
        lines.extend(f"{role}: {path['reason']}" for path in paths.get("paths", {}).values())
        if paths.get("probe_s") is not None:
            lines.append(
                f"{role}: fast paths proven in a child process in {paths['probe_s']:.1f} s"
            )
    return lines


def kv_budget(model: Any) -> int | None:
    """The KV positions all of a runtime's calls on ``model`` may hold together, where they
    share one pool (llama.cpp's unified KV: its cells); None where each call's KV is its own
    (transformers: caches, or slots that spill past their bound)."""
    from .llama_cpp import LlamaCppModel

    return model.context_tokens if isinstance(model, LlamaCppModel) else None
