"""The audit store on real databases (SQLite, and a PostgreSQL server started here): its schema
and version, one row per call however the call ended, never a prompt or an output, rows kept
through an outage and written when the database returns (or counted when the buffer is full),
exactly once, retention, and the per-minute view a BI tool reads."""

from __future__ import annotations

import shutil
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import anyio
import pytest
from pg_server import PostgresServer, postgres_binaries
from sqlalchemy import create_engine, insert, select, text

from specagent import CallTimeoutError, PolicyNotFoundError, SpecRuntime
from specagent.audit import (
    CALLS,
    MINUTES_VIEW,
    SCHEMA_VERSION,
    AuditStore,
    call_row,
    policy_summaries,
    read_calls,
)
from specagent.audit.schema import VERSION, migrate

SECRET = "zebra-quartz-7741"
"""Text that must never reach the database."""


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'audit.sqlite'}"


@pytest.fixture(scope="module")
def postgres():
    if postgres_binaries() is None:
        pytest.skip("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
    folder = Path(tempfile.mkdtemp(prefix="specagent-pg-"))
    server = PostgresServer(folder)
    yield server
    try:
        server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _row(policy: str = "p", status: str = "ok", **extra) -> dict:
    return {**call_row(front_door="sdk", status=status, policy=policy, key_name="k"), **extra}


def test_the_schema_is_created_versioned_and_refused_when_newer(sqlite_url) -> None:
    store = AuditStore(sqlite_url)
    store.close()
    engine = create_engine(sqlite_url)
    with engine.begin() as connection:
        assert connection.execute(select(VERSION.c.version)).scalar() == SCHEMA_VERSION
        views = connection.execute(text("SELECT name FROM sqlite_master WHERE type='view'"))
        assert MINUTES_VIEW in {row[0] for row in views}
    assert migrate(engine) == SCHEMA_VERSION  # reopening migrates nothing
    with engine.begin() as connection:
        connection.execute(VERSION.delete())
        connection.execute(VERSION.insert().values(version=SCHEMA_VERSION + 1))
    with pytest.raises(RuntimeError, match="newer than this specagent"):
        AuditStore(sqlite_url)


def test_sdk_calls_are_recorded_however_they_end_and_never_their_text(
    target, tokenizer, sqlite_url, tmp_path
) -> None:
    target.generation_config.eos_token_id = None
    rt = SpecRuntime(target, tokenizer=tokenizer, audit=sqlite_url, model_name="tiny")
    messages = [{"role": "user", "content": f"My secret is {SECRET}."}]

    async def calls() -> None:
        await rt.generate(messages, max_new_tokens=4, tenant="acme")
        with pytest.raises(PolicyNotFoundError):
            await rt.generate(messages, policy="nope", tenant="acme")
        with pytest.raises(CallTimeoutError):
            await rt.generate(messages, max_new_tokens=400, timeout=0.05, tenant="acme")
        with anyio.move_on_after(0.05):
            await rt.generate(messages, max_new_tokens=400, tenant="acme")

    try:
        anyio.run(calls)
        assert rt.audit is not None
        assert rt.audit.flush()
        rows = read_calls(rt.audit.engine, limit=None)
    finally:
        rt.close()
        target.generation_config.eos_token_id = None
    statuses = sorted(row["status"] for row in rows)
    assert statuses == ["CallTimeoutError", "PolicyNotFoundError", "cancelled", "ok"]
    ok = next(row for row in rows if row["status"] == "ok")
    assert ok["tenant"] == "acme"
    assert ok["completion_tokens"] == 4
    assert ok["prompt_tokens"] > 0
    assert ok["model"] == "tiny"
    assert ok["engine"] == "transformers"
    assert ok["front_door"] == "sdk"
    assert ok["latency_ms"] > 0
    refused = next(row for row in rows if row["status"] == "PolicyNotFoundError")
    assert refused["policy"] is None  # refused before a policy was known
    assert all(row["key_name"] is None for row in rows)
    # Nowhere in the database's files: not the secret, not a word of the prompt.
    for path in tmp_path.glob("audit.sqlite*"):
        data = path.read_bytes()
        assert SECRET.encode() not in data
        assert b"My secret" not in data


def test_the_same_row_is_stored_once(sqlite_url) -> None:
    store = AuditStore(sqlite_url)
    row = _row()
    store.record(row)
    store.record(row)  # a batch retried after a commit whose answer was lost
    assert store.flush()
    assert len(read_calls(store.engine, limit=None)) == 1
    store.close()


def test_retention_deletes_old_rows(sqlite_url) -> None:
    store = AuditStore(sqlite_url, retention_days=30)
    old = _row()
    old["at"] = datetime.now(timezone.utc) - timedelta(days=40)
    old["minute"] = old["at"].replace(second=0, microsecond=0)
    with store.engine.begin() as connection:
        connection.execute(insert(CALLS), [old, _row()])
    store._last_retention = 0.0
    store._retention()
    assert len(read_calls(store.engine, limit=None)) == 1
    store.close()


def test_the_minute_view_and_the_summaries_agree(sqlite_url) -> None:
    store = AuditStore(sqlite_url)
    for i in range(20):
        store.record(_row("fast", latency_ms=float(10 + i), completion_tokens=10))
    store.record(_row("fast", status="422"))
    store.record(_row("relaxed", latency_ms=50.0, divergence=0.05, fell_back_to_lossless=True))
    assert store.flush()
    with store.engine.connect() as connection:
        view = {
            row.policy: row for row in connection.execute(text(f"SELECT * FROM {MINUTES_VIEW}"))
        }
    summary = {s["policy"]: s for s in policy_summaries(store.engine)}
    assert view["fast"].calls == summary["fast"]["calls"] == 21
    assert view["fast"].errors == summary["fast"]["errors"] == 1
    assert view["fast"].p50_latency_ms == summary["fast"]["p50_latency_ms"] == 19.0
    assert view["fast"].p95_latency_ms == summary["fast"]["p95_latency_ms"] == 28.0
    assert view["relaxed"].fallbacks == summary["relaxed"]["fallbacks"] == 1
    assert view["relaxed"].p95_divergence == pytest.approx(0.05)
    store.close()


def test_postgres_takes_the_same_schema_and_rows(postgres) -> None:
    store = AuditStore(postgres.url)
    for i in range(10):
        store.record(_row("pg", latency_ms=float(i + 1), completion_tokens=3))
    assert store.flush()
    with store.engine.connect() as connection:
        row = connection.execute(text(f"SELECT * FROM {MINUTES_VIEW} WHERE policy='pg'")).one()
    assert row.calls == 10
    assert row.p50_latency_ms == 5.0
    assert [s["calls"] for s in policy_summaries(store.engine, policy="pg")] == [10]
    store.close()


def test_rows_wait_through_an_outage_and_none_is_lost(postgres) -> None:
    store = AuditStore(postgres.url, max_retry_s=0.5)
    before = len(read_calls(store.engine, limit=None))
    postgres.stop()
    try:
        for _ in range(50):
            assert store.record(_row("outage"))
        deadline = time.monotonic() + 30
        while store.healthy and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not store.healthy  # the writer found the database gone
        assert store.buffered == 50
    finally:
        postgres.start()
    assert store.flush(60)
    assert store.healthy
    assert len(read_calls(store.engine, limit=None)) == before + 50
    store.close()


def test_rows_past_the_buffer_are_dropped_and_counted(postgres) -> None:
    store = AuditStore(postgres.url, buffer_rows=10, max_retry_s=0.5)
    postgres.stop()
    try:
        deadline = time.monotonic() + 30
        store.record(_row("full"))
        while store.healthy and time.monotonic() < deadline:
            time.sleep(0.1)
        kept = [store.record(_row("full")) for _ in range(20)]
    finally:
        postgres.start()
    assert kept.count(False) == store.dropped > 0
    assert store.flush(60)
    store.close()
