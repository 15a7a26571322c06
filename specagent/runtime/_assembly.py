"""Caller side of a call: its decode events turned into text chunks and the final result
(stop strings cut, incomplete characters held back, ``SpecStats`` from the counters)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..decoding.loop import DecodeCounters, DecodeEvent
from ..decoding.sampling import TokenLogprob
from ..decoding.stopping import IncrementalText, StopStrings
from ..results import GenerationResult, Logprob, SpecStats, StreamChunk, Usage
from ._admission import CallPlan

__all__ = ["CallAssembler"]


def prediction_usage(prediction: Sequence[int], counters: DecodeCounters) -> dict[str, int]:
    """A prediction's tokens accepted into the output and the rest of it (OpenAI's counts)."""
    if not prediction:
        return {}
    accepted = counters.accepted_by_source.get("prediction", 0)
    return {
        "accepted_prediction_tokens": accepted,
        "rejected_prediction_tokens": max(len(prediction) - accepted, 0),
    }


class CallAssembler:
    """Turns a call's decode events into text chunks and the final result (caller side)."""

    def __init__(
        self,
        plan: CallPlan,
        started: float,
        decode_text: Callable[[Sequence[int]], str],
        streaming: bool = True,
        token_bytes: Callable[[int], bytes | None] = lambda token: None,
    ) -> None:
        self.plan = plan
        self.started = started
        self.decode_text = decode_text
        self.token_bytes = token_bytes
        """A token's own bytes (``specagent.token_bytes``), for its log-probability's."""
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] | None = [] if plan.logprobs is not None else None
        """Every output token's, where the call asked for them (else None)."""
        self.step_logprobs: list[Logprob] | None = None
        """The last event's tokens' (for its chunk)."""
        self.token_texts: dict[int, tuple[str, bytes | None]] = {}
        """Each token's text and bytes, decoded once per call: alternatives repeat from step to
        step, and a call with 20 of them per token would otherwise decode 21 strings per token
        on the caller's event loop."""
        self.emitted = 0
        self.stops = StopStrings(plan.stop, decode_text) if plan.stop else None
        self.text = self.stops.text if self.stops else IncrementalText(decode_text)
        """The call's text so far, decoded a step at a time (never the whole output again)."""
        self.streaming = streaming
        """Whether the caller takes chunks as they come; otherwise only the result, and the
        events, all read at the end (``AsyncSink``), are not decoded one by one (a long
        output would hold the caller's loop, and every other stream on it, meanwhile)."""

    def chunk(self, event: DecodeEvent) -> StreamChunk | None:
        self.token_ids.extend(event.token_ids)
        logprobs = self.step_logprobs = self._readable(event.logprobs)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(logprobs)
        if self.stops is not None:
            self.stops.feed(event.token_ids)  # where the result's text is cut
        elif self.streaming:
            self.text.extend(event.token_ids)
        if event.finish_reason is not None or not self.streaming:
            return None
        text = self.text.text
        safe = self.stops.safe_length() if self.stops is not None else len(text)
        if safe <= self.emitted:
            if not event.token_ids:
                return None
            return StreamChunk(text="", token_ids=list(event.token_ids), logprobs=logprobs)
        delta, self.emitted = text[self.emitted : safe], safe
        return StreamChunk(text=delta, token_ids=list(event.token_ids), logprobs=logprobs)

    def finish(
        self, event: DecodeEvent, first_token_at: float | None
    ) -> tuple[StreamChunk, GenerationResult]:
        """The last chunk and the result; ``first_token_at``: when the worker emitted the
        first token (``perf_counter``), for the time to first token."""
        self.chunk(event)
        now = time.perf_counter()
        output_ids = event.output_ids if event.output_ids is not None else self.token_ids
        cut = self.stops.cut if self.stops else None
        # One whole decode per call, at its end: the result's text is exactly the tokenizer's.
        text = self.text.text[:cut] if cut is not None else self.decode_text(output_ids)
        result = GenerationResult(
            text=text,
            token_ids=list(output_ids),
            finish_reason=event.finish_reason,  # type: ignore[arg-type]
            usage=Usage(
                input_tokens=len(self.plan.prompt_ids),
                output_tokens=len(output_ids),
                cached_input_tokens=event.counters.cached_prompt_tokens,
                **prediction_usage(self.plan.prediction_ids, event.counters),
            ),
            stats=self._stats(event.counters, now, len(output_ids), first_token_at),
            seed=self.plan.seed,
            prompt_token_ids=self.plan.prompt_ids,
            logprobs=self.logprobs[: len(output_ids)] if self.logprobs is not None else None,
        )
        last = StreamChunk(
            text=text[self.emitted :] if len(text) > self.emitted else "",
            token_ids=list(event.token_ids),
            finish_reason=result.finish_reason,
            result=result,
            logprobs=self.step_logprobs,
        )
        return last, result

    def _readable(self, logprobs: list[TokenLogprob] | None) -> list[Logprob] | None:
        """The decoding core's log-probabilities with each token's text."""
        if logprobs is None:
            return None

        def entry(token: int, logprob: float, top: tuple[Logprob, ...] = ()) -> Logprob:
            text, raw = self._token_text(token)
            return Logprob(token, text, logprob, top, raw=raw)

        return [
            entry(each.token, each.logprob, tuple(entry(t, v) for t, v in each.top))
            for each in logprobs
        ]

    def _token_text(self, token: int) -> tuple[str, bytes | None]:
        known = self.token_texts.get(token)
        if known is None:
            known = self.token_texts[token] = (self.decode_text([token]), self.token_bytes(token))
        return known

    def _stats(
        self, counters: DecodeCounters, now: float, output_tokens: int, first: float | None
    ) -> SpecStats:
        policy = self.plan.policy
        latency = now - self.started
        ttft = (first or now) - self.started
        relaxed = policy.mode == "relaxed"
        return SpecStats(
            policy=policy.name,
            mode=policy.mode,
            drafter=self.plan.drafter.kind,
            num_drafts=counters.num_drafts,
            num_draft_tokens=counters.num_draft_tokens,
            num_accepted_tokens=counters.num_accepted_tokens,
            acceptance_rate=counters.acceptance_rate,
            mean_acceptance_length=counters.mean_acceptance_length,
            accepted_per_position=list(counters.accepted_per_position),
            ttft_s=ttft,
            latency_s=latency,
            tokens_per_s=output_tokens / latency if latency > 0 else 0.0,
            divergence=counters.divergence if relaxed else None,
            fell_back_to_lossless=counters.fell_back_to_lossless,
            num_forced_tokens=counters.num_forced_tokens,
            accepted_by_source=dict(counters.accepted_by_source),
            num_tree_steps=counters.tree_steps,
        )
