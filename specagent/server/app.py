"""The OpenAI-compatible HTTP app over any ``Backend`` (a ``SpecRuntime``).

Routes: ``POST /v1/chat/completions`` (JSON or server-sent events), ``GET /v1/models``,
``GET /health`` (the process answers), ``GET /ready`` (models loaded, step costs measured, not
draining), ``GET /metrics`` (Prometheus text from the runtime's OpenTelemetry instruments) and
``GET /dashboard`` with its data (``specagent.server.dashboard``: each policy's speed,
acceptance and relaxed divergence over a window, numbers only).

Each call: key (401), body size (413), fields (422, naming the field), policy by precedence
(``metadata.specagent_policy``, the ``X-Specagent-Policy`` header, ``<model>:<policy>``, then
the tags in ``metadata.specagent_tags``), the key's allowed policies (403), unknown policy (404),
key limits and server overload (429 with ``Retry-After``), draining (503). The tenant of a call
is its key's name, the principal its memory is accounted to, with ``user`` a sub-tenant under
it, so one key's text never drafts another's tokens and no key's calls flush another's.
A client that disconnects from a stream cancels its call. The app only translates: the call
itself is ``specagent.calls``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette import EventSourceResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..backend import Backend
from ..calls import run_call
from ..errors import SpecAgentError
from .dashboard_routes import add_dashboard_routes
from .errors import ApiError, as_api_error
from .keys import ApiKey, KeyStore
from .limits import Limited, Limits
from .metrics import HttpMetrics, observe_activity, observe_audit
from .middleware import BodyLimit
from .options import ServerOptions
from .requests import authenticate, bearer, call_spec, default_per_key, parse_body
from .served import Served
from .streaming import chain, collect, first_chunk, sse, unless_disconnected
from .wire import completion, completion_id

__all__ = ["ServerOptions", "create_app"]


def create_app(backend: Backend, keys: KeyStore, options: ServerOptions | None = None) -> FastAPI:
    """The app serving ``backend``. It does not own the backend: whoever made it closes it
    (``specagent serve`` does, after draining)."""
    options = options or ServerOptions()
    served = Served(backend, keys, options, options.max_concurrent or default_per_key(backend))
    app = FastAPI(title="specagent", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served, app.state.limits, app.state.drain = served, served.limits, served.drain
    _add_errors(app, served)
    _add_probes(app, served)
    _add_chat(app, served)
    if options.dashboard:
        add_dashboard_routes(app, served)
    app.add_middleware(
        BodyLimit,
        max_bytes=options.max_body_bytes,
        refused=lambda request: served.ended(request, 413),
    )
    if options.allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(options.allowed_hosts))
    if options.meter_provider is not None:
        app.add_middleware(HttpMetrics, meter_provider=options.meter_provider)  # outermost
        if options.audit is not None:
            observe_audit(options.meter_provider, options.audit)
        gauge = backend.activity_gauge
        if gauge is not None:
            observe_activity(options.meter_provider, gauge)
    return app


def _add_errors(app: FastAPI, served: Served) -> None:
    """Every error as OpenAI's error object, each chat call's counted and recorded."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        served.ended(request, exc.status, error_id=exc.error_id)
        return exc.response()

    @app.exception_handler(SpecAgentError)
    async def _spec_error(request: Request, exc: SpecAgentError) -> Response:
        error = as_api_error(exc)
        served.ended(request, error.status, error_id=error.error_id)
        return error.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        error = as_api_error(exc)
        served.ended(request, error.status, error_id=error.error_id)
        return error.response()


