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

import contextlib
import logging
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from sse_starlette import EventSourceResponse

from ..backend import Backend
from ..calls import run_call
from ..errors import (
    SpecAgentError,
)
from .dashboard import WINDOWS, CallLog, CallRecord, dashboard_page, list_reports, summarise
from .errors import ApiError, as_api_error
from .keys import KeyStore
from .limits import Limited, Limits
from .metrics import HttpMetrics, observe_activity, observe_audit
from .middleware import BodyLimit
from .options import ServerOptions
from .requests import authenticate, bearer, call_spec, caller_of, default_per_key, parse_body
from .streaming import chain, collect, first_chunk, sse, unless_disconnected
from .wire import (
    completion,
    completion_id,
)

__all__ = ["ServerOptions", "create_app"]

log = logging.getLogger("specagent.server")


class _Draining:
    def __init__(self) -> None:
        self.on = False


def create_app(backend: Backend, keys: KeyStore, options: ServerOptions | None = None) -> FastAPI:
    """The app serving ``backend``. It does not own the backend: whoever made it closes it
    (``specagent serve`` does, after draining)."""
    options = options or ServerOptions()
    limits = Limits()
    per_key = options.max_concurrent or default_per_key(backend)
    draining = _Draining()
    app = FastAPI(title="specagent", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend, app.state.keys, app.state.limits = backend, keys, limits
    app.state.draining = draining
    calls = CallLog()
    app.state.calls = calls

    audit = options.audit
    model_name = backend.model_name
    engine_name = backend.engine

    def ended(
        request: Request, status: int, result: Any = None, error_id: str | None = None
    ) -> None:
        """A chat call answered: counted on the dashboard under its key and its policy where
        they were known and allowed (a refusal before that is filed under no policy), and its
        row in the audit store (every call, ran or refused)."""
        if request.url.path != "/v1/chat/completions":
            return
        caller = caller_of(request)
        if result is not None:
            calls.record(CallRecord.of_result(result, status, key=caller.key))
        else:
            calls.record(CallRecord(policy=caller.policy, status=status, key=caller.key))
        if audit is not None:
            audit.record(
                _audit_row(request, status, result, error_id, backend, model_name, engine_name)
            )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        ended(request, exc.status, error_id=exc.error_id)
        return exc.response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Whether to route calls here (a load balancer asks without a key); the queue's
        figures only for a key that may use every policy."""
        activity = await backend.report_activity()
        ok = not draining.on and not activity.get("closing", False) and activity["measured"]
        body: dict[str, Any] = {"ready": ok, "draining": draining.on}
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        # In this order: draining, key, then the body (an unauthenticated caller learns nothing
        # about what a valid request looks like).
        if draining.on:
            raise ApiError(503, "the server is draining; retry on another replica", "unavailable")
        key = authenticate(keys, request)
        caller_of(request).key = key.name
        if options.audit_required and (audit is None or not audit.healthy):
            message = "the audit store cannot record calls now, and this server needs a record"
            raise ApiError(503, message, "unavailable", code="audit_unavailable")
        # The key's limits before its body is read and parsed: a limited key's megabyte
        # costs nothing.
        try:
            release = limits.acquire(key, default_concurrent=per_key)
        except Limited as exc:
            raise ApiError(
                429,
                str(exc),
                "rate_limit_error",
                code="rate_limited",
                headers={"Retry-After": str(exc.retry_after)},
            ) from None
        try:
            body = parse_body(await request.body())
            call = call_spec(backend, body, request, key, options)
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
                ended(request, 499)
                return Response(status_code=499)
            if whole.result is not None:
                ended(request, 200, whole.result)
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
            ended(request, 499)
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = sse(
            request_id,
            model,
            chain(first, chunks),
            include_usage,
            release,
            lambda status, result: ended(request, status, result),
        )
        return EventSourceResponse(events, ping=15, send_timeout=30)

    if options.dashboard:

        @app.get("/dashboard")
        async def dashboard() -> Response:
            # The page holds no data: its script asks /dashboard/data with the key.
            return HTMLResponse(
                dashboard_page(),
                headers={
                    "Cache-Control": "no-store",
                    "Content-Security-Policy": (
                        "default-src 'none'; script-src 'unsafe-inline'; "
                        "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; "
                        "frame-ancestors 'none'"
                    ),
                },
            )

        @app.get("/dashboard/data")
        async def dashboard_data(request: Request, window: str = "5m") -> Response:
            key = authenticate(keys, request)
            if window not in WINDOWS:
                message = f"window must be one of {list(WINDOWS)}, got {window!r}"
                raise ApiError(422, message, "invalid_request_error", param="window")
            everything = "*" in key.policies
            data = summarise(
                calls,
                window,
                backend.policies,
                may_use=key.may_use,
                everything=everything,
                describe={p.name: backend.describe(p) for p in backend.policies},
                key=key.name,
            )
            data["model"] = backend.model_name
            data["engine"] = backend.engine
            if everything:
                data["activity"] = await backend.report_activity()
                data["reports"] = list_reports(options.reports_dir)
                if audit is not None:
                    data["audit"] = {
                        "healthy": audit.healthy,
                        "buffered": audit.buffered,
                        "written": audit.written,
                        "dropped": audit.dropped,
                    }
            return JSONResponse(data, headers={"Cache-Control": "no-store"})

        @app.get("/dashboard/reports/{name}")
        async def dashboard_report(request: Request, name: str) -> Response:
            key = authenticate(keys, request)
            if "*" not in key.policies:
                message = f"API key {key.name!r} may not read evaluation reports"
                raise ApiError(403, message, "permission_error", code="reports_denied")
            if name not in list_reports(options.reports_dir):  # never a path of the caller's
                raise ApiError(404, f"no report {name!r}", "not_found_error")
            assert options.reports_dir is not None
            # A download, never a page of this origin: the report is a file somebody wrote,
            # and this origin's pages hold API keys.
            return Response(
                (options.reports_dir / name).read_bytes(),
                media_type="application/octet-stream",
                headers={
                    "Cache-Control": "no-store",
                    "Content-Disposition": f'attachment; filename="{name}"',
                    "Content-Security-Policy": "sandbox; default-src 'none'",
                    "X-Content-Type-Options": "nosniff",
                },
            )

    @app.exception_handler(SpecAgentError)
    async def _spec_error(request: Request, exc: SpecAgentError) -> Response:
        error = as_api_error(exc)
        ended(request, error.status, error_id=error.error_id)
        return error.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        error = as_api_error(exc)
        ended(request, error.status, error_id=error.error_id)
        return error.response()

    def drain() -> None:
        """From now on new calls get 503; the calls in flight finish (whoever runs the app
        waits for them)."""
        draining.on = True
        log.info(
            "draining: new calls get 503; calls in flight, which finish first: %d",
            limits.total_in_flight(),
        )

    app.state.drain = drain
    app.add_middleware(
        BodyLimit,
        max_bytes=options.max_body_bytes,
        refused=lambda request: ended(request, 413),
    )
    if options.meter_provider is not None:
        app.add_middleware(HttpMetrics, meter_provider=options.meter_provider)  # outermost
        if audit is not None:
            observe_audit(options.meter_provider, audit)
        gauge = backend.activity_gauge
        if gauge is not None:
            observe_activity(options.meter_provider, gauge)
    return app


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


def _audit_row(
    request: Request,
    status: int,
    result: Any,
    error_id: str | None,
    backend: Backend,
    model: str,
    engine: str | None,
) -> dict[str, Any]:
    """A call's audit row as the server knows it (``specagent.audit.call_row``)."""
    from ..audit import call_row

    caller = caller_of(request)
    policy = caller.policy
    mode = None
    if policy is not None:
        with contextlib.suppress(Exception):
            mode = backend.policies[policy].mode
    return call_row(
        front_door="server",
        status=status,
        result=result,
        key_name=caller.key,
        tenant=caller.tenant,
        policy=policy,
        mode=mode,
        engine=engine,
        model=model,
        error_id=error_id,
    )
