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
import dataclasses
import inspect
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from ..backend import Backend
from ..calls import CallChunk, CallSpec, run_call, split_model
from ..decoding.tenants import Tenant
from ..errors import (
    CallTimeoutError,
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    PolicyNotFoundError,
    RuntimeClosedError,
    RuntimeOverloadedError,
    SpecAgentError,
)
from .dashboard import WINDOWS, CallLog, CallRecord, dashboard_page, list_reports, summarise
from .keys import ApiKey, KeyStore
from .limits import Limited, Limits
from .metrics import HttpMetrics, observe_activity, observe_audit
from .wire import (
    ChatCompletionRequest,
    completion,
    completion_id,
    error_body,
    final_delta,
    stream_chunk,
    to_template_messages,
    usage_body,
)

__all__ = ["ServerOptions", "create_app"]

log = logging.getLogger("specagent.server")

POLICY_HEADER = "x-specagent-policy"
POLICY_METADATA_KEY = "specagent_policy"
TAGS_METADATA_KEY = "specagent_tags"


@dataclass(frozen=True)
class ServerOptions:
    max_body_bytes: int = 1 << 20
    """Larger request bodies get 413 before they are parsed."""
    default_policy: str | None = None
    """Policy of calls that name none and whose tags route nowhere (None: the runtime's
    lossless default)."""
    metrics: Callable[[], bytes] | None = None
    """Prometheus text of the runtime's instruments (``specagent.server.metrics``)."""
    metrics_public: bool = False
    """Serve ``/metrics`` without a key (for a scraper on a private network). By default it
    needs a key that may use every policy: the metrics name the model and every policy."""
    max_tokens: int = 4096
    """The most new tokens a call may ask for (a key's ``max_tokens`` replaces it); a call
    that asks for none gets its policy's default."""
    timeout_s: float | None = 600.0
    """Each call's deadline, queueing included (a key's ``timeout_s`` replaces it); None:
    none."""
    max_concurrent: int | None = None
    """Calls in flight per key, for keys that set no ``max_concurrent`` of their own. None: a
    quarter of the runtime's decoding slots (``max_active``; at least one), so that no key
    alone fills them and other keys' calls always progress."""
    meter_provider: Any = None
    """Where the server's own HTTP metric goes (``metrics.HttpMetrics``; ``specagent serve``
    passes the runtime's, so ``/metrics`` shows it). None: not recorded."""
    dashboard: bool = True
    """Serve ``/dashboard`` and its data (numbers per policy, behind the key check)."""
    reports_dir: Path | None = None
    """Where ``specagent eval`` wrote its HTML reports: the dashboard links them (for a key
    that may use every policy)."""
    audit: Any = None
    """The ``specagent.audit.AuditStore`` every call's row goes to (ran or refused; None: no
    audit)."""
    audit_required: bool = False
    """Refuse calls (503) while the audit store cannot record them: no record, no call."""


class _Draining:
    def __init__(self) -> None:
        self.on = False


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        error_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers or {}
        self.error_id = error_id
        """The id the server's log files this error under (its audit row names it)."""

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(str(self), self.kind, self.param, self.code),
            status_code=self.status,
            headers=self.headers,
        )


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
    engine_name = getattr(backend, "engine", None)

    def ended(
        request: Request, status: int, result: Any = None, error_id: str | None = None
    ) -> None:
        """A chat call answered: counted on the dashboard under its key and its policy where
        they were known and allowed (a refusal before that is filed under no policy), and its
        row in the audit store (every call, ran or refused)."""
        if request.url.path != "/v1/chat/completions":
            return
        key = getattr(request.state, "key", None)
        if result is not None:
            calls.record(CallRecord.of_result(result, status, key=key))
        else:
            policy = getattr(request.state, "policy", None)
            calls.record(CallRecord(policy=policy, status=status, key=key))
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
        activity = await _activity(backend)
        ok = not draining.on and not activity.get("closing", False) and activity["measured"]
        body: dict[str, Any] = {"ready": ok, "draining": draining.on}
        presented = keys.authenticate(_bearer(request))
        if presented is not None and "*" in presented.policies and not keys.open:
            body.update(activity)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not options.metrics_public:
            key = _authenticate(keys, request)
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
        key = _authenticate(keys, request)
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
        key = _authenticate(keys, request)
        request.state.key = key.name
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
            body = _parse(await request.body())
            call = _call_spec(backend, body, request, key, options)
        except BaseException:
            release()
            raise
        model = body.model
        request_id = completion_id()
        chunks = run_call(backend, call, allow_incomplete=True)  # an async generator
        if not body.stream:
            try:
                whole = await _unless_disconnected(request, _collect(chunks))
            except SpecAgentError as exc:
                raise _as_api_error(exc) from None
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
            first = await _unless_disconnected(request, _first(chunks))
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
        events = _sse(
            request_id,
            model,
            _chain(first, chunks),
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
            key = _authenticate(keys, request)
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
                describe=_describe(backend),
                key=key.name,
            )
            data["model"] = backend.model_name
            data["engine"] = getattr(backend, "engine", None)
            if everything:
                data["activity"] = await _activity(backend)
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
            key = _authenticate(keys, request)
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
        error = _as_api_error(exc)
        ended(request, error.status, error_id=error.error_id)
        return error.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        error = _as_api_error(exc)
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
        if callable(getattr(backend, "activity", None)):
            observe_activity(options.meter_provider, backend.activity)  # type: ignore[attr-defined]
    return app


