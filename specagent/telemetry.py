"""OpenTelemetry: one span per call and GenAI metrics, with speculation's acceptance.

Follows the OpenTelemetry GenAI semantic conventions (span ``chat {model}``, ``gen_ai.*``
attributes, the client/server metrics with their bucket advice) and adds ``specagent.*``
attributes for what speculative decoding did.

The library only uses the OpenTelemetry *API*: it installs no provider. With no SDK configured
the tracer and meter are no-ops and this module skips building attributes (``is_recording``).
Spans are started in the caller's task, so they nest under the caller's current span (an agent's
or a LangChain run's); the sync front door passes the caller's context along explicitly.
Prompt and output text are recorded only when the call's policy says ``record_content: true``.

The GenAI conventions are still in development and renamed their inference signals
(``gen_ai.client.inference.*`` metrics, time to first chunk). As the conventions prescribe for
instrumentations that already emit an older version, the older names stay the default, and
``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`` adds the latest ones alongside them
(``Telemetry(latest_conventions=...)`` overrides the variable).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from ._version import __version__
from .results import GenerationResult

__all__ = ["CallSpan", "Telemetry", "latest_conventions_opted_in"]

PROVIDER = "specagent"
OPT_IN_VARIABLE = "OTEL_SEMCONV_STABILITY_OPT_IN"
LATEST_GEN_AI = "gen_ai_latest_experimental"


def latest_conventions_opted_in() -> bool:
    """Whether ``OTEL_SEMCONV_STABILITY_OPT_IN`` (a comma-separated list) asks for the latest
    experimental GenAI conventions."""
    values = os.environ.get(OPT_IN_VARIABLE, "")
    return LATEST_GEN_AI in {value.strip() for value in values.split(",")}


# Bucket advice from the GenAI metrics conventions.
_DURATION_BUCKETS = [
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
]
_TOKEN_BUCKETS = [
    1,
    4,
    16,
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1048576,
    4194304,
    16777216,
    67108864,
]
_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_RATE_BUCKETS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
_LENGTH_BUCKETS = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]
_DIVERGENCE_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]


@dataclass
class CallSpan:
    """A call in flight: its span, the context to restore, and what the metrics need."""

    span: trace.Span
    started: float
    attributes: dict[str, Any]
    record_content: bool
    streaming: bool = False
    first_chunk_s: float | None = None
    """Seconds from the call's start to its first text chunk (streaming calls)."""
    last_chunk: float | None = None
    ended: bool = field(default=False)

    @property
    def trace_id(self) -> str | None:
        """The call's trace id in hex (None where no tracer records)."""
        context = self.span.get_span_context()
        return format(context.trace_id, "032x") if context.is_valid else None


