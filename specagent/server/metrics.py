"""``GET /metrics``: the runtime's OpenTelemetry instruments as Prometheus text, and the
server's own HTTP metric.

One ``MeterProvider`` with a Prometheus reader, given to the runtime and to the server; its own
registry, so two servers in one process (tests, side-by-side runs) never mix their numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from .._version import __version__
from .requests import CALLER, Caller

__all__ = ["HttpMetrics", "observe_activity", "prometheus_metrics"]

ROUTES = (
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
    "/dashboard",
    "/dashboard/data",
)
"""The routes a request is counted under; anything else counts as ``other`` (a bounded label:
a scanner's paths must not grow the metric)."""
_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


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


METHODS = frozenset(
    {"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY", "TRACE"}
)
"""The HTTP methods recorded by name (``http.request.method``); any other is ``_OTHER``."""


class HttpMetrics:
    """``http.server.request.duration`` (OpenTelemetry's HTTP server metric) for every request:
    method, route, status code, and the chat call's policy where it was known, timed to the
    response's last byte (a stream's end). It counts what the runtime's instruments never see:
    the calls the server refuses (a bad key, a rate limit, a malformed or oversized body). A
    plain ASGI middleware, outermost, so streaming and disconnects pass through untouched."""

    def __init__(self, app: Any, meter_provider: Any) -> None:
        self.app = app
        meter = metrics.get_meter("specagent.server", __version__, meter_provider=meter_provider)
        self.duration = meter.create_histogram(
            "http.server.request.duration",
            unit="s",
            description="Duration of HTTP server requests",
            explicit_bucket_boundaries_advisory=_BUCKETS,
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500  # an exception before any response: a 500

        async def sending(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope.get("path", "")
            route = path if path in ROUTES else "other"
            if path.startswith("/dashboard/reports/"):
                route = "/dashboard/reports/{name}"
            elif path.startswith("/v1/responses/"):  # one series for every stored id
                listed = path.endswith("/input_items")
                route = "/v1/responses/{id}/input_items" if listed else "/v1/responses/{id}"
            method = scope.get("method", "")
            attributes: dict[str, Any] = {
                # OpenTelemetry's convention: a method outside the known set is "_OTHER", so
                # invented methods cannot make a series each.
                "http.request.method": method if method in METHODS else "_OTHER",
                "http.route": route,
                "http.response.status_code": status,
            }
            caller: Caller | None = scope.get(CALLER)
            if caller is not None and caller.policy is not None:
                attributes["specagent.policy"] = caller.policy
            self.duration.record(time.perf_counter() - start, attributes)


def observe_activity(meter_provider: Any, activity: Callable[[], Mapping[str, Any]]) -> None:
    """The gauge ``specagent.calls`` (``specagent.call.state``: ``running`` / ``queued``), read
    from ``activity`` (``Backend.activity_gauge``: a runtime's ``activity()``) whenever the
    metrics are collected: the queue that the dashboard shows, for Prometheus. (Replicas on
    Ray have no such gauge: they report through ``/ready`` and the dashboard.)"""

    def observe(_: CallbackOptions) -> list[Observation]:
        report = activity()
        return [
            Observation(int(report.get(state, 0)), {"specagent.call.state": state})
            for state in ("running", "queued")
        ]

    meter = metrics.get_meter("specagent.server", __version__, meter_provider=meter_provider)
    meter.create_observable_gauge(
        "specagent.calls",
        callbacks=[observe],
        unit="{call}",
        description="Calls the runtime is running and holding in its queue",
    )


def observe_audit(meter_provider: Any, audit: Any) -> None:
    """``specagent.audit.dropped`` (rows dropped because the audit buffer was full while the
    database was away) and ``specagent.audit.buffered`` (rows waiting to be written), read
    from ``audit`` (an ``AuditStore``) whenever the metrics are collected."""
    meter = metrics.get_meter("specagent.server", __version__, meter_provider=meter_provider)
    meter.create_observable_counter(
        "specagent.audit.dropped",
        callbacks=[lambda _: [Observation(int(audit.dropped))]],
        unit="{row}",
        description="Audit rows dropped because the buffer was full",
    )
    meter.create_observable_gauge(
        "specagent.audit.buffered",
        callbacks=[lambda _: [Observation(int(audit.buffered))]],
        unit="{row}",
        description="Audit rows waiting to be written to the database",
    )
