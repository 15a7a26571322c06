"""Logits to probabilities, and sampling from them with a caller-owned ``torch.Generator``.

Target and draft logits go through the *same* processing (temperature, top-k, top-p), so the
acceptance rules compare like with like. Greedy decoding (temperature 0) never builds a
distribution: it takes the argmax, and the rules fall back to exact matching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "logits_to_probs", "make_generator", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How a distribution is shaped before sampling. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose mass reaches top_p; 1.0 keeps all."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into probabilities ``[..., V]`` (float32) as ``params`` says.

    With ``params.greedy`` this returns the plain softmax (temperature 1): the relaxed rules
    read the target's confidence from it, while the token choice stays the argmax.
    """
    logits = logits.float()
    if not params.greedy and params.temperature != 1.0:
        logits = logits / params.temperature
    if not params.greedy and params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not params.greedy and params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Mass strictly before each token: a token is kept while that mass is below top_p,
        # so the most likely token is always kept.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of ``probs [..., V]``; returns ``[...]`` (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    drawn = torch.multinomial(flat, 1, generator=generator)
    return drawn.reshape(probs.shape[:-1])


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator owned by one call, so concurrent calls never share random state."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
