"""Logits to probabilities, and sampling from them with a caller-owned ``torch.Generator``.

Target and draft logits go through the *same* processing (temperature, top-k, top-p), so the
acceptance rules compare like with like. Greedy decoding (temperature 0) never builds a
distribution: it takes the argmax, and the rules fall back to exact matching.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "SamplingParams",
    "TokenLogprob",
    "logits_to_probs",
    "make_generator",
    "sample",
    "token_logprobs",
]


@dataclass(frozen=True)
class SamplingParams:
    """How a distribution is shaped before sampling. ``temperature == 0`` means greedy."""

    temperature: float
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
        probs = _top_p(probs, params.top_p)
    return probs


_TOP_P_HEAD = 1024
"""Tokens ``_top_p`` ranks first; almost always they hold the top_p mass, so the full sort of a
150k vocabulary (the largest cost of sampling on a CPU) is rarely needed."""


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``, renormalised.

    A token is kept while the mass strictly before it (in descending order) is below top_p, so
    the most likely token always stays. When the ``_TOP_P_HEAD`` most likely tokens of every
    row hold top_p between them, every other token has at least that much mass before it and is
    dropped: ranking those few is then the same as sorting the whole vocabulary (on a CPU,
    where reading whether they do costs nothing)."""
    head = min(_TOP_P_HEAD, probs.shape[-1])
    # Whether the head holds top_p is read on the host; on an accelerator that read waits for
    # the device, and the full sort costs less than the wait: always sorted there.
    if head == probs.shape[-1] or probs.device.type == "cpu":
        values, order = torch.topk(probs, head, dim=-1)  # sorted, descending
        if head == probs.shape[-1] or bool((values.sum(dim=-1) >= top_p).all()):
            before = torch.cumsum(values, dim=-1) - values
            kept = values.masked_fill(before >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, kept)
            return probs / probs.sum(dim=-1, keepdim=True)
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered
    drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


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


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's distribution at its position
    (the logits of the verification that accepted it, log-softmaxed before temperature, top-k
    and top-p; with a grammar, over the tokens it allows), and the ``top`` most likely tokens
    there with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int
) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability at ``logits[rows[i]]`` and that row's ``top`` most
    likely tokens: one log-softmax over the rows asked for, read back to the host once."""
    if not tokens:
        return []
    index = torch.tensor(list(rows[: len(tokens)]), device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    ids = torch.tensor(list(tokens), device=logits.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen, strict=True)]
    values, best = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return [
        TokenLogprob(t, v, tuple(zip(b, w, strict=True)))
        for t, v, b, w in zip(tokens, chosen, best.tolist(), values.tolist(), strict=True)
    ]
