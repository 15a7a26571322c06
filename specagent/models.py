"""Loading target and draft models with transformers, and checking that they can work together.

Loading from a local path or a hub id both go through ``from_pretrained``; nothing here downloads
on its own. ``trust_remote_code`` is False unless the caller passes True.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .errors import IncompatibleDraftError, ModelLoadError

__all__ = [
    "check_draft_compatible",
    "context_window",
    "load_config",
    "load_model",
    "load_tokenizer",
    "model_vocab_size",
    "num_layers",
    "resolve_device",
    "resolve_dtype",
]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"`` (or None) picks CUDA, then Apple MPS, then the CPU."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A dtype by name. ``"auto"`` here is the choice made without measuring: bfloat16 on
    CUDA, float32 elsewhere; ``SpecRuntime.from_pretrained`` measures instead
    (``engines.transformers.precision``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        msg = f"unknown dtype {dtype!r}; expected 'auto' or one of {sorted(names)}"
        raise ModelLoadError(msg)
    return names[dtype]


def load_model(
    source: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM from a local directory or a hub id, in eval mode on ``device``."""
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(
            source, torch_dtype=dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as exc:
        msg = f"cannot load model {source!r}: {exc}"
        raise ModelLoadError(msg) from exc
    model.to(device)  # type: ignore[arg-type]  # transformers types .to() oddly
    return model.eval()


def load_config(source: str, *, trust_remote_code: bool = False) -> Any:
    """The model's config alone (no weights): enough to key measurements of its shapes."""
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        msg = f"cannot load the config of {source!r}: {exc}"
        raise ModelLoadError(msg) from exc


def load_tokenizer(source: str, *, trust_remote_code: bool = False) -> Any:
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        msg = f"cannot load tokenizer {source!r}: {exc}"
        raise ModelLoadError(msg) from exc


def model_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output embedding: the size of the model's logits."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def context_window(model: PreTrainedModel) -> int | None:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model.config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def num_layers(model: Any) -> int:
    """Decoder layers of the model (0 when its config does not say)."""
    return int(getattr(model.config, "num_hidden_layers", 0))


def check_draft_compatible(
    target_vocab: int,
    draft_vocab: int,
    tokenizer: Any | None,
    draft_tokenizer: Any | None = None,
) -> None:
    """Raise ``IncompatibleDraftError`` unless the draft's token ids mean what the target's do.

    With both tokenizers: every token of the target's vocabulary must have the same id in the
    draft's. Always: the draft's logits must cover every id the tokenizer can produce (models
    often pad the embedding beyond the tokenizer; those padding ids are never drafted).
    ``target_vocab`` and ``draft_vocab`` are the columns of each model's logits.
    """
    if draft_tokenizer is not None and tokenizer is not None:
        t_vocab, d_vocab = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        differing = [tok for tok, idx in t_vocab.items() if d_vocab.get(tok) != idx]
        if differing:
            sample = ", ".join(repr(t) for t in differing[:5])
            msg = (
                f"the draft tokenizer differs from the target's on {len(differing)} of "
                f"{len(t_vocab)} tokens (e.g. {sample}); speculative decoding needs one vocabulary"
            )
            raise IncompatibleDraftError(msg)
    used = len(tokenizer) if tokenizer is not None else min(target_vocab, draft_vocab)
    if draft_vocab < used or target_vocab < used:
        msg = (
            f"vocabulary sizes do not fit: tokenizer has {used} tokens, target logits "
            f"{target_vocab}, draft logits {draft_vocab}; the draft must cover every token"
        )
        raise IncompatibleDraftError(msg)
    if tokenizer is None and target_vocab != draft_vocab:
        msg = (
            f"target ({target_vocab}) and draft ({draft_vocab}) vocabularies differ and no "
            "tokenizer was given to tell which ids are real"
        )
        raise IncompatibleDraftError(msg)
