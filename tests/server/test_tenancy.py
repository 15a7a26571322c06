"""What one key can learn or take from the others through the server: a restricted key sees
its own calls only and learns no policy names, refusals before a key is allowed count under no
policy, limits apply before a body is read, invented HTTP methods make no metric series, a key
that sets no bound holds a share of the decoding slots, and keys fail closed."""

from __future__ import annotations

import threading

import httpx
import pytest
from conftest import make_model
from live_server import KEYS, Live, key_file, live, serving, sync_client  # fixtures by name

from specagent import RuntimeOptions, SpecRuntime, shipped_policies
from specagent.server import KeyStore, ServerOptions, create_app
from specagent.server.keys import KeyConfigError
from specagent.server.metrics import prometheus_metrics

MESSAGES = [{"role": "user", "content": "Where is my order?"}]


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]}"}


def _dashboard(live: Live, key: str) -> dict:
    response = httpx.get(
        f"{live.url}/dashboard/data", params={"window": "all"}, headers=_headers(key), timeout=30
    )
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    return response.json()


def _calls(data: dict, policy: str) -> int:
    row = data["policies"].get(policy) or {}
    return int(row.get("calls", 0))


def test_a_restricted_key_sees_its_own_calls_only(live: Live) -> None:
    before_mine = _calls(_dashboard(live, "customer"), "customer-reply")
    before_all = _calls(_dashboard(live, "full"), "customer-reply")
    for _ in range(3):  # another key's traffic on the shared policy
        sync_client(live.base_url, KEYS["full"]).chat.completions.create(
            model="tiny:customer-reply", messages=MESSAGES, max_tokens=2
        )
    sync_client(live.base_url, KEYS["customer"]).chat.completions.create(
        model="tiny:customer-reply", messages=MESSAGES, max_tokens=2
    )
    assert _calls(_dashboard(live, "customer"), "customer-reply") == before_mine + 1
    assert _calls(_dashboard(live, "full"), "customer-reply") == before_all + 4


def test_a_refused_policy_is_filed_under_no_policy(live: Live) -> None:
    full = _dashboard(live, "full")
    summaries, unresolved = _calls(full, "internal-summary"), full["unresolved"]["calls"]
    response = httpx.post(
        f"{live.base_url}/chat/completions",
        json={"model": "tiny:internal-summary", "messages": MESSAGES, "max_tokens": 2},
        headers=_headers("customer"),
        timeout=30,
    )
    assert response.status_code == 404
    after = _dashboard(live, "full")
    assert _calls(after, "internal-summary") == summaries  # not filed under the guess
    assert after["unresolved"]["calls"] == unresolved + 1


def test_ready_shows_the_queue_to_a_full_key_only(live: Live) -> None:
    anonymous = httpx.get(f"{live.url}/ready", timeout=30).json()
    assert set(anonymous) == {"ready", "draining"}
    restricted = httpx.get(f"{live.url}/ready", headers=_headers("customer"), timeout=30).json()
    assert set(restricted) == {"ready", "draining"}
    full = httpx.get(f"{live.url}/ready", headers=_headers("full"), timeout=30).json()
    assert {"running", "queued", "measured"} <= set(full)


def test_a_limited_keys_body_is_never_read(live: Live) -> None:
    """Over its rate, a key's megabyte of garbage gets 429, not a parse error."""
    garbage = b"{" + b"x" * (1 << 20 - 16)
    statuses = []
    for _ in range(4):  # its bucket holds 2
        statuses.append(
            httpx.post(
                f"{live.base_url}/chat/completions",
                content=garbage,
                headers={**_headers("limited"), "Content-Type": "application/json"},
                timeout=30,
            ).status_code
        )
    assert statuses[:2] == [422, 422]
    assert statuses[2:] == [429, 429]


def test_invented_http_methods_make_no_metric_series(live: Live) -> None:
    """Some HTTP servers pass any method through (uvicorn with h11): straight to the app."""
    from fastapi.testclient import TestClient

    in_process = TestClient(live.app)
    for i in range(5):
        in_process.request(f"INVENTED{i}", "/health")
    text = httpx.get(f"{live.url}/metrics", headers=_headers("full"), timeout=30).text
    assert "INVENTED" not in text
    assert 'http_request_method="_OTHER"' in text


def test_no_auth_with_keys_is_refused(key_file) -> None:
    with pytest.raises(KeyConfigError, match="--no-auth with API keys configured"):
        KeyStore.load(key_file, env="", open=True)
    with pytest.raises(KeyConfigError, match="--no-auth with API keys configured"):
        KeyStore.load(None, env=f"me={KEYS['full']}", open=True)
    open_store = KeyStore.load(None, env="", open=True)
    assert open_store.authenticate("anything").name == "anonymous"


def test_a_key_with_no_bound_holds_a_share_of_the_slots(tokenizer) -> None:
    """With 4 decoding slots a key that sets no bound holds one call; another key's call goes
    through while it does."""
    target = make_model(len(tokenizer), seed=3, max_positions=4096)
    target.generation_config.eos_token_id = None
    target.config.eos_token_id = None
    runtime = SpecRuntime(
        target,
        tokenizer=tokenizer,
        policies=shipped_policies(),
        model_name="tiny",
        options=RuntimeOptions(max_active=4),
    )
    runtime.eos_token_ids = []
    keys = KeyStore.load(None, env=f"a={KEYS['full']},b={KEYS['customer']}")
    provider, render = prometheus_metrics()
    app = create_app(runtime, keys, ServerOptions(metrics=render, meter_provider=provider))
    try:
        with serving(app) as url:
            started = threading.Event()

            def long_call() -> None:
                body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3000, "stream": True}
                with httpx.stream(
                    "POST",
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {KEYS['full']}"},
                    timeout=120,
                ) as response:
                    for _ in response.iter_lines():
                        started.set()

            reader = threading.Thread(target=long_call, daemon=True)
            reader.start()
            assert started.wait(60)
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
            second = httpx.post(
                f"{url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEYS['full']}"},
                timeout=60,
            )
            assert second.status_code == 429
            assert "already has 1 calls in flight" in second.json()["error"]["message"]
            other = httpx.post(
                f"{url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEYS['customer']}"},
                timeout=60,
            )
            assert other.status_code == 200
    finally:
        runtime.close(drain=False)
