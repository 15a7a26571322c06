"""Spans and metrics, read back with the SDK's in-memory exporter and metric reader."""

from __future__ import annotations

import json
import threading

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from specagent import InvalidRequestError, Policy, RuntimeOptions, SpecRuntime

POLICIES = [
    Policy(
        name="exact",
        description="d",
        mode="lossless",
        drafter={"kind": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
    ),
    Policy(
        name="notes",
        description="d",
        mode="relaxed",
        drafter={"kind": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
        acceptance={"rule": "typical"},
        telemetry={"record_content": True},
    ),
]


@pytest.fixture
def otel():
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    return exporter, tracer_provider, reader, meter_provider


def traced_runtime(otel, target, draft, tokenizer):
    """A runtime reporting to the test's providers; closed when the fixture ends."""
    _, tracer_provider, _, meter_provider = otel
    rt = SpecRuntime(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        policies=POLICIES,
        device="cpu",
        model_name="tiny-llama",
        options=RuntimeOptions(tracer_provider=tracer_provider, meter_provider=meter_provider),
    )
    yield rt
    rt.close()


@pytest.fixture
def runtime(otel, target, draft, tokenizer):
    yield from traced_runtime(otel, target, draft, tokenizer)


def metrics_by_name(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    found: dict[str, list] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def test_lossless_call_span_attributes(runtime, otel) -> None:
    exporter = otel[0]
    result = runtime.generate_sync(
        "Hello", policy="exact", max_new_tokens=12, seed=1, temperature=0.5
    )
    (span,) = exporter.get_finished_spans()
    attrs = span.attributes
    assert span.name == "chat tiny-llama"
    assert span.kind == SpanKind.INTERNAL
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "specagent"
    assert attrs["gen_ai.request.model"] == "tiny-llama"
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.max_tokens"] == 12
    assert attrs["gen_ai.request.seed"] == 1
    assert attrs["gen_ai.usage.input_tokens"] == result.usage.input_tokens
    assert attrs["gen_ai.usage.output_tokens"] == result.usage.output_tokens
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == result.usage.cached_input_tokens
    assert attrs["gen_ai.response.finish_reasons"] == (result.finish_reason,)
    assert attrs["specagent.policy"] == "exact"
    assert attrs["specagent.mode"] == "lossless"
    assert attrs["specagent.drafter"] == "draft_model"
    stats = result.stats
    assert attrs["specagent.spec_decode.num_drafts"] == stats.num_drafts
    assert attrs["specagent.spec_decode.num_draft_tokens"] == stats.num_draft_tokens
    assert attrs["specagent.spec_decode.num_accepted_tokens"] == stats.num_accepted_tokens
    assert attrs["specagent.spec_decode.acceptance_rate"] == stats.acceptance_rate
    assert attrs["specagent.spec_decode.mean_acceptance_length"] == stats.mean_acceptance_length
    assert list(attrs["specagent.spec_decode.accepted_per_position"]) == stats.accepted_per_position
    assert attrs["specagent.ttft_s"] == stats.ttft_s
    assert "specagent.divergence" not in attrs
    assert "gen_ai.input.messages" not in attrs  # content is off by default
    assert "gen_ai.output.messages" not in attrs
    assert span.status.status_code == StatusCode.UNSET


def test_a_prediction_is_counted_on_the_span_never_recorded(runtime, otel) -> None:
    """A call's prediction is counted (accepted and rejected tokens), never written out: it
    is content, and a span records content only where the policy says so (and then only the
    messages and the answer)."""
    exporter = otel[0]
    alone = runtime.generate_sync("Hello", policy="exact", max_new_tokens=12, temperature=0.0)
    secret = "VAULT-7731 " + alone.text
    result = runtime.generate_sync(
        "Hello", policy="exact", max_new_tokens=12, temperature=0.0, prediction=secret
    )
    span = exporter.get_finished_spans()[-1]
    attrs = span.attributes
    assert attrs["specagent.prediction.accepted_tokens"] == result.usage.accepted_prediction_tokens
    assert attrs["specagent.prediction.rejected_tokens"] == result.usage.rejected_prediction_tokens
    assert not any("VAULT" in str(value) for value in attrs.values())
    assert "specagent.prediction.accepted_tokens" not in exporter.get_finished_spans()[0].attributes


def test_relaxed_call_records_divergence_and_allowed_content(runtime, otel) -> None:
    exporter = otel[0]
    result = runtime.generate_sync(
        "Notes", policy="notes", max_new_tokens=10, seed=2, temperature=1.0
    )
    (span,) = exporter.get_finished_spans()
    attrs = span.attributes
    assert attrs["specagent.mode"] == "relaxed"
    assert attrs["specagent.divergence"] == result.stats.divergence
    assert json.loads(attrs["gen_ai.input.messages"])[0]["parts"][0]["content"] == "Notes"
    output = json.loads(attrs["gen_ai.output.messages"])
    assert output[0]["parts"][0]["content"] == result.text


def test_metrics_carry_policy_and_mode(runtime, otel) -> None:
    reader = otel[2]
    runtime.generate_sync("One", policy="exact", max_new_tokens=8, seed=1)
    runtime.generate_sync("Two", policy="notes", max_new_tokens=8, seed=1, temperature=1.0)
    found = metrics_by_name(reader)
    for name in (
        "gen_ai.client.operation.duration",
        "gen_ai.client.token.usage",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "specagent.spec_decode.acceptance_rate",
        "specagent.spec_decode.mean_acceptance_length",
    ):
        points = found[name]
        modes = {p.attributes["specagent.mode"] for p in points}
        assert modes == {"lossless", "relaxed"}, name
        assert {p.attributes["specagent.policy"] for p in points} == {"exact", "notes"}
    token_types = {p.attributes["gen_ai.token.type"] for p in found["gen_ai.client.token.usage"]}
    assert token_types == {"input", "output"}
    (divergence,) = found["specagent.divergence"]
    assert divergence.attributes["specagent.policy"] == "notes"
    duration = found["gen_ai.client.operation.duration"][0]
    assert list(duration.explicit_bounds)[:3] == [0.01, 0.02, 0.04]


def test_span_nests_under_the_callers_span_from_another_thread(runtime, otel) -> None:
    exporter, tracer_provider = otel[0], otel[1]
    tracer = tracer_provider.get_tracer("agent")

    def agent_step() -> None:
        with tracer.start_as_current_span("agent step"):
            runtime.generate_sync("Nested", policy="exact", max_new_tokens=5)

    thread = threading.Thread(target=agent_step)
    thread.start()
    thread.join()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    child, parent = spans["chat tiny-llama"], spans["agent step"]
    assert child.parent is not None
    assert child.parent.span_id == parent.context.span_id
    assert child.context.trace_id == parent.context.trace_id


def test_span_nests_under_the_callers_span_in_async_tasks(runtime, otel) -> None:
    exporter, tracer_provider = otel[0], otel[1]
    tracer = tracer_provider.get_tracer("agent")

    async def main() -> None:
        async def one(i: int) -> None:
            with tracer.start_as_current_span(f"task {i}"):
                await runtime.generate(f"Task {i}", policy="exact", max_new_tokens=5)

        async with runtime, anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)

    anyio.run(main)
    spans = exporter.get_finished_spans()
    parents = {s.context.span_id: s.name for s in spans if s.name.startswith("task")}
    chats = [s for s in spans if s.name.startswith("chat")]
    assert len(chats) == 3
    assert sorted(parents[s.parent.span_id] for s in chats) == ["task 0", "task 1", "task 2"]


def test_failed_call_span_has_error_type(runtime, otel) -> None:
    exporter, reader = otel[0], otel[2]
    with pytest.raises(TimeoutError):
        runtime.generate_sync("Slow", policy="exact", max_new_tokens=400, timeout=0.01)
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "CallTimeoutError"
    durations = metrics_by_name(reader)["gen_ai.client.operation.duration"]
    assert durations[0].attributes["error.type"] == "CallTimeoutError"


def test_bad_input_fails_before_any_span(runtime, otel) -> None:
    with pytest.raises(InvalidRequestError):
        runtime.generate_sync("", policy="exact")
    assert otel[0].get_finished_spans() == ()


def test_no_provider_means_no_op(target, draft, tokenizer) -> None:
    rt = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=POLICIES, device="cpu"
    )
    assert not rt._calls.telemetry.tracer.start_span("probe").is_recording()
    assert rt.generate_sync("x", policy="exact", max_new_tokens=3).usage.output_tokens > 0
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    rt.close()


# ---------------------------------------------------------------- the latest GenAI conventions

LATEST_METRICS = {
    "gen_ai.client.inference.duration",
    "gen_ai.client.inference.time_to_first_chunk",
    "gen_ai.client.inference.time_per_output_chunk",
    "gen_ai.client.inference.usage.input_tokens",
    "gen_ai.client.inference.usage.output_tokens",
    "gen_ai.client.inference.operation.input_tokens",
    "gen_ai.client.inference.operation.output_tokens",
}


@pytest.fixture
def latest_runtime(monkeypatch, otel, target, draft, tokenizer):
    """A runtime made with the conventions' opt-in variable set (it is read at construction)."""
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http, gen_ai_latest_experimental")
    yield from traced_runtime(otel, target, draft, tokenizer)


def test_latest_conventions_are_opt_in(runtime, otel) -> None:
    runtime.generate_sync("Hello", policy="exact", max_new_tokens=6, seed=1)
    found = metrics_by_name(otel[2])
    assert "gen_ai.client.operation.duration" in found
    assert not LATEST_METRICS & set(found)
    (span,) = otel[0].get_finished_spans()
    assert "gen_ai.request.stream" not in span.attributes


def test_latest_conventions_add_inference_metrics_and_chunk_timings(latest_runtime, otel) -> None:
    exporter, _, reader, _ = otel
    chunks = list(latest_runtime.stream_sync("Hello", policy="exact", max_new_tokens=12, seed=1))
    result = chunks[-1].result
    text_chunks = [c for c in chunks if c.result is None]
    assert result is not None
    assert len(text_chunks) >= 2
    found = metrics_by_name(reader)
    assert set(found) >= LATEST_METRICS
    assert "gen_ai.client.operation.duration" in found  # today's names stay alongside
    (first,) = found["gen_ai.client.inference.time_to_first_chunk"]
    assert first.count == 1
    (between,) = found["gen_ai.client.inference.time_per_output_chunk"]
    assert between.count == len(text_chunks) - 1
    (outputs,) = found["gen_ai.client.inference.usage.output_tokens"]
    assert outputs.value == result.usage.output_tokens
    assert outputs.attributes["gen_ai.token.modality"] == "text"
    assert outputs.attributes["gen_ai.response.model"] == "tiny-llama"
    (inputs,) = found["gen_ai.client.inference.usage.input_tokens"]
    assert inputs.value == result.usage.input_tokens
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.request.stream"] is True
    assert 0 < span.attributes["gen_ai.response.time_to_first_chunk"] <= result.stats.latency_s

    # A whole (non-streaming) call reports no chunk timings, as the conventions say.
    exporter.clear()
    latest_runtime.generate_sync("Hello", policy="exact", max_new_tokens=12, seed=1)
    found = metrics_by_name(reader)
    assert found["gen_ai.client.inference.time_to_first_chunk"][0].count == 1
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.request.stream"] is False
    assert "gen_ai.response.time_to_first_chunk" not in span.attributes
    assert sum(p.count for p in found["gen_ai.client.inference.duration"]) == 2


# The message JSON of the GenAI conventions (docs/gen-ai/gen-ai-input-messages.json and
# gen-ai-output-messages.json of open-telemetry/semantic-conventions-genai), restated as the
# JSON schema of what they require: messages with a role and parts; each part a known type
# with its required fields, or any other type (the conventions' GenericPart).
_PART = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string"}},
    "allOf": [
        {
            "if": {"properties": {"type": {"const": t}}},
            "then": {"required": required, "properties": properties},
        }
        for t, required, properties in [
            ("text", ["content"], {"content": {"type": "string"}}),
            ("reasoning", ["content"], {"content": {"type": "string"}}),
            (
                "tool_call",
                ["name"],
                {"name": {"type": "string"}, "id": {"type": ["string", "null"]}},
            ),
            ("tool_call_response", ["response"], {"id": {"type": ["string", "null"]}}),
        ]
    ],
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "parts"],
    "properties": {
        "role": {"type": "string"},
        "parts": {"type": "array", "items": _PART},
        "name": {"type": ["string", "null"]},
    },
}
INPUT_MESSAGES_SCHEMA = {"type": "array", "items": _MESSAGE}
OUTPUT_MESSAGES_SCHEMA = {
    "type": "array",
    "items": {
        **_MESSAGE,
        "required": ["role", "parts", "finish_reason"],
        "properties": {**_MESSAGE["properties"], "finish_reason": {"type": "string"}},
    },
}

