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

from specagent import InvalidRequestError, Policy, SpecRuntime

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


@pytest.fixture
def runtime(otel, target, draft, tokenizer):
    _, tracer_provider, _, meter_provider = otel
    rt = SpecRuntime(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        policies=POLICIES,
        device="cpu",
        model_name="tiny-llama",
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
    )
    yield rt
    rt.close()


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
    assert span.attributes["error.type"] == "TimeoutError"
    durations = metrics_by_name(reader)["gen_ai.client.operation.duration"]
    assert durations[0].attributes["error.type"] == "TimeoutError"


def test_bad_input_fails_before_any_span(runtime, otel) -> None:
    with pytest.raises(InvalidRequestError):
        runtime.generate_sync("", policy="exact")
    assert otel[0].get_finished_spans() == ()


def test_no_provider_means_no_op(target, draft, tokenizer) -> None:
    rt = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=POLICIES, device="cpu"
    )
    assert not rt._telemetry.tracer.start_span("probe").is_recording()
    assert rt.generate_sync("x", policy="exact", max_new_tokens=3).usage.output_tokens > 0
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    rt.close()
