"""A transformers checkpoint: its dtype by name, its weights and config loaded from a local
directory or a hub id (through ``from_pretrained``: nothing here downloads on its own;
``trust_remote_code`` is False unless the caller passes True), and the facts its config gives
(the logits' width, the context window, the layers)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ...errors import ModelLoadError

__all__ = [
    "context_window",
    "load_config",
    "load_model",
    "model_vocab_size",
    "num_layers",
    "resolve_dtype",
]


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