AGENT_TURN = [
    {"role": "system", "content": "You track parcels."},
    {"role": "user", "content": "Where is order A-1?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "track", "arguments": '{"order": "A-1"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "In Oslo, arrives Thursday."},
    {"role": "user", "content": [{"type": "text", "text": "Tell me briefly."}]},
]


def test_recorded_messages_follow_the_conventions_json_schema(runtime, otel) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    result = runtime.generate_sync(
        AGENT_TURN, policy="notes", max_new_tokens=8, seed=3, temperature=1.0
    )
    (span,) = otel[0].get_finished_spans()
    inputs = json.loads(span.attributes["gen_ai.input.messages"])
    outputs = json.loads(span.attributes["gen_ai.output.messages"])
    jsonschema.validate(inputs, INPUT_MESSAGES_SCHEMA)
    jsonschema.validate(outputs, OUTPUT_MESSAGES_SCHEMA)
    assert [m["role"] for m in inputs] == ["system", "user", "assistant", "tool", "user"]
    assert inputs[2]["parts"] == [
        {"type": "tool_call", "id": "call_1", "name": "track", "arguments": {"order": "A-1"}}
    ]
    assert inputs[3]["parts"] == [
        {"type": "tool_call_response", "id": "call_1", "response": "In Oslo, arrives Thursday."}
    ]
    assert outputs[0]["parts"][0]["content"] == result.text

    # The schema is not vacuous: the shape recorded before (an assistant tool call as a text
    # part with no text) is refused.
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            [{"role": "assistant", "parts": [{"type": "text", "content": None}]}],
            INPUT_MESSAGES_SCHEMA,
        )
