"""A live specagent server on localhost, over a tiny seeded model, for real HTTP clients
(imported by the server tests: `from live_server import live, ...`)."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import uvicorn
from conftest import make_model
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specagent import RuntimeOptions, SpecRuntime, shipped_policies
from specagent.server import DrainingServer, KeyStore, ServerOptions, create_app, hash_key
from specagent.server.metrics import prometheus_metrics

KEYS = {
    "full": "full-access-key-0123456789abcdef",
    "customer": "customer-only-key-0123456789abcd",
    "limited": "limited-rate-key-0123456789abcde",
    "capped": "capped-tokens-key-0123456789abcd",
    "hasty": "short-deadline-key-0123456789abc",
}
KEY_FILE = f"""\
keys:
  - name: full
    sha256: {hash_key(KEYS["full"])}
    max_concurrent: 64  # the load test's 64 streams (the default is a quarter of the slots)
  - name: customer
    sha256: {hash_key(KEYS["customer"])}
    policies: [customer-reply, default]
  - name: limited
    sha256: {hash_key(KEYS["limited"])}
    requests_per_minute: 2
  - name: capped
    sha256: {hash_key(KEYS["capped"])}
    max_tokens: 8
  - name: hasty
    sha256: {hash_key(KEYS["hasty"])}
    timeout_s: 0.5
"""


@dataclass
class Live:
    url: str
    runtime: SpecRuntime
    app: object
    spans: InMemorySpanExporter
    model: str

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@functools.cache
def sync_client(base_url: str, api_key: str) -> openai.OpenAI:
    """One ``openai`` client per server and key for the whole session (clients left to the
    garbage collector would leave their sockets for it too)."""
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_up(process: Any, url: str, log: Path, verify: Any = True) -> None:
    """Until ``specagent serve`` (``process``, logging to ``log``) answers ``/health`` at
    ``url``; fails with its log if it exits or takes over three minutes."""
    import httpx

    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", verify=verify, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free local port, from a thread; yields its address."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = DrainingServer(config, on_drain=app.state.drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEY_FILE)
    return path


@pytest.fixture(scope="session")
def live(tokenizer, key_file: Path) -> Iterator[Live]:
    """One server for the session: a 4k-context tiny model (long enough to cancel a call
    mid-way), the shipped policies, keys from a file, metrics and in-memory spans."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider, render = prometheus_metrics()
    target = make_model(len(tokenizer), seed=3, max_positions=4096)
    runtime = SpecRuntime(
        target=target,
        tokenizer=tokenizer,
        policies=shipped_policies(),
        device="cpu",
        model_name="tiny",
        options=RuntimeOptions(tracer_provider=tracer_provider, meter_provider=meter_provider),
    )
    options = ServerOptions(metrics=render, meter_provider=meter_provider)
    app = create_app(runtime, KeyStore.load(key_file, env=""), options)
    with serving(app) as url:
        yield Live(url, runtime, app, spans, "tiny")
    runtime.close()


def spelled_reply(live: Live, max_tokens: int) -> str:
    """A prompt whose greedy reply (``max_tokens``) starts with text that tokenizes back to
    the same tokens (its first 4): the tiny model's replies are random bytes, and a reply that
    is not UTF-8 text cannot be given back as text (a predicted output, say) token for
    token."""
    tokenizer = live.runtime.tokenizer
    for n in range(200):
        prompt = f"Say something, number {n}."
        reply = live.runtime.generate_sync(
            [{"role": "user", "content": prompt}], max_new_tokens=max_tokens, temperature=0.0
        )
        spelled = tokenizer(reply.text, add_special_tokens=False)["input_ids"]
        if len(reply.token_ids) >= 4 and spelled[:4] == reply.token_ids[:4]:
            return prompt
    raise AssertionError("no prompt of 200 has a reply that spells back to its tokens")
