"""The server's audit rows and TLS: every call, ran or refused, is one row with its key's name
(never the key) and HTTP status; ``--audit-required`` refuses calls while the store cannot
record them; the server speaks HTTPS with a certificate made here, to the ``openai`` client."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import make_model, make_tokenizer
from live_server import KEYS, free_port, key_file, serving, wait_until_up  # fixtures by name
from sqlalchemy import select

from specagent import SpecRuntime, shipped_policies
from specagent.audit import AuditStore, read_calls
from specagent.audit.schema import REFUSALS
from specagent.server import KeyStore, ServerOptions, create_app

MESSAGES = [{"role": "user", "content": "Where is my order zebra-quartz-7741?"}]


@pytest.fixture(scope="module")
def runtime(tokenizer):
    rt = SpecRuntime(
        make_model(len(tokenizer), seed=3, max_positions=4096),
        tokenizer=tokenizer,
        policies=shipped_policies(),
        model_name="tiny",
    )
    yield rt
    rt.close()


def _post(url: str, key: str | None, body: object, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60, **extra)


def test_every_call_is_one_row_with_its_status_and_key_name(runtime, key_file, tmp_path) -> None:
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.sqlite'}")
    keys = KeyStore.load(key_file, env="")
    app = create_app(runtime, keys, ServerOptions(audit=store, max_body_bytes=4096))
    # Greedy: the policy samples, and a sampled end-of-text first would leave 0 tokens.
    body = {"model": "tiny:customer-reply", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    with serving(app) as url:
        statuses = [
            _post(url, KEYS["full"], body).status_code,  # 200
            _post(url, KEYS["full"], {**body, "stream": True}).status_code,  # 200, streamed
            _post(url, "not-a-key-0123456789", body).status_code,  # 401
            _post(url, KEYS["customer"], {**body, "model": "tiny:internal-summary"}).status_code,
            _post(url, KEYS["full"], {**body, "max_tokens": -1}).status_code,  # 422
            _post(url, KEYS["full"], {**body, "messages": "x" * 9000}).status_code,  # 413
        ]
        for _ in range(3):  # its bucket holds 2 a minute
            statuses.append(_post(url, KEYS["limited"], body).status_code)
    assert statuses == [200, 200, 401, 404, 422, 413, 200, 200, 429]
    assert store.flush()
    rows = read_calls(store.engine, limit=None)
    refusals = _refusals(store)
    store.close()
    # The request without a valid key is counted, not a row of its own.
    assert sorted(r["status"] for r in rows) == sorted(str(s) for s in statuses if s != 401)
    assert [(r["source"], r["status"], r["count"]) for r in refusals] == [("127.0.0.1", "401", 1)]
    by_status = {r["status"]: r for r in rows}
    ok = next(r for r in rows if r["status"] == "200" and r["key_name"] == "full")
    assert ok["policy"] == "customer-reply"
    assert ok["mode"] == "lossless"
    assert ok["front_door"] == "server"
    assert ok["completion_tokens"] == 3
    assert ok["tenant"] == "full"
    assert ok["model"] == "tiny"
    assert by_status["413"]["key_name"] == "full"  # refused before its key was read: still its
    assert by_status["404"]["key_name"] == "customer"
    assert by_status["404"]["policy"] is None  # refused before the key was allowed it
    assert by_status["429"]["key_name"] == "limited"
    for row in rows:  # names only, never a key or a word of the prompt
        for value in row.values():
            for secret in (*KEYS.values(), "zebra-quartz-7741", "Where is my order"):
                assert secret not in str(value)
    # The runtime did not record the server's calls a second time.
    assert len([r for r in rows if r["front_door"] == "sdk"]) == 0


def _refusals(store: AuditStore) -> list[dict]:
    with store.engine.connect() as connection:
        return [dict(r._mapping) for r in connection.execute(select(REFUSALS))]


def test_a_flood_without_a_key_is_counted_and_never_crowds_out_honest_rows(
    runtime, key_file, tmp_path
) -> None:
    """Requests with a wrong key write no row each: the store grows by a bounded number of
    rows whatever their number, the buffer honest rows wait in stays free (no 503 under
    ``--audit-required``), and every honest call is stored exactly once."""
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.sqlite'}", buffer_rows=50)
    keys = KeyStore.load(key_file, env="")
    app = create_app(runtime, keys, ServerOptions(audit=store, audit_required=True))
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    honest = []
    with serving(app) as url, httpx.Client(timeout=60) as http:
        for i in range(400):
            wrong = http.post(
                f"{url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer wrong-key-{i:04d}-0123456789"},
            )
            assert wrong.status_code == 401
            if i % 40 == 0:
                honest.append(_post(url, KEYS["customer"], body))
    assert [r.status_code for r in honest] == [200] * 10
    assert store.flush()
    rows = read_calls(store.engine, limit=None)
    refusals = _refusals(store)
    store.close()
    assert sorted(r["key_name"] for r in rows) == ["customer"] * 10
    assert len({r["id"] for r in rows}) == 10
    assert sum(r["count"] for r in refusals) == 400
    assert len(refusals) <= 3  # one per minute (the run may cross a minute or two)


def test_an_open_server_answers_only_its_own_host_names(runtime, tmp_path) -> None:
    """Without keys, a DNS name rebound to the loopback must not reach the server."""
    options = ServerOptions(allowed_hosts=("localhost", "127.0.0.1"))
    app = create_app(runtime, KeyStore(open=True), options)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
    with serving(app) as url:
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
        rebound = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers={"Host": "attacker.example"}
        )
        assert rebound.status_code == 400


def test_audit_required_refuses_calls_while_the_store_cannot_record(
    runtime, key_file, tmp_path
) -> None:
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.sqlite'}", buffer_rows=1)
    keys = KeyStore.load(key_file, env="")
    app = create_app(runtime, keys, ServerOptions(audit=store, audit_required=True))
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    with serving(app) as url:
        assert _post(url, KEYS["full"], body).status_code == 200
        # The database is locked by another writer: the store cannot write, rows pile up.
        blocker = store.engine.raw_connection()
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            deadline = time.monotonic() + 60
            while store.healthy and time.monotonic() < deadline:
                _post(url, KEYS["full"], body)
                time.sleep(0.2)
            refused = _post(url, KEYS["full"], body)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "audit_unavailable"
        finally:
            blocker.rollback()
            blocker.close()
        assert store.flush(60)
        assert _post(url, KEYS["full"], body).status_code == 200
    store.close()


@pytest.mark.slow  # a server process
def test_serve_speaks_https_with_its_certificate(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1", "localhost")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    certificate.private_key_and_cert_chain_pem.write_to_path(str(cert))
    certificate.private_key_pem.write_to_path(str(key))
    ca = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(ca))
    model_dir = tmp_path / "tiny"
    make_model(len(make_tokenizer()), seed=4).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)

    port = free_port()
    env = {
        "SPECAGENT_API_KEYS": f"tls={KEYS['full']}",
        "SPECAGENT_CACHE": str(tmp_path / "cache"),
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "PATH": "/usr/bin:/bin",
    }
    import os

    env = {**os.environ, **env}
    log = (tmp_path / "server.log").open("w")
    command = [
        sys.executable, "-m", "specagent.cli", "serve", "--target", str(model_dir),
        "--port", str(port), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    context = ssl.create_default_context(cafile=str(ca))
    url = f"https://127.0.0.1:{port}"
    try:
        wait_until_up(process, url, tmp_path / "server.log", verify=context)
        with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # no plain HTTP
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with httpx.Client(verify=context) as http:
            client = openai.OpenAI(
                base_url=f"{url}/v1", api_key=KEYS["full"], max_retries=0, http_client=http
            )
            reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
            client.close()
        assert reply.usage.completion_tokens == 3
        server_log = (tmp_path / "server.log").read_text()
        assert f"serving tiny on https://127.0.0.1:{port}" in server_log
        assert "audit store: AuditStore('sqlite:///" in server_log  # the default, named
        assert (tmp_path / "data" / "specagent" / "audit.sqlite").is_file()
    finally:
        process.terminate()
        process.wait(60)
        log.close()
