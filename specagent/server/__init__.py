"""An OpenAI-compatible HTTP server over a ``SpecRuntime``: ``specagent serve``.

``create_app(backend, keys, options)`` is the ASGI app (``app.py``): OpenAI's chat completions
with keys, limits, policies and speculative stats (a request read in ``requests``, answered as
JSON or events by ``streaming``, errors mapped by ``errors``, options in ``options``);
``serve(...)`` (``runner.py``) loads a runtime as ``SpecRuntime.from_pretrained`` does, wires
``/metrics``, and runs the app on uvicorn with a graceful drain on SIGTERM/SIGINT. Needs the
``server`` extra: ``pip install "specagent[server]"``.
"""

from __future__ import annotations

from .app import ServerOptions, create_app
from .keys import ApiKey, KeyConfigError, KeyStore, hash_key
from .runner import DrainingServer, serve

__all__ = [
    "ApiKey",
    "DrainingServer",
    "KeyConfigError",
    "KeyStore",
    "ServerOptions",
    "create_app",
    "hash_key",
    "serve",
]