class BodyLimit:
    """413 for a request body over ``max_bytes``: at once from ``Content-Length``, or as soon as
    a chunked body passes the limit (a plain ASGI middleware, so streaming responses and
    client disconnects pass through untouched)."""

    def __init__(
        self, app: Any, max_bytes: int, refused: Callable[[Request], None] | None = None
    ) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.refused = refused
        """Told of each request refused here (the dashboard and the audit store count it)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, length)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(scope, receive, send, f"more than {self.max_bytes}")

    async def _refuse(self, scope: Any, receive: Any, send: Any, size: str) -> None:
        message = f"request body of {size} bytes is over the limit of {self.max_bytes}"
        error = ApiError(413, message, "invalid_request_error", code="body_too_large")
        if self.refused is not None:
            self.refused(Request(scope))
        await error.response()(scope, receive, send)


class _TooLarge(Exception):
    pass


def _parse(raw: bytes) -> ChatCompletionRequest:
    """The request body, or 422 naming the first field that is wrong."""
    try:
        return ChatCompletionRequest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        text = f"{param}: {message}" if param else message
        raise ApiError(422, text, "invalid_request_error", param) from None


async def _activity(backend: Backend) -> dict[str, Any]:
    """The backend's activity (a runtime's, or, on Ray, what its replicas report)."""
    activity = getattr(backend, "activity", None)
    if activity is None:  # another engine behind the seam: it answers, so it is ready
        return {"running": 0, "queued": 0, "measured": True, "closing": False}
    report = activity()
    if inspect.isawaitable(report):
        report = await report
    return dict(report)


def _describe(backend: Backend) -> dict[str, dict[str, Any]]:
    """Per policy: the engine, the target's dtype and the drafter that run it (what a backend
    that is a ``SpecRuntime`` says; nothing from another backend)."""
    engine = getattr(backend, "engine", None)
    precision = getattr(backend, "precision", None) or {}
    dtype = (precision.get("target") or {}).get("dtype")
    target: Any = getattr(backend, "target", None)
    if dtype is None and hasattr(target, "parameters"):  # a model given as is: its own dtype
        dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    drafter_kind = getattr(backend, "drafter_kind", None)
    out: dict[str, dict[str, Any]] = {}
    for policy in backend.policies:
        described: dict[str, Any] = {"engine": engine, "dtype": dtype}
        if drafter_kind is not None:
            described["drafter"] = drafter_kind(policy)
        out[policy.name] = {k: v for k, v in described.items() if v is not None}
    return out


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


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _authenticate(keys: KeyStore, request: Request) -> ApiKey:
    presented = _bearer(request)
    key = keys.authenticate(presented)
    if key is None:
        message = (
            "invalid API key" if presented else "missing API key (Authorization: Bearer <key>)"
        )
        raise ApiError(401, message, "authentication_error", code="invalid_api_key")
    return key


def _call_spec(
    backend: Backend,
    body: ChatCompletionRequest,
    request: Request,
    key: ApiKey,
    options: ServerOptions,
) -> CallSpec:
    metadata = body.metadata or {}
    policy = metadata.get(POLICY_METADATA_KEY) or request.headers.get(POLICY_HEADER)
    try:
        named = split_model(body.model, backend.model_name)
    except ModelNotFoundError as exc:
        code = "model_not_found"
        raise ApiError(404, str(exc), "not_found_error", param="model", code=code) from exc
    policy = policy or named
    tags = [t for t in (metadata.get(TAGS_METADATA_KEY) or "").split(",") if t.strip()]
    # The key is the principal (its memory is accounted as one), ``user`` a sub-tenant under it.
    try:
        tenant = Tenant(key.name, body.user or None)
    except ValueError as exc:
        raise ApiError(422, f"user: {exc}", "invalid_request_error", param="user") from None
    request.state.tenant = str(tenant)
    try:
        call = CallSpec.build(
            to_template_messages(body.messages),
            backend=backend,
            policy=policy,
            tags=[t.strip() for t in tags],
            tenant=tenant,
            default_policy=options.default_policy,
            tools=body.tools,
            tool_choice=body.tool_choice,
            response_format=body.response_format,
            stop=body.stop,
            temperature=body.temperature,
            top_p=body.top_p,
            max_tokens=_budget(body.budget, key, options),
            seed=body.seed,
            timeout=key.timeout_s if key.timeout_s is not None else options.timeout_s,
        )
    except ValueError as exc:  # InvalidRequestError and message translation
        raise _as_api_error(exc) from None
    chosen = _resolved_policy(backend, call, key)
    if not key.may_use(chosen):
        # The same answer as for a policy that does not exist: a restricted key learns no
        # policy names beyond its own.
        raise _unavailable_policy(backend, call.policy or chosen, key)
    request.state.policy = chosen  # from here on its refusals count under it
    # The server records its calls in the audit store itself (with their HTTP status and
    # key): the runtime does not record them again.
    return dataclasses.replace(call, options={**call.options, "record": False})


DEFAULT_SHARE = 4
"""A key that sets no concurrency bound may hold a quarter of the runtime's decoding slots."""


