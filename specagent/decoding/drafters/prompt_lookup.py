"""``prompt_lookup``: copies what followed the latest earlier occurrence of the last n-gram in
the prompt or output (Saxena 2023; transformers' prompt lookup decoding): free, and strong on
extraction, editing and tool-call arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from ..proposal import EMPTY, DraftRequest, Proposal
from ..schedule import AdaptiveSchedule, FixedSchedule, Schedule
from .base import (
    AdaptiveFields,
    Drafter,
    DrafterBlock,
    DrafterKind,
    admissible,
    lookup_continuation,
)

if TYPE_CHECKING:
    from ..parts import DraftingParts

__all__ = ["KIND", "NgramFields", "PromptLookupConfig", "PromptLookupDrafter"]


class NgramFields(DrafterBlock):
    """The n-grams a lookup matches (prompt lookup's drafts, a draft model's guesses)."""

    min_ngram: int = Field(default=1, ge=1, le=16)
    """Shortest n-gram to match."""
    max_ngram: int = Field(default=3, ge=1, le=16)
    """Longest n-gram to match (tried first)."""

    @model_validator(mode="after")
    def _ordered(self) -> NgramFields:
        if self.min_ngram > self.max_ngram:
            msg = f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})"
            raise ValueError(msg)
        return self


class PromptLookupConfig(AdaptiveFields, NgramFields):
    """``drafter: {kind: prompt_lookup, ...}``."""

    kind: Literal["prompt_lookup"] = "prompt_lookup"


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

    def propose(self, ask: DraftRequest) -> Proposal:
        if ask.k <= 0:
            return EMPTY
        follow = lookup_continuation(ask.context, ask.k, self.min_ngram, self.max_ngram)
        if not follow:
            return EMPTY
        found = admissible(follow, ask.constraint)
        return Proposal(found.tokens, masks=found.masks, source="history")


def build_prompt_lookup(
    config: PromptLookupConfig, parts: DraftingParts
) -> tuple[Drafter | None, Schedule]:
    """The registry's builder: lookup drafts are free, so an adaptive schedule prices only
    the verification (``parts.costs(None)``)."""
    drafter = PromptLookupDrafter(max_ngram=config.max_ngram, min_ngram=config.min_ngram)
    k = config.num_speculative_tokens
    if not config.adaptive:
        return drafter, FixedSchedule(k)
    return drafter, AdaptiveSchedule(max_k=k, costs=parts.costs(None))


KIND = DrafterKind(PromptLookupConfig, build_prompt_lookup)