class Telemetry:
    """Spans and metrics for a runtime. ``tracer_provider`` / ``meter_provider`` default to the
    global ones (set by the application, never by specagent)."""

    def __init__(
        self,
        model_name: str,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        latest_conventions: bool | None = None,
    ) -> None:
        self.model_name = model_name
        self.latest = (
            latest_conventions_opted_in() if latest_conventions is None else latest_conventions
        )
        self.tracer_provider, self.meter_provider = tracer_provider, meter_provider
        self.tracer = trace.get_tracer("specagent", __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter("specagent", __version__, meter_provider=meter_provider)
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="GenAI operation duration",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate the first token",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token after the first",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS,
        )
        self.acceptance = meter.create_histogram(
            "specagent.spec_decode.acceptance_rate",
            unit="1",
            description="Accepted / proposed draft tokens per call",
            explicit_bucket_boundaries_advisory=_RATE_BUCKETS,
        )
        self.acceptance_length = meter.create_histogram(
            "specagent.spec_decode.mean_acceptance_length",
            unit="{token}",
            description="Tokens emitted per target forward, per call",
            explicit_bucket_boundaries_advisory=_LENGTH_BUCKETS,
        )
        self.divergence = meter.create_histogram(
            "specagent.divergence",
            unit="1",
            description="Mean TV distance from the target distribution per token (relaxed calls)",
            explicit_bucket_boundaries_advisory=_DIVERGENCE_BUCKETS,
        )
        self.accepted_tokens = meter.create_counter(
            "specagent.spec_decode.accepted_tokens",
            unit="{token}",
            description="Accepted draft tokens, by where the draft came from",
        )
        self.fallbacks = meter.create_counter(
            "specagent.fallbacks",
            unit="{call}",
            description="Relaxed calls whose divergence budget made them finish losslessly",
        )
        if self.latest:
            self._latest_instruments(meter)

    def _latest_instruments(self, meter: metrics.Meter) -> None:
        """The client inference metrics of the current GenAI conventions."""
        self.inference_duration = meter.create_histogram(
            "gen_ai.client.inference.duration",
            unit="s",
            description="GenAI inference operation duration",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self.time_to_first_chunk = meter.create_histogram(
            "gen_ai.client.inference.time_to_first_chunk",
            unit="s",
            description="Time from the request to the first chunk of a streaming response",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self.time_per_output_chunk = meter.create_histogram(
            "gen_ai.client.inference.time_per_output_chunk",
            unit="s",
            description="Time between consecutive chunks of a streaming response",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS,
        )
        self.usage_input = meter.create_counter(
            "gen_ai.client.inference.usage.input_tokens",
            unit="{token}",
            description="Input tokens used",
        )
        self.usage_output = meter.create_counter(
            "gen_ai.client.inference.usage.output_tokens",
            unit="{token}",
            description="Output tokens used",
        )
        self.operation_input = meter.create_histogram(
            "gen_ai.client.inference.operation.input_tokens",
            unit="{token}",
            description="Input tokens per inference operation",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )
        self.operation_output = meter.create_histogram(
            "gen_ai.client.inference.operation.output_tokens",
            unit="{token}",
            description="Output tokens per inference operation",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )

    def start_call(
        self,
        *,
        policy: str,
        mode: str,
        drafter: str,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int,
        record_content: bool,
        prompt: Any = None,
        parent: otel_context.Context | None = None,
        streaming: bool = False,
    ) -> CallSpan:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": self.model_name,
            "specagent.policy": policy,
            "specagent.mode": mode,
        }
        span = self.tracer.start_span(
            f"chat {self.model_name}",
            kind=SpanKind.INTERNAL,
            context=parent,
            attributes=attributes,
        )
        if span.is_recording():
            span.set_attributes(
                {
                    "gen_ai.request.temperature": temperature,
                    "gen_ai.request.top_p": top_p,
                    "gen_ai.request.max_tokens": max_tokens,
                    "gen_ai.request.seed": seed,
                    "specagent.drafter": drafter,
                }
            )
            if self.latest:
                span.set_attribute("gen_ai.request.stream", streaming)
            if record_content and prompt is not None:
                span.set_attribute("gen_ai.input.messages", _input_messages(prompt))
        return CallSpan(span, time.perf_counter(), attributes, record_content, streaming)

    def chunk(self, call: CallSpan) -> None:
        """A text chunk reached the caller: the latest conventions' chunk timings."""
        if not (self.latest and call.streaming) or call.ended:
            return
        now = time.perf_counter()
        if call.last_chunk is None:
            call.first_chunk_s = now - call.started
            self.time_to_first_chunk.record(call.first_chunk_s, call.attributes)
        else:
            self.time_per_output_chunk.record(now - call.last_chunk, call.attributes)
        call.last_chunk = now

    def end_call(self, call: CallSpan, result: GenerationResult) -> None:
        if call.ended:
            return
        call.ended = True
        stats, usage = result.stats, result.usage
        span = call.span
        if span.is_recording():
            attrs: dict[str, Any] = {
                "gen_ai.response.model": self.model_name,
                "gen_ai.response.finish_reasons": [result.finish_reason],
                "gen_ai.usage.input_tokens": usage.input_tokens,
                "gen_ai.usage.output_tokens": usage.output_tokens,
                "gen_ai.usage.cache_read.input_tokens": usage.cached_input_tokens,
                "specagent.spec_decode.num_drafts": stats.num_drafts,
                "specagent.spec_decode.num_draft_tokens": stats.num_draft_tokens,
                "specagent.spec_decode.num_accepted_tokens": stats.num_accepted_tokens,
                "specagent.spec_decode.num_forced_tokens": stats.num_forced_tokens,
                "specagent.spec_decode.num_tree_steps": stats.num_tree_steps,
                "specagent.spec_decode.acceptance_rate": stats.acceptance_rate,
                "specagent.spec_decode.mean_acceptance_length": stats.mean_acceptance_length,
                "specagent.spec_decode.accepted_per_position": list(stats.accepted_per_position),
                "specagent.spec_decode.acceptance_rate_per_position": _per_position_rates(
                    stats.accepted_per_position, stats.num_drafts
                ),
                "specagent.ttft_s": stats.ttft_s,
                "specagent.tokens_per_s": stats.tokens_per_s,
            }
            for source, accepted in sorted(stats.accepted_by_source.items()):
                attrs[f"specagent.spec_decode.accepted_tokens.{source}"] = accepted
            if usage.accepted_prediction_tokens or usage.rejected_prediction_tokens:
                attrs["specagent.prediction.accepted_tokens"] = usage.accepted_prediction_tokens
                attrs["specagent.prediction.rejected_tokens"] = usage.rejected_prediction_tokens
            if stats.divergence is not None:
                attrs["specagent.divergence"] = stats.divergence
                attrs["specagent.fell_back_to_lossless"] = stats.fell_back_to_lossless
            if self.latest and call.first_chunk_s is not None:
                attrs["gen_ai.response.time_to_first_chunk"] = call.first_chunk_s
            if call.record_content:
                attrs["gen_ai.output.messages"] = json.dumps(
                    [
                        {
                            "role": "assistant",
                            "parts": [{"type": "text", "content": result.text}],
                            "finish_reason": result.finish_reason,
                        }
                    ]
                )
            span.set_attributes(attrs)
        span.end()
        self._record_metrics(call, result)

    def fail_call(self, call: CallSpan, exc: BaseException) -> None:
        if call.ended:
            return
        call.ended = True
        error_type = type(exc).__qualname__
        if call.span.is_recording():
            call.span.set_attribute("error.type", error_type)
            call.span.set_status(Status(StatusCode.ERROR, str(exc) or error_type))
        call.span.end()
        attributes = {**call.attributes, "error.type": error_type}
        elapsed = time.perf_counter() - call.started
        self.duration.record(elapsed, attributes)
        if self.latest:
            self.inference_duration.record(elapsed, attributes)

    def _record_metrics(self, call: CallSpan, result: GenerationResult) -> None:
        stats, usage, attrs = result.stats, result.usage, call.attributes
        self.duration.record(stats.latency_s, attrs)
        self.token_usage.record(usage.input_tokens, {**attrs, "gen_ai.token.type": "input"})
        self.token_usage.record(usage.output_tokens, {**attrs, "gen_ai.token.type": "output"})
        self.ttft.record(stats.ttft_s, attrs)
        if usage.output_tokens > 1:
            self.tpot.record((stats.latency_s - stats.ttft_s) / (usage.output_tokens - 1), attrs)
        if stats.num_draft_tokens:
            self.acceptance.record(stats.acceptance_rate, attrs)
        if stats.mean_acceptance_length:
            self.acceptance_length.record(stats.mean_acceptance_length, attrs)
        for source, accepted in sorted(stats.accepted_by_source.items()):
            if accepted:
                self.accepted_tokens.add(accepted, {**attrs, "specagent.draft.source": source})
        if stats.divergence is not None:
            self.divergence.record(stats.divergence, attrs)
            self.fallbacks.add(int(bool(stats.fell_back_to_lossless)), attrs)
        if self.latest:
            response = {**attrs, "gen_ai.response.model": self.model_name}
            tokens = {**response, "gen_ai.token.modality": "text"}
            self.inference_duration.record(stats.latency_s, response)
            self.usage_input.add(usage.input_tokens, tokens)
            self.usage_output.add(usage.output_tokens, tokens)
            self.operation_input.record(usage.input_tokens, response)
            self.operation_output.record(usage.output_tokens, response)


def _per_position_rates(accepted: Sequence[int], num_drafts: int) -> list[float]:
    return [n / num_drafts for n in accepted] if num_drafts else []


def _input_messages(prompt: Any) -> str:
    """The prompt as the conventions' ``gen_ai.input.messages`` JSON: one message per chat
    message, its text as ``text`` parts, an assistant's tool calls as ``tool_call`` parts, a
    tool message as a ``tool_call_response`` part; a raw string prompt is one user message, a
    token-id prompt one user message with a ``token_ids`` part (a custom part type)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "parts": [_text_part(prompt)]}]
    elif prompt and isinstance(prompt[0], Mapping):
        messages = [_chat_message(m) for m in prompt]
    else:
        messages = [{"role": "user", "parts": [{"type": "token_ids", "content": list(prompt)}]}]
    return json.dumps(messages, default=str)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "content": text}


def _chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    role = str(message.get("role") or "user")
    content = message.get("content")
    texts: list[str] = []
    if isinstance(content, str):
        texts = [content] if content else []
    elif isinstance(content, Sequence):  # OpenAI content blocks
        texts = [str(b.get("text", "")) for b in content if isinstance(b, Mapping)]
    if role == "tool":
        response = "".join(texts)
        part = {"type": "tool_call_response", "id": message.get("tool_call_id")}
        return {"role": role, "parts": [{**part, "response": response}]}
    parts: list[dict[str, Any]] = [_text_part(t) for t in texts]
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # else recorded as the model wrote it
                arguments = json.loads(arguments)
        part = {"type": "tool_call", "id": call.get("id"), "name": function.get("name")}
        parts.append({**part, "arguments": arguments})
    result: dict[str, Any] = {"role": role, "parts": parts}
    if message.get("name"):
        result["name"] = str(message["name"])
    return result
