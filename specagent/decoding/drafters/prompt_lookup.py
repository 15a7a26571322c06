"""``prompt_lookup``: copies what followed the latest earlier occurrence of the last n-gram in
the prompt or output (Saxena 2023; transformers' prompt lookup decoding): free, and strong on
extraction, editing and tool-call arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..proposal import EMPTY, Proposal, TokenConstraint
from ..sampling import SamplingParams
from ..schedule import AdaptiveSchedule, FixedSchedule, Schedule
from .base import Drafter, DrafterKind, admissible, lookup_continuation

if TYPE_CHECKING:
    from ..parts import DrafterSettings, DraftingParts

__all__ = ["KIND", "PromptLookupDrafter"]


class PromptLookupDrafter(Drafter):
    """n-gram lookup in the context.

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
        found = admissible(follow, constraint)
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


KIND = DrafterKind(build_prompt_lookup)
