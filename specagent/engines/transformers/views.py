"""What the transformers engine reads of a model, apart from running it: the keyword its
forward takes its cache by (``cache=`` in new transformers releases, ``past_key_values=`` in
older ones), its decoder body without the LM head, all of it read once (``ModelView``), a view
over its first layers (early exit), and a copy in another dtype for long forwards
(``PrefillTwin``)."""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ...decoding.engine import align_vocab
from .attention import is_sdpa

__all__ = [
    "ModelView",
    "PrefillTwin",
    "cache_keyword",
    "decoder_body",
    "early_exit_view",
    "plain_layers",
]


@functools.lru_cache(maxsize=64)
def _forward_params(model_type: Any) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def cache_keyword(model_type: Any) -> str:
    """The forward keyword that takes the KV cache: ``cache`` in new transformers releases,
    ``past_key_values`` in older ones."""
    return "cache" if "cache" in _forward_params(model_type) else "past_key_values"


@dataclass(frozen=True)
class PrefillTwin:
    """A copy of a runner's model in another dtype, for its forwards over ``from_rows`` tokens
    or more: on a CPU without native bf16, a bf16 draft decodes single tokens faster than in
    float32 but prefills a prompt several times slower; with AMX, a float32 draft's single
    tokens can cost what bf16's do while its long forwards cost twice as much (``precision``).
    Its KV is cast into the runner's own cache, so every later forward continues in the model's
    dtype. Only for a draft: a draft's numbers never touch losslessness, a target's define it."""

    model: PreTrainedModel
    from_rows: int


def decoder_body(model: PreTrainedModel) -> nn.Module | None:
    """The model without its LM head (``model.model`` for Llama-style models), if any."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    head = model.get_output_embeddings()
    if not isinstance(base, nn.Module) or base is model or head is None:
        return None
    return base


@dataclass(frozen=True)
class ModelView:
    """What every forward of a runner needs to know about its model, read once when the runner
    is made: how to pass it a cache, whether it cuts its logits itself, its decoder body."""

    model: PreTrainedModel
    vocab_size: int
    """Columns of the logits the runner returns (a draft's aligned to the target's)."""
    device: torch.device
    dtype: torch.dtype
    body: nn.Module | None
    """The model without its LM head (``decoder_body``), None where it has none."""
    cache_kw: str
    """The keyword the model's forward takes its cache by (``cache_keyword``)."""
    body_cache_kw: str
    """The keyword the decoder body's forward takes it by."""
    keeps_logits: bool
    """Whether the model's forward takes ``logits_to_keep``."""

    @classmethod
    def of(cls, model: PreTrainedModel, vocab_size: int | None = None) -> ModelView:
        head = model.get_output_embeddings()
        own_vocab = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        body = decoder_body(model)
        first = next(model.parameters())
        return cls(
            model=model,
            vocab_size=vocab_size or own_vocab,
            device=first.device,
            dtype=first.dtype,
            body=body,
            cache_kw=cache_keyword(type(model)),
            body_cache_kw=cache_keyword(type(body)) if body is not None else "past_key_values",
            keeps_logits="logits_to_keep" in _forward_params(type(model)),  # type: ignore[arg-type]
        )

    @property
    def mask_dtype(self) -> torch.dtype | str | None:
        """What a custom attention mask is for this model's attention: additive in the
        model's dtype (eager), boolean (sdpa: None), or "other" (no custom mask)."""
        implementation = getattr(self.model.config, "_attn_implementation", None) or "eager"
        if implementation == "eager":
            return self.dtype
        return None if is_sdpa(implementation) else "other"

    def finished(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits as every caller gets them: the target's vocabulary, float32."""
        if logits.shape[-1] != self.vocab_size:
            logits = align_vocab(logits, self.vocab_size)
        return logits.float()

    def dynamic_cache(self) -> DynamicCache:
        """An ordinary, empty transformers cache for this model."""
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()


def plain_layers(cache: DynamicCache) -> bool:
    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


def early_exit_view(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A model that runs only the first ``num_layers`` decoder layers of ``model``, then its final
    norm and LM head. It shares every parameter with ``model`` (no second copy in memory) and
    leaves ``model`` untouched: shallow copies of the wrappers, a truncated layer list and a
    config copy that says ``num_hidden_layers = num_layers``."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    layers = getattr(base, "layers", None)
    if base is None or not isinstance(layers, nn.ModuleList):
        msg = (
            f"early_exit needs a decoder with a `{prefix}.layers` list (Llama, Qwen, Mistral); "
            f"{type(model).__name__} has none"
        )
        raise ValueError(msg)
    total = len(layers)
    if not 1 <= num_layers < total:
        msg = (
            f"early_exit layers must be between 1 and {total - 1} for this model, got {num_layers}"
        )
        raise ValueError(msg)

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]

    view_base = copy.copy(base)
    view_base._modules = dict(base._modules)
    view_base.layers = nn.ModuleList(list(layers)[:num_layers])
    view_base.config = config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    setattr(view, prefix, view_base)
    view.config = config
    return view
