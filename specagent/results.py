"""What a call returns: ``GenerationResult``, ``StreamChunk``, ``SpecStats`` and ``Usage``.

``SpecStats`` names follow vLLM's spec-decode metrics so dashboards read the same.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["GenerationResult", "Logprob", "SpecStats", "StreamChunk", "Usage"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Logprob:
    """One output token's log-probability under the target (``GenerationResult.logprobs``)
    and, for an emitted token, the most likely tokens at its position with theirs (``top``,
    most likely first)."""

    token_id: int
    text: str
    """The token alone, decoded (a piece of a character decodes to U+FFFD)."""
    logprob: float
    top: tuple[Logprob, ...] = ()
    raw: bytes | None = None
    """The token's own bytes (a piece of a character: its bytes alone, which joined with its
    neighbours' spell the character); None where the tokenizer does not say (an added or
    special token), and then ``text``'s UTF-8 stands for them."""

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's entry of ``choices[].logprobs.content``."""
        return {**self._entry(), "top_logprobs": [t._entry() for t in self.top]}

    def _entry(self) -> dict[str, Any]:
        raw = self.raw if self.raw is not None else self.text.encode()
        return {"token": self.text, "logprob": self.logprob, "bytes": list(raw)}


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0
    """Of ``input_tokens``, those whose KV the call took from the prefix cache (an earlier turn
    of the conversation, a shared system prompt) instead of computing it."""
    accepted_prediction_tokens: int = 0
    """Output tokens drafted from the call's prediction and accepted (OpenAI's name)."""
    rejected_prediction_tokens: int = 0
    """The prediction's tokens that did not make it into the output: its length less the
    accepted ones (as OpenAI counts them: they cost verification work, not output)."""

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class SpecStats:
    """How speculation went for one call."""

    policy: str
    mode: Literal["lossless", "relaxed"]
    drafter: str
    """A drafter of ``decoding.registry.DRAFTERS``: ``draft_model``, ``prompt_lookup``,
    ``early_exit``, ``suffix``, ``auto`` or ``none``."""
    num_drafts: int
    """Verification steps that checked at least one draft token."""
    num_draft_tokens: int
    """Draft tokens proposed."""
    num_accepted_tokens: int
    """Draft tokens accepted."""
    acceptance_rate: float
    """``num_accepted_tokens / num_draft_tokens`` (0 when nothing was drafted)."""
    mean_acceptance_length: float
    """Tokens emitted per target forward (1.0 is plain decoding)."""
    accepted_per_position: list[int]
    """How often the i-th draft token of a step was accepted."""
    ttft_s: float
    """Time from the call to its first token, queueing included."""
    latency_s: float
    tokens_per_s: float
    """Output tokens per second of the whole call."""
    divergence: float | None = None
    """Relaxed calls: mean TV distance from the target's distribution per emitted token."""
    fell_back_to_lossless: bool = False
    """Relaxed calls: the divergence budget was exceeded and the rest ran losslessly."""
    num_forced_tokens: int = 0
    """Tokens a grammar forced (tool-call braces, keys, names), verified with the drafts at no
    drafting cost; not counted in ``num_draft_tokens``."""
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    """Accepted tokens by where they came from: ``model`` (draft model or early exit),
    ``history`` (text already written: this call's or earlier calls'), ``grammar``."""
    num_tree_steps: int = 0
    """Verification steps that checked a token tree (the draft model's draft and a history
    continuation beside it, in one forward); their drafts' tokens all count as drafted."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    stats: SpecStats
    seed: int
    """The seed the call drew from: pass it again to reproduce the tokens."""
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    trace_id: str | None = None
    """The call's OpenTelemetry trace (32 hex digits; None where no tracer records): what
    its audit row names, to join the trace."""
    logprobs: list[Logprob] | None = field(default=None, repr=False)
    """Each of ``token_ids``' log-probability under the target, where the call asked for
    them (``logprobs=``; None otherwise): read from the verification that accepted the token,
    before temperature, top-k and top-p, over what a grammar allows there. For a lossless
    policy these are the target's own; for a relaxed one, the target's at the positions the
    relaxed rule accepted (a token it accepted can be one the target finds unlikely)."""


@dataclass(frozen=True)
class StreamChunk:
    """A piece of a streamed call. The last chunk has ``finish_reason`` and ``result`` set."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    result: GenerationResult | None = None
    logprobs: list[Logprob] | None = None
    """``token_ids``' log-probabilities, where the call asked for them."""
