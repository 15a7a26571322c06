"""Tracing specagent calls with OpenTelemetry: to the console, or to an OTLP collector.

specagent only uses the OpenTelemetry API; the application installs the SDK and exporters, as
here. Each call becomes a span ``chat {model}`` nested under the current span, with the GenAI
attributes and specagent's acceptance statistics; metrics carry policy and mode.

    python examples/tracing.py                      # spans and metrics printed to the console
    python examples/tracing.py --otlp http://localhost:4318

For --otlp, start Jaeger locally first (its UI is then at http://localhost:16686):

    docker run --rm -p 16686:16686 -p 4318:4318 jaegertracing/all-in-one:latest
"""

from __future__ import annotations

import argparse

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from specagent import SpecRuntime, shipped_policies


def configure(otlp: str | None) -> None:
    resource = Resource.create({"service.name": "support-bot"})
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter(endpoint=f"{otlp}/v1/traces")
        metric_exporter = OTLPMetricExporter(endpoint=f"{otlp}/v1/metrics")
    else:
        span_exporter, metric_exporter = ConsoleSpanExporter(), ConsoleMetricExporter()
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=5000)
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "transformers", "llama.cpp"],
        help="what runs the forwards (auto: llama.cpp for a GGUF model on a CPU)",
    )
    parser.add_argument(
        "--otlp", default=None, help="OTLP/HTTP endpoint, e.g. http://localhost:4318"
    )
    args = parser.parse_args()
    configure(args.otlp)

    runtime = SpecRuntime.from_pretrained(
        args.target, policies=shipped_policies(), engine=args.engine
    )
    tracer = trace.get_tracer("support-bot")
    with tracer.start_as_current_span("handle ticket"):  # specagent's spans nest under this one
        runtime.generate_sync("Where is my parcel?", policy="customer-reply", max_new_tokens=32)
        runtime.generate_sync(
            "Summarise: parcel delayed, new date Thursday.",
            tags=["summary", "internal"],
            max_new_tokens=32,
        )
    runtime.close()
    trace.get_tracer_provider().shutdown()  # type: ignore[attr-defined]
    metrics.get_meter_provider().shutdown()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
