"""KV-cache bookkeeping for target and draft models.

A call keeps one transformers ``DynamicCache`` per model. After a verification step rejects draft
tokens, the cache is cropped back to the accepted length (``crop_to``), so no step recomputes the
prefix. The helpers here also hide the one API difference that matters across transformers
versions: the cache keyword (``cache=`` in new releases, ``past_key_values=`` in older ones).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

__all__ = ["ModelRunner", "crop_to", "early_exit_view"]


@functools.lru_cache(maxsize=64)
def _forward_params(model_type: Any) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop cached positions beyond ``length`` (a negative crop works on every transformers
    version that has ``DynamicCache.crop``)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class ModelRunner:
    """Runs one causal LM forward over new tokens with its cache, returning float32 logits.

    Batch size is 1 here: one call's sequence. ``logits_to_keep`` avoids computing the
    vocabulary projection for prompt positions nobody reads.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None) -> None:
        self.model = model
        params = _forward_params(type(model))  # type: ignore[arg-type]
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        head = model.get_output_embeddings()
        own_vocab = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        self.vocab_size = vocab_size or own_vocab
        """Size of the logits this runner returns (a draft's are aligned to the target's)."""
        self.device = next(model.parameters()).device

    def new_cache(self) -> DynamicCache:
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    @torch.inference_mode()
    def forward(
        self, input_ids: list[int], cache: DynamicCache, keep: int | None = None
    ) -> torch.Tensor:
        """Feed ``input_ids`` after what ``cache`` holds; returns logits ``[n_kept, V]``.

        ``keep`` = how many trailing positions need logits (None: all of them)."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if keep is not None and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        logits = self.model(input_ids=ids, **kwargs).logits[0]
        if keep is not None:
            logits = logits[-keep:] if keep > 0 else logits[:0]
        if logits.shape[-1] != self.vocab_size:
            logits = _align_vocab(logits, self.vocab_size)
        return logits.float()


def _align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Make a draft's logits cover exactly the target's vocabulary: ids the target lacks are cut,
    ids only the target has (padding rows) get -inf so the draft never proposes them."""
    n = logits.shape[-1]
    if n > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - n), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


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
