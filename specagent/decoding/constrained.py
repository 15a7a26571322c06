"""A step under a grammar (``TokenConstraint``): the tokens it forces, taken as free drafts; a
step's proposal joined from forced and drafted tokens; the allowed-token masks verification
applies, the constraint rolled back to the accepted context; the emitted tokens fed to it."""

from __future__ import annotations

import torch

from .drafters.base import admissible
from .proposal import EMPTY, Proposal, TokenConstraint

__all__ = [
    "consume_until_complete",
    "joined",
    "masks_and_rewind",
    "one_hot",
    "take_forced",
]


def take_forced(constraint: TokenConstraint | None, limit: int) -> Proposal:
    """The tokens the grammar forces next (at most ``limit``), consumed into it, with their
    masks: free to draft, and accepted whenever the constrained target allows only them."""
    if constraint is None or limit <= 0 or constraint.is_stopped():
        return EMPTY
    tokens = constraint.forced()[:limit]
    if not tokens:
        return EMPTY
    taken = admissible(tokens, constraint)
    return Proposal(taken.tokens, masks=taken.masks, source="grammar")


def joined(forced: Proposal, proposal: Proposal, tail: Proposal) -> Proposal:
    """One step's proposal: forced tokens, the drafter's, forced tokens again. A drafter that
    samples gives q for its own tokens; forced ones are proposed deterministically (one-hot)."""
    if not forced.tokens and not tail.tokens:
        return proposal
    tokens = [*forced.tokens, *proposal.tokens, *tail.tokens]
    masks = [*(forced.masks or []), *(proposal.masks or []), *(tail.masks or [])]
    probs = proposal.probs
    if probs is not None:
        probs = torch.cat([one_hot(forced.tokens, probs), probs, one_hot(tail.tokens, probs)])
    return Proposal(tokens, probs=probs, masks=masks or None, source=proposal.source)


def one_hot(tokens: list[int], like: torch.Tensor) -> torch.Tensor:
    """``[len(tokens), V]`` rows of q for deterministically proposed tokens."""
    rows = like.new_zeros(len(tokens), like.shape[-1])
    if tokens:
        index = torch.tensor(tokens, dtype=torch.long, device=like.device)
        rows[torch.arange(len(tokens), device=like.device), index] = 1.0
    return rows


def masks_and_rewind(constraint: TokenConstraint, proposal: Proposal) -> torch.Tensor:
    """``[k+1, V]`` allowed-token masks: the drafted positions' (from the drafter, which consumed
    its tokens into the constraint) and the bonus position's; then the constraint is rolled back
    to the accepted context, since the target has not yet decided on any draft token."""
    rows = list(proposal.masks or [])
    if constraint.is_stopped():
        # The drafts completed the grammar: whatever comes after them is cut off, so the bonus
        # row only needs to be a valid distribution.
        rows.append(torch.ones_like(rows[-1]))
    else:
        rows.append(constraint.allowed())
        if not bool(rows[-1].any()):
            raise RuntimeError("the grammar allows no token here; it cannot be completed")
    constraint.rollback(len(proposal.tokens))
    return torch.stack(rows)


def consume_until_complete(constraint: TokenConstraint, tokens: list[int]) -> list[int]:
    """Feed emitted tokens to the constraint; drop any that follow the grammar's completion."""
    for i, token in enumerate(tokens):
        if constraint.is_stopped():
            return tokens[:i]
        constraint.consume([token])
    return tokens