def default_per_key(backend: Backend) -> int:
    """Calls in flight a key may hold when neither it nor the server says: a share of the
    backend's decoding slots (16 where it does not say how many it has)."""
    slots = getattr(backend, "max_active", None)
    return max(1, slots // DEFAULT_SHARE) if isinstance(slots, int) else 16


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

    policy = getattr(request.state, "policy", None)
    mode = None
    if policy is not None:
        with contextlib.suppress(Exception):
            mode = backend.policies[policy].mode
    return call_row(
        front_door="server",
        status=status,
        result=result,
        key_name=getattr(request.state, "key", None),
        tenant=getattr(request.state, "tenant", None),
        policy=policy,
        mode=mode,
        engine=engine,
        model=model,
        error_id=error_id,
    )


def _budget(asked: int | None, key: ApiKey, options: ServerOptions) -> int | None:
    """The call's ``max_tokens``: what it asked for, refused over the key's or the server's
    cap (a call that asks for none runs with its policy's default: the operator's own)."""
    cap = key.max_tokens if key.max_tokens is not None else options.max_tokens
    if asked is None:
        return None
    if asked > cap:
        message = f"max_tokens {asked} is over this key's limit of {cap}"
        raise ApiError(422, message, "invalid_request_error", param="max_tokens")
    return asked


def _resolved_policy(backend: Backend, call: CallSpec, key: ApiKey) -> str:
    """The policy the backend will run the call under (unknown names: 404, listing only the
    policies the key may use: a restricted key learns nothing of the others)."""
    try:
        return backend.policies.resolve(call.policy, call.tags).name
    except PolicyNotFoundError as exc:
        if "*" in key.policies:
            raise _as_api_error(exc) from None
        raise _unavailable_policy(backend, call.policy, key) from None


def _unavailable_policy(backend: Backend, asked: str | None, key: ApiKey) -> ApiError:
    """404 for a policy a restricted key may not use, whether or not it exists."""
    allowed = [p.name for p in backend.policies if key.may_use(p.name)]
    message = f"no policy {asked!r} is available to this key; it may use: {allowed}"
    return ApiError(404, message, "not_found_error", param="policy", code="policy_not_found")


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, PolicyNotFoundError):
        return ApiError(404, str(exc), "not_found_error", param="policy", code="policy_not_found")
    if isinstance(exc, ContextLengthError):
        code = "context_length_exceeded"
        return ApiError(400, str(exc), "invalid_request_error", param="messages", code=code)
    if isinstance(exc, RuntimeOverloadedError):
        return ApiError(
            429,
            str(exc),
            "rate_limit_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, RuntimeClosedError):
        return ApiError(503, str(exc), "unavailable")
    if isinstance(exc, CallTimeoutError):
        return ApiError(504, str(exc), "timeout_error", code="deadline_exceeded")
    if isinstance(exc, InvalidRequestError):
        return ApiError(422, str(exc), "invalid_request_error", param=_param_of(str(exc)))
    # Any other exception's text is the server's business (paths, tensor shapes, other calls'
    # state, a replica's traceback): the log has it under an id the client can quote.
    error_id = secrets.token_hex(6)
    if isinstance(exc, ValueError):  # a library's complaint about the input: its words stay here
        log.warning("request refused (error id %s): %r", error_id, exc)
        message = f"the request could not be processed (error id {error_id})"
        return ApiError(422, message, "invalid_request_error", error_id=error_id)
    log.error("call failed (error id %s)", error_id, exc_info=exc)
    message = f"the call failed on the server (error id {error_id}; its log has the details)"
    return ApiError(500, message, "server_error", error_id=error_id)


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0].strip()
    return head if head and " " not in head else None


