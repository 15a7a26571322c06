"""Single-query attention as grouped matrix products, where that measures faster than SDPA.

A decoding step attends with one query row per head: every draft-model step, every plain target
step. transformers runs it through ``F.scaled_dot_product_attention``, whose CPU flash kernel
is slow for one query in bf16. On the 2-core Zen 4 EPYC (torch 2.13), 14 query heads over 2 KV
heads of 64: 111 us at 150 cached tokens, 337 at 400, 627 at 800; the same attention as two
grouped products in float32 (each KV head's queries stacked, so no KV head is copied): 43, 53
and 75 us. For the 0.5B draft's 24 layers at a few hundred tokens that is 5-14 ms of a 40 ms
step; the 1.5B target (12 heads of 128) lost 0.2-1 ms a layer. In float32 the two are even.
Several query rows (a verification) keep SDPA: there the two are even too.

So a runner's forwards (``ModelRunner``) run their model with ``single_query_attention``: the
model's ``sdpa`` attention becomes ``NAME`` for the duration, in that thread only, and one-query
calls whose shape and dtype measured clearly faster grouped (``MIN_GAIN``, timed once per shape
at ``PROBE_CONTEXT`` cached tokens) run grouped; everything else is transformers' own SDPA,
with its own masks. The scores and the softmax are computed in float32 (SDPA's CPU kernels
accumulate in float32 too), so only the rounding of the output differs.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["MIN_GAIN", "NAME", "PROBE_CONTEXT", "grouped_attention", "single_query_attention"]

NAME = "specagent_sdpa"
"""The attention implementation name registered with transformers (SDPA's masks)."""

MIN_GAIN = 0.8
"""Grouped products are used for a shape only where they take less than this share of SDPA's
time: a near tie keeps transformers' own kernel."""

PROBE_CONTEXT = 256
"""Cached tokens the one-time timing per shape attends over."""

_local = threading.local()
_choices: dict[tuple[Any, ...], bool] = {}
_choices_lock = threading.Lock()
_registered: bool | None = None


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, H, L, D]`` over ``key``/``value`` ``[B, Hk, S, D]`` (H a
    multiple of Hk; query heads ``h * H/Hk`` to ``(h + 1) * H/Hk - 1`` share KV head ``h``),
    ``mask`` boolean (True: attend) or additive, ``[B or 1, 1 or H, L, S]``; returns
    ``[B, L, H, D]`` in the query's dtype, computed in float32."""
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    stacked = query.float().reshape(batch, kv_heads, group * rows, dim)
    scores = torch.matmul(stacked, key.float().transpose(-1, -2)).mul_(scaling)
    scores = scores.view(batch, kv_heads, group, rows, length)
    if mask is not None:
        if mask.shape[1] == 1:
            per_head = mask[:, :, None]
        else:
            per_head = mask.reshape(mask.shape[0], kv_heads, group, rows, length)
        if per_head.dtype == torch.bool:
            scores = scores.masked_fill(~per_head, float("-inf"))
        else:
            scores = scores + per_head.float()
    weights = scores.softmax(-1).view(batch, kv_heads, group * rows, length)
    out = torch.matmul(weights, value.float()).view(batch, heads, rows, dim)
    return out.transpose(1, 2).contiguous().to(query.dtype)


def _faster_grouped(query: torch.Tensor, key: torch.Tensor, sdpa: Any, module: Any) -> bool:
    """Whether grouped products beat SDPA for one query of this shape and dtype (timed once)."""
    shape = (query.dtype, query.device.type, query.shape[1], key.shape[1], query.shape[-1])
    with _choices_lock:
        if shape in _choices:
            return _choices[shape]
    dtype, _, heads, kv_heads, dim = shape
    q = torch.randn(1, heads, 1, dim).to(dtype)
    k = torch.randn(1, kv_heads, PROBE_CONTEXT, dim).to(dtype)
    v = torch.randn(1, kv_heads, PROBE_CONTEXT, dim).to(dtype)
    scaling = dim**-0.5
    forms = {
        "sdpa": lambda: sdpa(module, q, k, v, None, scaling=scaling),
        "grouped": lambda: grouped_attention(q, k, v, None, scaling),
    }
    readings: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(3):  # warm both, then time them in alternating passes
        for run in forms.values():
            run()
    for order in (1, -1, 1, -1, 1):
        for name in list(forms)[::order]:
            start = time.perf_counter()
            forms[name]()
            readings[name].append(time.perf_counter() - start)
    chosen = statistics.median(readings["grouped"]) < MIN_GAIN * statistics.median(readings["sdpa"])
    with _choices_lock:
        _choices[shape] = chosen
    return chosen


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: grouped products for one query where they
    measured faster, in a thread inside ``single_query_attention``; SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (
        getattr(_local, "depth", 0) > 0
        and query.shape[2] == 1
        and query.device.type == "cpu"
        and not dropout
        and query.shape[1] % key.shape[1] == 0
        and key.shape[-1] == value.shape[-1] == query.shape[-1]
        and all(kwargs.get(name) is None for name in ("softcap", "position_bias", "s_aux"))
    )
    if plain and _faster_grouped(query, key, sdpa_attention_forward, module):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return grouped_attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _register() -> bool:
    """Register ``NAME`` with transformers (once); False where this transformers has no
    attention or mask registry."""
    global _registered
    if _registered is None:
        try:
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
            from transformers.modeling_utils import AttentionInterface
        except ImportError:
            _registered = False
        else:
            AttentionInterface.register(NAME, _attention)
            AttentionMaskInterface.register(NAME, sdpa_mask)
            _registered = True
    return _registered


@contextlib.contextmanager
def single_query_attention(model: Any) -> Iterator[None]:
    """Run ``model``'s forwards inside with ``NAME`` in place of its ``sdpa`` attention (this
    thread's one-query calls grouped where faster; other threads meanwhile get SDPA itself).
    A no-op for models on another attention implementation."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME) or not _register():
        yield
        return
    assert config is not None
    before = config._attn_implementation
    _local.depth = getattr(_local, "depth", 0) + 1
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
        _local.depth -= 1
