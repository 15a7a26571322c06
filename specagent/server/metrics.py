"""``GET /metrics``: the runtime's OpenTelemetry instruments as Prometheus text.

One ``MeterProvider`` with a Prometheus reader, given to the runtime; its own registry, so two
servers in one process (tests, side-by-side runs) never mix their numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["prometheus_metrics"]


def prometheus_metrics() -> tuple[Any, Callable[[], bytes]]:
    """A meter provider for the runtime and the function that renders its metrics."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    try:
        reader = PrometheusMetricReader(registry=registry)
    except TypeError:  # older exporters register with prometheus_client's global registry
        from prometheus_client import REGISTRY as registry

        reader = PrometheusMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    return provider, lambda: generate_latest(registry)