def _add_probes(app: FastAPI, served: Served) -> None:
    """``/health``, ``/ready``, ``/metrics`` and ``/v1/models``."""
    backend, keys, options = served.backend, served.keys, served.options

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Whether to route calls here (a load balancer asks without a key); the queue's
        figures only for a key that may use every policy."""
        activity = await backend.report_activity()
        draining = served.draining
        ok = not draining and not activity.get("closing", False) and activity["measured"]
        body: dict[str, Any] = {"ready": ok, "draining": draining}
        presented = keys.authenticate(bearer(request))
        if presented is not None and "*" in presented.policies and not keys.open:
            body.update(activity)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not options.metrics_public:
            key = authenticate(keys, request)
            if "*" not in key.policies:
                message = f"API key {key.name!r} may not read the metrics (they name every policy)"
                raise ApiError(403, message, "permission_error", code="metrics_denied")
        if options.metrics is None:
            raise ApiError(404, "metrics are not enabled on this server", "not_found_error")
        return PlainTextResponse(
            options.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        key = authenticate(keys, request)
        name = backend.model_name
        entries = [_model_entry(name, None, None)]
        for policy in backend.policies:
            if key.may_use(policy.name):
                entries.append(_model_entry(f"{name}:{policy.name}", policy.mode, name))
        return {"object": "list", "data": entries}


def _add_chat(app: FastAPI, served: Served) -> None:
    """``POST /v1/chat/completions``: the key, its limits, the body, the call, its answer."""
    backend, keys, options, limits = served.backend, served.keys, served.options, served.limits
    audit = options.audit

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        # In this order: draining, key, then the body (an unauthenticated caller learns nothing
        # about what a valid request looks like).
        if served.draining:
            raise ApiError(503, "the server is draining; retry on another replica", "unavailable")
        key = authenticate(keys, request)
        if options.audit_required and (audit is None or not audit.healthy):
            message = "the audit store cannot record calls now, and this server needs a record"
            raise ApiError(503, message, "unavailable", code="audit_unavailable")
        # JSON only: a browser page may POST text/plain anywhere without asking first, never
        # application/json (the cross-origin preflight stops it).
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            message = "the request body must be JSON (Content-Type: application/json)"
            raise ApiError(415, message, "invalid_request_error", code="unsupported_media_type")
        # The key's limits before its body is read and parsed: a limited key's megabyte
        # costs nothing.
        try:
            release = limits.acquire(key, default_concurrent=served.per_key)
        except Limited as exc:
            raise _limited(exc) from None
        try:
            body = parse_body(await request.body())
            call = call_spec(backend, body, request, key, options)
            if backend.policies[call.call.policy or ""].reproducible:
                release = _with_reproducible_slot(limits, key, options, release)
        except Limited as exc:
            release()
            raise _limited(exc) from None
        except BaseException:
            release()
            raise
        model = body.model
        request_id = completion_id()
        chunks = run_call(backend, call, allow_incomplete=True)  # an async generator
        if not body.stream:
            try:
                whole = await unless_disconnected(request, collect(chunks))
            except SpecAgentError as exc:
                raise as_api_error(exc) from None
            finally:
                release()
                with anyio.CancelScope(shield=True):
                    await chunks.aclose()
            if whole is None:  # the client went away: the call was cancelled, nobody reads this
                served.ended(request, 499)
                return Response(status_code=499)
            if whole.result is not None:
                served.ended(request, 200, whole.result)
            return JSONResponse(completion(request_id, model, whole))
        try:
            # Admission and the queue may take a while: a client that leaves meanwhile
            # takes its call out of them.
            first = await unless_disconnected(request, first_chunk(chunks))
        except BaseException:
            release()
            await chunks.aclose()
            raise
        if first is None:
            release()
            with anyio.CancelScope(shield=True):
                await chunks.aclose()
            served.ended(request, 499)
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = sse(
            request_id,
            model,
            chain(first, chunks),
            include_usage,
            release,
            lambda status, result: served.ended(request, status, result),
        )
        return EventSourceResponse(events, ping=15, send_timeout=30)


def _limited(exc: Limited) -> ApiError:
    headers = {"Retry-After": str(exc.retry_after)}
    return ApiError(429, str(exc), "rate_limit_error", code="rate_limited", headers=headers)


def _with_reproducible_slot(
    limits: Limits, key: ApiKey, options: ServerOptions, release: Callable[[], None]
) -> Callable[[], None]:
    """``release`` that also gives back one of the key's reproducible slots, taken now
    (``Limited`` where it has none left)."""
    bound = key.max_reproducible if key.max_reproducible is not None else options.max_reproducible
    release_reproducible = limits.acquire_reproducible(key, bound)

    def both() -> None:
        release_reproducible()
        release()

    return both


def _model_entry(model_id: str, mode: str | None, parent: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "specagent",
    }
    if mode is not None:
        entry["specagent_mode"] = mode
        entry["parent"] = parent
    return entry
