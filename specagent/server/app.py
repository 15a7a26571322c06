"""The OpenAI-compatible HTTP app over any ``Backend`` (a ``SpecRuntime``).

Routes: ``POST /v1/chat/completions`` (JSON or server-sent events), ``POST /v1/responses``
(OpenAI's Responses API, translated into the same call) with ``GET`` and ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` for a key's stored responses,
``GET /v1/models``,
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

from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from sse_starlette import EventSourceResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..backend import Backend
from ..calls import CallChunk, CallSpec, run_call
from ..errors import SpecAgentError
from .dashboard_routes import add_dashboard_routes
from .errors import ApiError, as_api_error, param_of
from .keys import ApiKey, KeyStore
from .limits import Limited, Limits
from .metrics import HttpMetrics, observe_activity, observe_audit
from .middleware import BodyLimit
from .options import ServerOptions
from .requests import (
    RESPONSES_NAMES,
    authenticate,
    bearer,
    call_spec,
    chat_request,
    default_per_key,
    parse_body,
    parse_responses,
    translated,
)
from .response_store import ResponseStore, StoredResponse
from .responses_stream import response_events
from .responses_wire import (
    ResponsesRequest,
    item_id,
    items_page,
    output_items,
    response_body,
    response_id,
)
from .served import Served
from .streaming import chain, collect, first_chunk, sse, unless_disconnected
from .wire import assistant_message, completion, completion_id

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
    _add_responses(app, served)
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
    """Every error as OpenAI's error object, each call's counted and recorded."""

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
    backend, options = served.backend, served.options

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        key, release = _admitted(request, served)
        try:
            body = parse_body(await request.body())
            call = call_spec(backend, body, request, key, options)
            release = _with_slots(served, key, call, release)
        except BaseException:
            release()
            raise
        model = body.model
        request_id = completion_id()
        chunks = run_call(backend, call, allow_incomplete=True)  # an async generator
        if not body.stream:
            whole = await _whole(request, served, chunks, release)
            if whole is None:
                return Response(status_code=499)
            return JSONResponse(completion(request_id, model, whole))
        first = await _first(request, served, chunks, release)
        if first is None:
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


def _add_responses(app: FastAPI, served: Served) -> None:
    """``POST /v1/responses`` (OpenAI's Responses API, translated into the chat call it asks
    for), and ``GET`` / ``DELETE /v1/responses/{id}`` for the key's stored responses."""
    backend, keys, options, store = served.backend, served.keys, served.options, served.responses

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        key, release = _admitted(request, served)
        try:
            body = parse_responses(await request.body())
            earlier = _chained(store, key, body)
            if body.store and store is None:
                message = "this server does not store responses (store must be false)"
                raise ApiError(400, message, "invalid_request_error", param="store")
            conversation = translated(body.continued, earlier)
            chat = chat_request(body, conversation)
            call = call_spec(backend, chat, request, key, options, budget_field="max_output_tokens")
            release = _with_slots(served, key, call, release)
        except BaseException:
            release()
            raise
        rid = response_id()
        started = response_body(rid, body)
        keep = store is not None and body.store is not False

        def finish(last: CallChunk, output: list[dict[str, Any]]) -> dict[str, Any]:
            answered = response_body(
                rid, body, output=output, last=last, stored=keep, created_at=started["created_at"]
            )
            if keep and store is not None:
                messages = [*conversation, assistant_message(last)]
                answered["store"] = store.put(key.name, rid, messages, answered, body.input_items())
            return answered

        chunks = run_call(backend, call, allow_incomplete=True)
        try:
            if not body.stream:
                whole = await _whole(request, served, chunks, release)
                if whole is None:
                    return Response(status_code=499)
                return JSONResponse(finish(whole, output_items(whole, item_id("msg"))))
            first = await _first(request, served, chunks, release)
        except ApiError as exc:  # a prompt too long names the input, not the chat messages
            exc.param = RESPONSES_NAMES.get(exc.param or "", exc.param)
            raise
        if first is None:
            return Response(status_code=499)
        events = response_events(
            started,
            chain(first, chunks),
            finish,
            release,
            lambda status, result: served.ended(request, status, result),
        )
        return EventSourceResponse(events, ping=15, send_timeout=30)

    @app.get("/v1/responses/{rid}")
    async def retrieve(request: Request, rid: str) -> dict[str, Any]:
        return _stored(store, authenticate(keys, request), rid).body

    @app.get("/v1/responses/{rid}/input_items")
    async def input_items(request: Request, rid: str) -> dict[str, Any]:
        stored = _stored(store, authenticate(keys, request), rid)
        try:
            return items_page(stored.input_items, request.query_params)
        except ValueError as exc:
            raise ApiError(422, str(exc), "invalid_request_error", param_of(str(exc))) from None

    @app.delete("/v1/responses/{rid}")
    async def delete(request: Request, rid: str) -> dict[str, Any]:
        key = authenticate(keys, request)
        if store is None or not store.delete(key.name, rid):
            raise _not_stored(rid)
        return {"id": rid, "object": "response", "deleted": True}


