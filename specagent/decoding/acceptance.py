"""Deciding which draft tokens the target accepts.

Notation used throughout (as in Leviathan et al. 2023): **p is the target's distribution, q is the
draft's.** For a step with k draft tokens ``x_1..x_k``, ``q`` has shape ``[k, V]`` (the draft's
distribution at each drafted position) and ``p`` has shape ``[k + 1, V]``: one row per drafted
position plus the bonus row that follows the last draft token.

Lossless (``verify_lossless``) is Algorithm 1 of Leviathan et al. (and Chen et al. 2023): accept
``x_i`` with probability ``min(1, p(x)/q(x))``; at the first rejection, sample from
``norm(max(0, p - q))``; when all k are accepted, sample one bonus token from the last row of p.
The emitted tokens are then distributed exactly as the target's.

Relaxed rules accept *at least* what the lossless rule accepts, and more where their criterion
says the draft token is good enough. Any rule is an acceptance probability ``a(x)`` per token;
with it, the token emitted at a position has the exact distribution

    pi = q * a + (1 - sum(q * a)) * r,   r = norm(max(0, p - q * a)),

(``induced_distribution``), so the cost of a relaxed step is computed, not estimated:
``TV(pi, p) = 0.5 * sum|pi - p|``. With ``a = min(1, p/q)`` this gives ``pi = p`` exactly.

Greedy decoding (temperature 0) uses exact matching with the target's argmax (``verify_greedy``);
a relaxed rule may also accept a non-argmax draft token, and the divergence of a greedy call is the
fraction of emitted tokens that differ from the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from .sampling import sample

__all__ = [
    "AcceptanceBlock",
    "LenienceAcceptance",
    "LenienceRule",
    "RelaxedRule",
    "TopKAcceptance",
    "TopKRule",
    "TypicalAcceptance",
    "TypicalRule",
    "Verdict",
    "induced_distribution",
    "lossless_acceptance",
    "total_variation",
    "verify_greedy",
    "verify_lossless",
    "verify_relaxed",
]


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one step's draft tokens."""

    num_accepted: int
    """How many of the draft tokens were accepted (a prefix of them)."""
    next_token: int
    """The token emitted after the accepted ones: a correction, or the bonus token."""
    divergences: list[float] = field(default_factory=list)
    """TV distance from the target, per emitted token (``num_accepted + 1`` entries)."""


def lossless_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``min(1, p/q)`` elementwise; 1 where q is 0 (such tokens are never drafted)."""
    ratio = torch.where(q > 0, p / q.clamp_min(torch.finfo(q.dtype).tiny), torch.ones_like(p))
    return ratio.clamp(max=1.0)


class RelaxedRule(Protocol):
    """A lossy acceptance criterion. ``criterion`` gives, per vocabulary entry, a probability of
    accepting beyond what exact verification accepts; rules never accept *less* than lossless."""

    @property
    def name(self) -> str: ...

    def criterion(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``p, q: [n, V]`` -> acceptance probability ``[n, V]`` in [0, 1]."""
        ...


@dataclass(frozen=True)
class TypicalRule:
    """Typical acceptance (Medusa, Cai et al. 2024): accept x if
    ``p(x) > min(epsilon, delta * exp(-H(p)))``: a high-entropy target tolerates more tokens."""

    epsilon: float = 0.3
    delta: float = 0.09
    name: str = "typical"

    def criterion(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(dim=-1, keepdim=True)
        threshold = torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)
        return (p > threshold).to(p.dtype)


@dataclass(frozen=True)
class TopKRule:
    """Accept x if it is among the target's top-k and ``p(x) >= ratio * max(p)``: the ratio keeps a
    far less likely token out even when it ranks second."""

    top_k: int = 2
    ratio: float = 0.5
    name: str = "top_k"

    def criterion(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, p.shape[-1])
        kth = torch.topk(p, k, dim=-1).values[..., -1:]
        p_max = p.max(dim=-1, keepdim=True).values
        return ((p >= kth) & (p >= self.ratio * p_max) & (p > 0)).to(p.dtype)


