"""Grouped-query attention under a custom mask without a copy of the keys and values per query
head, where that measures faster.

Why: a forward of several new tokens under a mask (a verification over a long context, a
batched round over KV slots, a token tree) reaches transformers' sdpa attention with a mask and
more than one query. For a grouped-query model (Qwen2.5: 6 or 7 query heads per key/value head)
transformers then repeats every key/value head for its query heads (``repeat_kv``) before torch's
kernel: a copy of the whole cached KV per layer per forward, which on a CPU also sends the
kernel down a slower path. Measured on a 2-core Zen 4 (``benchmarks/batched_decode.py``: Llama
12 x 256, 8 query and 4 key/value heads, 16 calls over slots at 2,048 tokens): a verification
of 5 new tokens per call took 242 ms with the repeat and 86 ms with torch's own grouped heads
(``enable_gqa``), and calls drafting 4 tokens a round decoded at 0.32x the time per token; one
new token costs the same either way in eager mode (transformers folds the groups into the
query for a single token, but not under ``torch.compile``, so compiled graphs take the grouped
heads for one token too). torch's grouped
heads under a mask are not fast everywhere (on CUDA such a call falls back to the math kernel,
transformers notes), so ``choose_attention`` times both on the model's own head shape and device
when the runner is made and switches the model to ``grouped_sdpa`` only where it is clearly
faster. The numbers are sdpa's: the same kernel over the same keys, grouped instead of copied.

``grouped_sdpa`` is registered with transformers' attention and mask interfaces under ``NAME``;
the model keeps sdpa's masks (boolean) and everything sdpa does without a mask or for one
query.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["MIN_GAIN", "NAME", "choose_attention", "grouped_sdpa", "is_sdpa"]

NAME = "specagent_grouped_sdpa"
MIN_GAIN = 0.8
"""Grouped heads are used only where a masked forward takes less than this share of sdpa's."""


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except that several queries under a mask attend to the
    grouped key/value heads in place (torch's ``enable_gqa``) instead of a repeated copy."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (
        kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and (dropout == 0.0 or not module.training)
    )
    # For one query transformers folds the groups into it, except under torch.compile, where
    # it copies the KV as for several.
    several = query.shape[2] > 1 or torch.compiler.is_compiling()
    if groups > 1 and attention_mask is not None and several and plain:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)


def is_sdpa(implementation: str | None) -> bool:
    """Whether a model's attention takes sdpa's (boolean) masks: sdpa itself or ``NAME``."""
    return implementation in ("sdpa", NAME)


def choose_attention(model: Any) -> str | None:
    """Switch ``model`` (sdpa attention, grouped query heads) to ``grouped_sdpa`` where a masked
    forward of several tokens measures faster so on its device and head shape; returns the
    attention it runs with (None: not a model this applies to, left as it is)."""
    config: Any = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == NAME:
        return NAME
    heads: Any = getattr(config, "num_attention_heads", None)
    kv_heads: Any = getattr(config, "num_key_value_heads", None) or heads
    hidden: Any = getattr(config, "hidden_size", None)
    if implementation != "sdpa" or not all(isinstance(n, int) for n in (heads, kv_heads, hidden)):
        return implementation
    if kv_heads >= heads or heads % kv_heads:
        return implementation
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    parameter = next(model.parameters())
    if _grouped_is_faster(parameter.device, parameter.dtype, heads, kv_heads, head_dim):
        config._attn_implementation = NAME
        return NAME
    return implementation


@functools.cache
def _grouped_is_faster(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Time a masked attention of 4 calls x 5 new tokens over 1,024 cached positions both ways
    (a few milliseconds; once per process, device and shape)."""
    calls, new, cached = 4, 5, 1024
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    query = tensor(calls, heads, new, head_dim)
    key = tensor(calls, kv_heads, cached, head_dim)
    value = tensor(calls, kv_heads, cached, head_dim)
    mask = torch.ones(calls, 1, new, cached, dtype=torch.bool, device=device)
    mask[..., cached - new :] = torch.ones(new, new, dtype=torch.bool, device=device).tril()

    class _Module(torch.nn.Module):
        num_key_value_groups = heads // kv_heads

    module = _Module().eval()

    def seconds(attention: Any) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(7):
                start = time.perf_counter()
                out, _ = attention(module, query, key, value, mask)
                float(out[0, 0, 0, 0])  # synchronise with the device before reading the clock
                times.append(time.perf_counter() - start)
        return sorted(times[1:])[len(times[1:]) // 2]

    try:
        return seconds(grouped_sdpa) < MIN_GAIN * seconds(sdpa_attention_forward)
    except (RuntimeError, TypeError):  # a torch without grouped heads in sdpa
        return False