def _chained(
    store: ResponseStore | None, key: ApiKey, body: ResponsesRequest
) -> tuple[dict[str, Any], ...]:
    """The conversation ``previous_response_id`` continues (none where it names none)."""
    if body.previous_response_id is None:
        return ()
    if store is None:
        message = "this server does not store responses, so none can be continued"
        raise ApiError(400, message, "invalid_request_error", param="previous_response_id")
    return _stored(store, key, body.previous_response_id, "previous_response_id").messages


def _stored(
    store: ResponseStore | None, key: ApiKey, rid: str, param: str | None = None
) -> StoredResponse:
    """``key``'s stored response ``rid``; 404 alike for one never made, expired, deleted or
    another key's."""
    found = store.get(key.name, rid) if store is not None else None
    if found is None:
        raise _not_stored(rid, param)
    return found


def _not_stored(rid: str, param: str | None = None) -> ApiError:
    message = f"no response with id {rid!r} is stored for this key"
    return ApiError(404, message, "not_found_error", param=param, code="response_not_found")


def _admitted(request: Request, served: Served) -> tuple[ApiKey, Callable[[], None]]:
    """A call's key and the release of its place in the key's limits, checked in this order:
    draining, key, audit, media type, limits (an unauthenticated caller learns nothing about
    what a valid request looks like; a limited key's megabyte is never read)."""
    if served.draining:
        raise ApiError(503, "the server is draining; retry on another replica", "unavailable")
    key = authenticate(served.keys, request)
    audit = served.options.audit
    if served.options.audit_required and (audit is None or not audit.healthy):
        message = "the audit store cannot record calls now, and this server needs a record"
        raise ApiError(503, message, "unavailable", code="audit_unavailable")
    # JSON only: a browser page may POST text/plain anywhere without asking first, never
    # application/json (the cross-origin preflight stops it).
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        message = "the request body must be JSON (Content-Type: application/json)"
        raise ApiError(415, message, "invalid_request_error", code="unsupported_media_type")
    try:
        return key, served.limits.acquire(key, default_concurrent=served.per_key)
    except Limited as exc:
        raise _limited(exc) from None


def _with_slots(
    served: Served, key: ApiKey, spec: CallSpec, release: Callable[[], None]
) -> Callable[[], None]:
    """``release``, and a reproducible slot taken for a call whose policy is reproducible."""
    if not served.backend.policies[spec.call.policy or ""].reproducible:
        return release
    try:
        return _with_reproducible_slot(served.limits, key, served.options, release)
    except Limited as exc:
        raise _limited(exc) from None


async def _whole(
    request: Request,
    served: Served,
    chunks: AsyncGenerator[CallChunk, None],
    release: Callable[[], None],
) -> CallChunk | None:
    """A call run to its end for a JSON answer (its key's place released, its row recorded);
    None where the client went away (the call was cancelled: nobody reads the answer)."""
    try:
        whole = await unless_disconnected(request, collect(chunks))
    except SpecAgentError as exc:
        raise as_api_error(exc) from None
    finally:
        release()
        with anyio.CancelScope(shield=True):
            await chunks.aclose()
    if whole is None:
        served.ended(request, 499)
    elif whole.result is not None:
        served.ended(request, 200, whole.result)
    return whole


async def _first(
    request: Request,
    served: Served,
    chunks: AsyncGenerator[CallChunk, None],
    release: Callable[[], None],
) -> CallChunk | None:
    """A streamed call's first chunk (admission and the queue may take a while: a client that
    leaves meanwhile takes its call out of them); None where it left."""
    try:
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
    return first


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