@dataclass(frozen=True)
class LenienceRule:
    """Accept x with probability ``min(1, p(x) / (lenience * q(x)))``; ``lenience = 1`` is exact
    speculative sampling, smaller values trust the draft more."""

    lenience: float = 0.5
    name: str = "lenience"

    def criterion(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return lossless_acceptance(p, q * self.lenience)


def induced_distribution(p: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The exact distribution of the token emitted at a position where x ~ q is accepted with
    probability a(x) and a rejection samples from ``norm(max(0, p - q * a))``. ``[..., V]``."""
    accepted = q * a
    residual = residual_distribution(p, accepted)
    reject_mass = (1.0 - accepted.sum(dim=-1, keepdim=True)).clamp_min(0.0)
    return accepted + reject_mass * residual


def residual_distribution(p: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - accepted))``, or p itself where nothing is left (then p == accepted)."""
    residual = (p - accepted).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``0.5 * sum|a - b|`` over the last dimension."""
    return 0.5 * (a - b).abs().sum(dim=-1)


def _first_rejection(accept: torch.Tensor) -> torch.Tensor:
    """Index of the first False in a 1-D bool tensor, or its length if all are True: a 0-d
    tensor on its device (nothing read)."""
    stop = torch.cat([~accept, accept.new_ones(1)])
    return stop.to(torch.uint8).argmax()  # the first of the maxima


def _emitted_row(probs: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Row ``n`` of ``probs`` (``[k + 1, V]``), indexed on the device."""
    return probs.index_select(0, n.view(1))[0]


def _read(n: torch.Tensor, token: torch.Tensor, *rest: torch.Tensor) -> list[float]:
    """The step's outcome to the host in one transfer: ``n``, the next token and ``rest``
    flattened (float32 holds every vocabulary id exactly: ids stay below 2**24)."""
    parts = [n.view(1).float(), token.view(1).float(), *(r.reshape(-1).float() for r in rest)]
    return torch.cat(parts).tolist()


def verify_greedy(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    rule: RelaxedRule | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Greedy verification. ``draft_tokens [k]``, ``target_logits [k+1, V]``.

    Without a rule: accept the longest prefix equal to the target's argmax, then emit the argmax.
    With a rule: a non-argmax draft token is also accepted with the rule's probability, judged on
    the target's plain softmax p against its argmax: the rule sees ``q = max(p)`` everywhere,
    since at temperature 0 the target's choice, not the draft's confidence, is the reference (so
    ``lenience`` accepts x with ``min(1, p(x) / (lenience * max p))``). The divergence of such a
    token is 1, of any other 0.
    """
    k = int(draft_tokens.shape[0])
    # One transfer for the whole step: the target's argmax row and the drafts.
    choices = torch.cat([target_logits.argmax(dim=-1), draft_tokens.to(target_logits.device)])
    both = choices.tolist()
    target_choice, drafts = both[: k + 1], both[k + 1 :]
    matches = [drafts[i] == target_choice[i] for i in range(k)]
    accept = matches
    if rule is not None and k > 0 and not all(matches):
        p = torch.softmax(target_logits[:k].float(), dim=-1)
        reference = p.max(dim=-1, keepdim=True).values.expand_as(p)
        extra = rule.criterion(p, reference).gather(-1, draft_tokens[:, None]).squeeze(-1)
        if generator is None:
            accept_extra = (extra >= 1.0).tolist()
        else:
            u = torch.rand(k, generator=generator, device=extra.device)
            accept_extra = (u < extra).tolist()
        accept = [m or bool(e) for m, e in zip(matches, accept_extra, strict=True)]
    n = next((i for i, ok in enumerate(accept) if not ok), k)
    divergences = [0.0 if matches[i] else 1.0 for i in range(n)] + [0.0]
    return Verdict(num_accepted=n, next_token=target_choice[n], divergences=divergences)


def verify_lossless(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1). ``draft_tokens [k]``,
    ``draft_probs q [k, V]``, ``target_probs p [k+1, V]``. Exactly lossless.

    Decided on the device and read once: the accepted count and the next token together."""
    k = int(draft_tokens.shape[0])
    if k == 0:
        return Verdict(0, int(sample(target_probs[0], generator)), [0.0])
    rows = torch.arange(k, device=draft_tokens.device)
    p_x = target_probs[rows, draft_tokens]
    q_x = draft_probs[rows, draft_tokens]
    u = torch.rand(k, generator=generator, device=p_x.device)
    # u < p/q without dividing: q_x > 0 always holds for a token that was drafted from q.
    n = _first_rejection(u * q_x < p_x)
    # At a rejection, the residual norm(max(0, p - min(q, p))); after k acceptances, p's bonus
    # row itself (q has no row k: its row 0 stands in for the residual that is not taken).
    p_n = _emitted_row(target_probs, n)
    q_n = _emitted_row(torch.cat([draft_probs, draft_probs[:1]]), n)
    residual = residual_distribution(p_n, torch.minimum(q_n, p_n))
    token = sample(torch.where(n < k, residual, p_n), generator)
    accepted, next_token = (int(x) for x in _read(n, token))
    return Verdict(num_accepted=accepted, next_token=next_token, divergences=[0.0] * (accepted + 1))


def verify_relaxed(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    rule: RelaxedRule,
    generator: torch.Generator,
) -> Verdict:
    """Relaxed verification with the same shapes as ``verify_lossless``. The acceptance
    probability is ``max(min(1, p/q), rule)``; the divergence of each emitted token is the TV
    distance of its exact induced distribution from the target's. Read once, as lossless."""
    k = int(draft_tokens.shape[0])
    if k == 0:
        return Verdict(0, int(sample(target_probs[0], generator)), [0.0])
    p, q = target_probs[:k], draft_probs
    a = torch.maximum(lossless_acceptance(p, q), rule.criterion(p, q))  # [k, V]
    rows = torch.arange(k, device=draft_tokens.device)
    u = torch.rand(k, generator=generator, device=p.device)
    n = _first_rejection(u < a[rows, draft_tokens])
    # Every drafted position's divergence, read with the outcome; those past n are dropped.
    tv = total_variation(induced_distribution(p, q, a), p)  # [k]
    p_n = _emitted_row(target_probs, n)
    accepted_mass = _emitted_row(torch.cat([q * a, q[:1]]), n)  # row k: as lossless
    token = sample(torch.where(n < k, residual_distribution(p_n, accepted_mass), p_n), generator)
    read = _read(n, token, tv)
    accepted, next_token = int(read[0]), int(read[1])
    divergences = read[2 : 2 + min(accepted + 1, k)]  # positions whose token came from pi_i
    if accepted == k:
        divergences.append(0.0)  # the bonus token comes from p itself
    return Verdict(num_accepted=accepted, next_token=next_token, divergences=divergences)


# --------------------------------------------------------------------------- policy blocks
# Each rule's block in a policy (``acceptance:``), validated strictly; ``build`` makes the rule.
# Registered by name in ``registry.RULES``.


class AcceptanceBlock(BaseModel):
    """What every relaxed rule's policy block has: its ``rule`` name (the union's tag), the
    divergence budget, and ``build``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: str
    max_divergence: float | None = Field(default=None, gt=0.0, le=1.0)
    """Budget on the call's running mean TV divergence; past it the call continues losslessly."""

    def build(self) -> RelaxedRule:
        raise NotImplementedError


class TypicalAcceptance(AcceptanceBlock):
    """Accept x if ``p(x) > min(epsilon, delta * exp(-H(p)))`` (Medusa's typical acceptance)."""

    rule: Literal["typical"]
    epsilon: float = Field(default=0.3, gt=0.0, le=1.0)
    delta: float = Field(default=0.09, gt=0.0, le=1.0)

    def build(self) -> RelaxedRule:
        return TypicalRule(epsilon=self.epsilon, delta=self.delta)


class TopKAcceptance(AcceptanceBlock):
    """Accept x if it is in the target's top-k and ``p(x) >= ratio * max p``."""

    rule: Literal["top_k"]
    top_k: int = Field(default=2, ge=1, le=100)
    ratio: float = Field(default=0.5, gt=0.0, le=1.0)

    def build(self) -> RelaxedRule:
        return TopKRule(top_k=self.top_k, ratio=self.ratio)


class LenienceAcceptance(AcceptanceBlock):
    """Accept x with ``min(1, p(x) / (lenience * q(x)))``; 1.0 would be lossless."""

    rule: Literal["lenience"]
    lenience: float = Field(default=0.5, gt=0.0, le=1.0)

    def build(self) -> RelaxedRule:
        return LenienceRule(lenience=self.lenience)
