"""Loading a runtime's models as GGUF files run by llama.cpp, as shipped, with the tokenizer
and chat template each GGUF carries."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from ...catalog import CATALOG, cache_dir, resolve_gguf
from ...errors import ModelLoadError
from ...machine import ProbeStore
from ...models import load_tokenizer
from ..base import Loaded, LoadRequest
from .model import LlamaCppModel

__all__ = ["check_vocabulary", "gguf_tokenizer", "load_pair"]


def load_pair(request: LoadRequest) -> Loaded:
    """Target (and draft) as GGUF files (a path or a catalog name), each a ``LlamaCppModel``
    with ``request.options``; the engine choice gets each model's proven fast paths."""
    from .. import is_gguf_source

    target, draft, options = request.target, request.draft, request.options
    takes = set(inspect.signature(LlamaCppModel).parameters) - {"path", "name"}
    unknown = sorted(set(options) - takes)
    if unknown:
        msg = f"engine_options: the llama.cpp engine takes {sorted(takes)}, not {unknown}"
        raise ValueError(msg)

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
        **request.choice,
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
        target_model.name,
        precision,
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


def check_vocabulary(model: LlamaCppModel, tokenizer: Any) -> None:
    """Raise ``ModelLoadError`` unless the tokenizer's ids mean what the GGUF's do: specagent
    tokenizes with the transformers tokenizer (and its chat template) and llama.cpp only sees
    ids, so one id must be one token text in both."""
    size = len(tokenizer)
    if size > model.vocab_size:
        msg = (
            f"{model.path.name}: the tokenizer has {size} tokens but the GGUF's vocabulary "
            f"{model.vocab_size}; they are not the same model's"
        )
        raise ModelLoadError(msg)
    texts = tokenizer.convert_ids_to_tokens(list(range(size)))
    differing = [
        (i, text, model.token_text(i))
        for i, text in enumerate(texts)
        if text is not None and text != model.token_text(i)
    ]
    if differing:
        sample = ", ".join(f"{i}: {a!r} vs {b!r}" for i, a, b in differing[:3])
        msg = (
            f"{model.path.name}: the tokenizer and the GGUF's vocabulary differ on "
            f"{len(differing)} of {size} ids (e.g. {sample}); load the tokenizer of this GGUF"
        )
        raise ModelLoadError(msg)
