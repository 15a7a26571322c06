"""Running the app: uvicorn, with a drain on SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from sse_starlette.sse import AppStatus

from ..engines import describe
from ..runtime.options import RuntimeOptions
from .app import ServerOptions, create_app
from .keys import KeyStore
from .metrics import prometheus_metrics

__all__ = ["DrainingServer", "serve"]

log = logging.getLogger("specagent.server")


class DrainingServer(uvicorn.Server):
    """uvicorn's server that first marks the app draining (new calls and ``/ready``: 503) when
    told to exit, then lets uvicorn wait for the calls in flight."""

    def __init__(self, config: uvicorn.Config, on_drain: Any) -> None:
        super().__init__(config)
        self._on_drain = on_drain
        # sse-starlette would end every open stream at SIGTERM; a drain lets them finish
        # (uvicorn's timeout_graceful_shutdown still bounds how long).
        AppStatus.disable_automatic_graceful_drain()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT start the drain; once it is done ``run`` returns normally (exit
        status 0, the runtime closed by ``serve``) instead of re-raising the signal."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; whoever runs us stops us
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(
    target: str,
    *,
    draft: str | None = None,
    policies: Any = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    keys: KeyStore,
    options: ServerOptions | None = None,
    drain_seconds: float = 30.0,
    ssl: tuple[str, str] | None = None,
    runtime_options: RuntimeOptions | None = None,
    **loading: Any,
) -> None:
    """Load the runtime (as ``SpecRuntime.from_pretrained``, with ``loading``: ``dtype``,
    ``engine``, ``engine_options``, ...) and serve it until SIGTERM or SIGINT; then drain
    (calls in flight finish within ``drain_seconds``), close, and write what the audit store
    still holds. ``ssl``: a certificate and its key (PEM files): HTTPS."""
    from ..runtime import SpecRuntime

    provider, render = prometheus_metrics()
    served = dataclasses.replace(runtime_options or RuntimeOptions(), meter_provider=provider)
    runtime = SpecRuntime.from_pretrained(
        target, draft=draft, policies=policies, options=served, **loading
    ).start()  # step costs measured from now: /ready says when
    options = dataclasses.replace(
        options or ServerOptions(), metrics=render, meter_provider=provider
    )
    if keys.open and options.allowed_hosts is None:
        # No key stands between a browser and an open server: only its own names may reach it.
        options = dataclasses.replace(options, allowed_hosts=("localhost", "127.0.0.1", host))
    app = create_app(runtime, keys, options)
    for line in describe(runtime.engine_choice):  # what runs, and what was turned off and why
        log.info("%s", line)
    audit = options.audit
    log.info("audit store: %s", audit if audit is not None else "none (--no-audit)")
    scheme = "https" if ssl else "http"
    log.info("serving %s on %s://%s:%d", runtime.model_name, scheme, host, port)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        timeout_graceful_shutdown=int(drain_seconds),
        log_level="info",
        ssl_certfile=ssl[0] if ssl else None,
        ssl_keyfile=ssl[1] if ssl else None,
    )
    try:
        DrainingServer(config, on_drain=app.state.drain).run()
    finally:
        runtime.close(drain=True)
        if audit is not None:
            audit.close()