async def _first(chunks: AsyncGenerator[CallChunk, None]) -> CallChunk:
    """The first chunk, so that errors before any output are answered with a status code."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        raise ApiError(500, "the call ended without output", "server_error") from None
    except SpecAgentError as exc:
        raise _as_api_error(exc) from None


async def _chain(
    first: CallChunk, rest: AsyncGenerator[CallChunk, None]
) -> AsyncGenerator[CallChunk, None]:
    """``first`` then the rest; closing this closes ``rest`` (and so cancels the call)."""
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await rest.aclose()


async def _collect(chunks: AsyncGenerator[CallChunk, None]) -> CallChunk:
    """The last chunk of a call, its content the whole output's."""
    text: list[str] = []
    async for chunk in chunks:
        if chunk.result is None:
            text.append(chunk.text)
            continue
        return _whole(chunk, "".join(text))
    raise ApiError(500, "the call ended without a result", "server_error")


async def _unless_disconnected(request: Request, work: Awaitable[CallChunk]) -> CallChunk | None:
    """``work``'s result, or None when the client disconnects first (``work`` is cancelled:
    a non-streaming call must not run on for nobody; a streaming one stops as its response
    does). Errors of ``work`` come out as they are."""
    outcome: list[CallChunk] = []
    failure: list[BaseException] = []

    async def run(scope: anyio.CancelScope) -> None:
        try:
            outcome.append(await work)
        except Exception as exc:  # re-raised below, outside the task group
            failure.append(exc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, tg.cancel_scope)
        while not await request.is_disconnected():
            await anyio.sleep(DISCONNECT_POLL_S)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return outcome[0] if outcome else None


DISCONNECT_POLL_S = 0.25
"""How often a non-streaming call checks that its client is still there."""


def _whole(last: CallChunk, streamed: str) -> CallChunk:
    """The last chunk with its content made the whole output's (text chunks + the rest)."""
    return CallChunk(
        result=last.result,
        content=streamed + last.content,
        tool_calls=last.tool_calls,
        finish_reason=last.finish_reason,
    )


async def _sse(
    request_id: str,
    model: str,
    chunks: AsyncGenerator[CallChunk, None],
    include_usage: bool,
    release: Callable[[], None],
    ended: Callable[[int, Any], None],
) -> AsyncIterator[dict[str, str]]:
    """Server-sent events of one call. Closing this generator (the client went away) closes
    ``chunks``, which cancels the call in the runtime. ``ended(status, result)`` says how the
    call ended: 200 with its result, an error's status, or 499 (the client went away)."""
    status, result = 499, None
    try:
        yield _event(stream_chunk(request_id, model, {"role": "assistant", "content": ""}))
        async for chunk in chunks:
            if chunk.result is None:
                if chunk.text:
                    yield _event(stream_chunk(request_id, model, {"content": chunk.text}))
                continue
            delta = final_delta(chunk)
            if not chunk.tool_calls and chunk.content:
                delta["content"] = chunk.content
            stats = {
                "speculative_decoding_stats": completion(request_id, model, chunk)[
                    "speculative_decoding_stats"
                ]
            }
            yield _event(stream_chunk(request_id, model, delta, chunk.finish_reason, extra=stats))
            if include_usage:
                yield _event(stream_chunk(request_id, model, usage=usage_body(chunk.result)))
            status, result = 200, chunk.result
        yield {"data": "[DONE]"}
    except Exception as exc:  # after the first chunk: the status line is already sent
        api = _as_api_error(exc)
        status, result = api.status, None
        yield _event(error_body(str(api), api.kind, api.param, api.code))
    finally:
        ended(status, result)
        release()
        with anyio.CancelScope(shield=True):
            await chunks.aclose()


def _event(body: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(body, separators=(",", ":"))}
