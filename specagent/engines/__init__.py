"""Engines: what runs a model's forward passes behind the decoding core's ``Runner`` seam.

- ``transformers``: any Hugging Face causal LM as a torch module (``engines.transformers``: its
  runner, with its CPU tuning and compiled steps, decided at load);
- ``llama.cpp``: a GGUF file as shipped (``engines.llama_cpp``), the fastest engine on a CPU.

``choose_engine`` decides which one a source gets: ``auto`` takes llama.cpp for a GGUF model
(a ``.gguf`` path or a catalog name) on a CPU when llama-cpp-python is installed, transformers
otherwise. Every engine's model is an ``EngineModel`` (``base``): the runtime asks it for its
facts and runners, and branches on its declared ``capabilities`` only; ``engine_model`` gives
that view of whatever a caller passed in (a torch module: the transformers engine's).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ..catalog import CATALOG
from ..errors import ModelLoadError
from .base import Capabilities, EngineModel, Loaded, LoadRequest, RunnerNeeds

__all__ = [
    "ENGINES",
    "LOADERS",
    "Capabilities",
    "EngineChoice",
    "EngineModel",
    "EngineName",
    "LoadRequest",
    "Loaded",
    "RunnerNeeds",
    "choose_engine",
    "describe",
    "engine_model",
    "load_pair",
]

EngineName = Literal["auto", "transformers", "llama.cpp"]
LOADERS: Mapping[str, str] = {
    "transformers": "specagent.engines.transformers.loading",
    "llama.cpp": "specagent.engines.llama_cpp.loading",
}
"""Each engine's loading module (its ``load_pair(LoadRequest) -> Loaded``; beside it, the
package's ``tools``, ``engines.tools.EngineTools``): a new engine is its package and one line
here (and, for ``engine="auto"`` to pick it, a rule in ``choose_engine``)."""
ENGINES: tuple[str, ...] = ("auto", *LOADERS)


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


def engine_model(model: Any, options: Mapping[str, Any] | None = None) -> EngineModel:
    """The engine's view of ``model``: an ``EngineModel`` as it is (its engine took its options
    when it loaded it), a torch module as the transformers engine's, with ``options``
    (``transformers.TransformersOptions``'s fields; another is an error naming them)."""
    if isinstance(model, EngineModel):
        return model
    if isinstance(model, torch.nn.Module):
        from .transformers.model import TransformersModel, transformers_options

        return TransformersModel(model, transformers_options(options))
    msg = (
        f"a model must be a torch module (transformers) or an engine's model "
        f"(specagent.engines.EngineModel), not {type(model).__name__}"
    )
    raise TypeError(msg)


def load_pair(
    target: str,
    draft: str | None,
    device: str | torch.device,
    dtype: str | torch.dtype,
    draft_dtype: str | torch.dtype,
    trust_remote_code: bool,
    engine: str = "auto",
    engine_options: Mapping[str, Any] | None = None,
) -> Loaded:
    """Target (and draft) loaded by the engine ``choose_engine`` picks (its ``loading`` module,
    ``LOADERS``), with the target's tokenizer: transformers in the dtype that runs fastest here
    (``dtype``, ``draft_dtype``, ``trust_remote_code``); llama.cpp as the GGUF ships, each model
    built with ``engine_options`` (``llama_cpp.LlamaCppModel``'s keywords)."""
    from ..models import resolve_device

    dev = resolve_device(device)
    choice = choose_engine(engine, target, dev)
    request = LoadRequest(
        target,
        draft,
        dev,
        choice.to_json(),
        dtype=dtype,
        draft_dtype=draft_dtype,
        trust_remote_code=trust_remote_code,
        options=dict(engine_options or {}),
    )
    loaded: Loaded = importlib.import_module(LOADERS[choice.engine]).load_pair(request)
    return loaded


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
