"""Loading a runtime's models from local paths, hub ids or catalog names, each in the dtype
that runs fastest here (``engines.transformers.precision``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..catalog import CATALOG, cache_dir, resolve_gguf, resolve_model
from ..engines import EngineChoice, choose_engine, is_gguf_source
from ..engines.transformers import PrefillTwin
from ..engines.transformers.precision import INT8, DtypeChoice, Role, choose_dtype, load_as
from ..engines.transformers.quantized import int8_supported
from ..errors import ModelLoadError
from ..machine import ProbeStore, config_key
from ..models import load_config, load_model, load_tokenizer, resolve_device, resolve_dtype

__all__ = ["Loaded", "load_pair"]


@dataclass
class Loaded:
    target: Any
    """A transformers model, or another engine's (``engines``)."""
    draft: Any | None
    tokenizer: Any
    draft_tokenizer: Any | None
    device: torch.device
    store: ProbeStore
    source: str
    """Where the target was loaded from (a path or hub id)."""
    precision: dict[str, Any] = field(default_factory=dict)
    """Per role: the dtype chosen and why (``DtypeChoice.to_json``)."""
    draft_prefill: PrefillTwin | None = None
    """A full-precision copy of the draft for its long forwards, where they measured faster so
    (``precision``)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """The engine that runs the forwards and why (``engines.EngineChoice.to_json``), with what
    it proved and turned off at load (``fast_paths`` per role, on llama.cpp)."""


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
    """Target (and draft) with the target's tokenizer, and the probe store of this machine in
    the cache directory, where dtype choices, step costs and kernels are kept. ``engine``
    picks what runs the forwards (``engines.choose_engine``); ``engine_options`` go to the
    llama.cpp engine's model (``LlamaCppModel``: threads, context_tokens, ...)."""
    dev = resolve_device(device)
    choice = choose_engine(engine, target, dev)
    if choice.engine == "llama.cpp":
        return _load_gguf_pair(target, draft, choice, dict(engine_options or {}))
    target = resolve_model(target)
    draft = resolve_model(draft) if draft is not None else None
    store = ProbeStore(cache_dir() / "probes")
    precision: dict[str, Any] = {}
    twins: dict[str, PrefillTwin] = {}

    def loaded(source: str, role: Role, wanted: str | torch.dtype) -> torch.nn.Module:
        def load(dt: torch.dtype) -> torch.nn.Module:
            return load_model(source, device=dev, dtype=dt, trust_remote_code=trust_remote_code)

        if wanted == INT8:
            return _int8_draft(load, role, dev, precision)
        if wanted != "auto":
            dt = resolve_dtype(wanted, dev)
            precision[role] = DtypeChoice(dt, "asked for").to_json()
            return load(dt)
        shape = config_key(load_config(source, trust_remote_code=trust_remote_code))
        model, choice = choose_dtype(load, role, dev, key=shape, store=store)
        precision[role] = choice.to_json()
        if choice.prefill_dtype is not None and choice.prefill_from is not None:
            twin = load(choice.prefill_dtype)
            twins[role] = PrefillTwin(twin, choice.prefill_from)  # type: ignore[arg-type]
        return model

    tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
    target_model = loaded(target, "target", dtype)
    draft_model = draft_tokenizer = None
    if draft is not None:
        draft_tokenizer = load_tokenizer(draft, trust_remote_code=trust_remote_code)
        draft_model = loaded(draft, "draft", draft_dtype)
    return Loaded(
        target_model,
        draft_model,
        tokenizer,
        draft_tokenizer,
        dev,
        store,
        str(target),
        precision,
        twins.get("draft"),
        choice.to_json(),
    )


def _load_gguf_pair(
    target: str, draft: str | None, choice: EngineChoice, options: dict[str, Any]
) -> Loaded:
    """Target (and draft) as GGUF files run by llama.cpp, as shipped, with the tokenizer and
    chat template the GGUF carries (converted by transformers once, then cached)."""
    from ..engines.llama_cpp import LlamaCppModel, check_vocabulary

    def loaded(source: str) -> tuple[LlamaCppModel, Any]:
        path = resolve_gguf(source) if source in CATALOG else Path(source)
        model = LlamaCppModel(path, name=source if source in CATALOG else None, **options)
        tokenizer = gguf_tokenizer(path)
        check_vocabulary(model, tokenizer)
        return model, tokenizer

    if draft is not None and not is_gguf_source(draft):
        msg = (
            f"the llama.cpp engine runs a draft from a GGUF file too; {draft!r} is neither a "
            ".gguf file nor a catalog model"
        )
        raise ModelLoadError(msg)
    target_model, tokenizer = loaded(target)
    draft_model, draft_tokenizer = loaded(draft) if draft is not None else (None, None)
    models = {"target": target_model, "draft": draft_model}
    precision = {
        role: {"dtype": "gguf", "reason": f"the GGUF as shipped ({model.description})"}
        for role, model in models.items()
        if model is not None
    }
    engine = {
        **choice.to_json(),
        "fast_paths": {
            role: model.fast_paths.to_json() for role, model in models.items() if model is not None
        },
    }
    return Loaded(
        target_model,
        draft_model,
        tokenizer,
        draft_tokenizer,
        torch.device("cpu"),
        ProbeStore(cache_dir() / "probes"),
        str(target_model.path),
        precision,
        None,
        engine,
    )


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer and chat template a GGUF file carries, as a transformers tokenizer:
    converted once per file (seconds for a large vocabulary) and kept in the cache."""
    from transformers import AutoTokenizer

    stat = path.stat()
    kept = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}"
    if (kept / "tokenizer_config.json").is_file():
        return load_tokenizer(str(kept))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the tokenizer of {path}: {exc}") from exc
    kept.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(kept)
    return tokenizer


def _int8_draft(
    load: Callable[[torch.dtype], torch.nn.Module],
    role: Role,
    device: torch.device,
    precision: dict[str, Any],
) -> torch.nn.Module:
    """A draft asked for with int8 weights (``draft_dtype="int8"``): bf16 activations, every
    forward in it (no full-precision twin: asking for int8 is asking to save the memory)."""
    if role != "draft":
        msg = (
            "dtype 'int8' is for a draft only (draft_dtype='int8'): the target defines what "
            "lossless decoding reproduces, and quantizing it would change its outputs"
        )
        raise ModelLoadError(msg)
    if not int8_supported(device):
        msg = (
            f"draft_dtype='int8' needs torch's weight-only int8 kernel "
            f"(torch._weight_int8pack_mm) on {device}, which torch {torch.__version__} lacks; "
            "use 'auto', 'bfloat16' or 'float32'"
        )
        raise ModelLoadError(msg)
    precision[role] = DtypeChoice(torch.bfloat16, "asked for", int8_weights=True).to_json()
    return load_as(load, INT8)
