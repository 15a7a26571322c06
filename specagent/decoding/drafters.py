"""Drafters: cheap proposers of the next k tokens.

One small interface (as transformers' ``CandidateGenerator``): ``propose(context, k, ...)`` returns
up to k tokens and, where the drafter has one, the distribution q each was drawn from. A drafter
object lives for one call and keeps that call's state (a draft KV cache); ``observe`` tells it how
many of its tokens were accepted.

- ``DraftModelDrafter`` and ``EarlyExitDrafter`` (``draft_model.py``): a separate small model
  sharing the target's tokenizer, or the target's own first N layers (self-speculation).
- ``PromptLookupDrafter``: copies what followed the latest earlier occurrence of the last n-gram in
  the prompt or output: free, and strong on extraction, editing and tool-call arguments.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from .engine import ForwardRequest, advance
from .proposal import EMPTY, DraftTree, Proposal, TokenConstraint
from .sampling import SamplingParams
from .schedule import AdaptiveSchedule, FixedSchedule, Schedule

if TYPE_CHECKING:
    from .parts import DrafterSettings, DraftingParts

__all__ = [
    "Drafter",
    "PromptLookupDrafter",
    "StepwiseDrafter",
    "build_no_drafter",
    "build_prompt_lookup",
    "lookup_continuation",
    "run_inline",
]


T = TypeVar("T")


def run_inline(steps: Generator[ForwardRequest, torch.Tensor | None, T]) -> T:
    """Drive a coroutine of forward requests to its value, running each forward directly."""
    try:
        item = advance(steps, None, inline=True)
    except StopIteration as stop:
        return stop.value
    raise TypeError(f"a drafting coroutine yielded {type(item).__name__}, not a forward request")


class Drafter:
    """Proposes draft tokens for one call. A drafter answers ``propose`` at once (no model to
    run: lookup, history) or, running a model, is a ``StepwiseDrafter`` whose ``propose_steps``
    yields each forward so the runtime can batch them across calls. What a drafter does not
    need (tree feedback, a cache to leave) it inherits as a no-op."""

    name: str = "drafter"

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Proposal:
        """Up to ``k`` tokens to follow ``context`` (prompt + output so far). Under a
        ``constraint``, only allowed tokens, each consumed into it (the loop rolls them back)."""
        raise NotImplementedError

    def propose_steps(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        """``propose`` as a coroutine of forward requests: none here (nothing to run)."""
        yield from ()
        return self.propose(context, k, params, generator, constraint)

    def observe(self, proposed: int, accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted (nothing to learn here)."""

    def observe_tree(self, tree: DraftTree, path: list[int]) -> None:
        """The last proposal's token tree was judged: the accepted ``path`` (nodes). By default
        the drafter learns how far the path followed the proposal's own tokens (the tree's
        first draft)."""
        self.observe(len(tree.chains[0]), tree.accepted_of(0, path))

    def leave_cache(self) -> None:
        """At the end of the call: hand what the drafter holds for later calls to the prefix
        cache (nothing here)."""


class StepwiseDrafter(Drafter):
    """Base of drafters that run a model: ``propose_steps`` yields each draft forward (so the
    runtime can batch them across calls); ``propose`` runs them inline."""

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Proposal:
        return run_inline(self.propose_steps(context, k, params, generator, constraint))

    def propose_steps(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        raise NotImplementedError


class PromptLookupDrafter(Drafter):
    """n-gram lookup in the context (Saxena 2023; transformers' prompt lookup decoding).

    Tries the longest n-gram first (``max_ngram`` down to ``min_ngram``) and takes the most recent
    earlier match, which tracks what the output is currently copying."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            msg = f"prompt_lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            raise ValueError(msg)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Proposal:
        if k <= 0:
            return EMPTY
        follow = lookup_continuation(context, k, self.min_ngram, self.max_ngram)
        if not follow:
            return EMPTY
        found = _admissible(follow, constraint)
        return Proposal(found.tokens, masks=found.masks, source="history")


def build_prompt_lookup(
    config: DrafterSettings, parts: DraftingParts
) -> tuple[Drafter | None, Schedule]:
    """The registry's builder: lookup drafts are free, so an adaptive schedule prices only
    the verification (``parts.costs(None)``)."""
    drafter = PromptLookupDrafter(max_ngram=config.max_ngram, min_ngram=config.min_ngram)
    k = config.num_speculative_tokens
    if not config.adaptive:
        return drafter, FixedSchedule(k)
    return drafter, AdaptiveSchedule(max_k=k, costs=parts.costs(None))


def build_no_drafter(
    config: DrafterSettings, parts: DraftingParts
) -> tuple[Drafter | None, Schedule]:
    """Plain decoding: no drafter, k = 0 at every step."""
    return None, FixedSchedule(0)


def lookup_continuation(
    context: Sequence[int], limit: int, min_ngram: int, max_ngram: int
) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the context's last
    n-gram (longest n first, ``max_ngram`` down to ``min_ngram``); empty when none occurs."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = context[length - n :]
        # Search right to left, excluding the tail itself.
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + limit]
                if follow:
                    return list(follow)
    return []


def _admissible(tokens: list[int], constraint: TokenConstraint | None) -> Proposal:
    """The longest prefix of ``tokens`` the constraint allows, consumed into it, with masks."""
    if constraint is None:
        return Proposal(tokens=tokens)
    masks: list[torch.Tensor] = []
    for token in tokens:
        mask = constraint.allowed()
        if not bool(mask[token]):
            break
        masks.append(mask)
        constraint.consume([token])
        if constraint.is_stopped():
            break
    kept = tokens[: len(masks)]
    return Proposal(tokens=kept, masks=masks) if kept else EMPTY
