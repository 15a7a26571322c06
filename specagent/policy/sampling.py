"""The sampling fields, declared once: their bounds here, their defaults in ``SamplingConfig``
(a policy's ``sampling`` block). The HTTP server's request fields and ``ChatSpecAgent``'s use
the same annotated types (``tests/policy/test_sampling_schema.py`` holds them equal), so a
value one front door accepts is one every other accepts and the sampler reads."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..decoding.stopping import check_stops

__all__ = [
    "MAX_TOP_LOGPROBS",
    "MaxNewTokens",
    "SamplingConfig",
    "Seed",
    "Temperature",
    "TopK",
    "TopLogprobs",
    "TopP",
]

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
"""0 is greedy; at most 2, as OpenAI's API bounds it."""
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
"""Keep the smallest set of tokens whose mass reaches it; 1 keeps all."""
TopK = Annotated[int, Field(ge=0)]
"""Keep only the k most likely tokens; 0 keeps all."""
MaxNewTokens = Annotated[int, Field(ge=1, le=1_000_000)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
MAX_TOP_LOGPROBS = 20
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
"""How many most likely alternatives each emitted token's log-probability comes with (0: the
token's own only); at most 20, as OpenAI's API bounds it. Not a sampling default: a call asks
for log-probabilities or not."""


class SamplingConfig(BaseModel):
    """Sampling defaults of the policy; a call may override them (never the mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    max_new_tokens: MaxNewTokens = 256
    stop: tuple[str, ...] = ()
    """Stop strings; generation ends before them and they are not emitted (at most
    ``MAX_STOPS``, each of at most ``MAX_STOP_CHARS`` characters)."""
    seed: Seed | None = None
    """Default seed; None draws a fresh one per call."""

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stops: tuple[str, ...]) -> tuple[str, ...]:
        if stops:
            check_stops(stops)
        return stops
