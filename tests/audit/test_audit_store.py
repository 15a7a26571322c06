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
    masked,
    masked_url,
    policy_summaries,
    read_calls,
)
from specagent.audit import store as store_module
from specagent.audit.schema import REFUSALS, VERSION, migrate

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


def test_a_version_2_store_gains_the_endpoint_column_and_keeps_its_rows(sqlite_url) -> None:
    AuditStore(sqlite_url).close()
    engine = create_engine(sqlite_url)
    with engine.begin() as connection:  # the store as version 2 made it: no endpoint column
        connection.execute(text("ALTER TABLE specagent_calls DROP COLUMN endpoint"))
        connection.execute(VERSION.delete())
        connection.execute(VERSION.insert().values(version=2))
        old = {k: v for k, v in _row(policy="old").items() if k != "endpoint"}
        connection.execute(CALLS.insert().values(**old))
    assert migrate(engine) == 2
    with engine.begin() as connection:
        connection.execute(CALLS.insert().values(**_row(policy="new", endpoint="responses")))
    rows = {r["policy"]: r for r in read_calls(engine, limit=None)}
    assert rows["old"]["endpoint"] is None
    assert rows["new"]["endpoint"] == "responses"
    assert migrate(engine) == SCHEMA_VERSION


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


def _refusals(store: AuditStore) -> list[dict]:
    with store.engine.connect() as connection:
        return [dict(r._mapping) for r in connection.execute(select(REFUSALS))]


def test_refusals_without_a_key_are_counted_not_stored_one_by_one(sqlite_url) -> None:
    """Whoever has no key adds at most a bounded number of rows a minute (one per address
    and status, ``refusal_sources`` addresses at most, the rest as ``other``), however many
    requests it sends; every one of them is counted."""
    store = AuditStore(sqlite_url, refusal_sources=3)
    for i in range(10):
        for _ in range(50):
            store.count_refusal(f"10.0.0.{i}", 401, front_door="server")
    for _ in range(500):
        store.count_refusal("10.0.0.0", 401, front_door="server")
    store.count_refusal("10.0.0.1", 413, front_door="server")
    assert store.flush()
    rows = _refusals(store)
    store.close()
    assert sum(r["count"] for r in rows) == 1001
    assert len(rows) <= 5  # 3 addresses + other for 401, one for 413 (within one minute or two)
    by_source = {}
    for row in rows:
        by_source[(row["source"], row["status"])] = (
            by_source.get((row["source"], row["status"]), 0) + row["count"]
        )
    assert by_source[("10.0.0.0", "401")] == 550
    assert by_source[("other", "401")] == 350  # 10.0.0.3 to 10.0.0.9
    assert read_calls(create_engine(sqlite_url), limit=None) == []


def test_retention_runs_on_a_timer_whatever_the_traffic(sqlite_url, monkeypatch) -> None:
    """Under steady traffic the writer is never idle: retention must not wait for a lull."""
    monkeypatch.setattr(store_module, "RETENTION_EVERY_S", 0.2)
    store = AuditStore(sqlite_url, retention_days=30, batch_rows=1, flush_s=0.0)
    old = _row("old")
    old["at"] = datetime.now(timezone.utc) - timedelta(days=40)
    old["minute"] = old["at"].replace(second=0, microsecond=0)
    with store.engine.begin() as connection:
        connection.execute(insert(CALLS), [old])
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            for _ in range(20):  # rows always waiting: the writer never finds an empty pass
                store.record(_row("busy"))
            policies = {r["policy"] for r in read_calls(store.engine, limit=None)}
            if "old" not in policies:
                break
            time.sleep(0.05)
        assert "old" not in policies
    finally:
        store.close()


def test_a_table_over_max_rows_loses_its_oldest_rows_and_counts_them(sqlite_url) -> None:
    store = AuditStore(sqlite_url, max_rows=100)
    ids = []
    for i in range(300):
        row = _row("sized")
        row["at"] = datetime.now(timezone.utc) - timedelta(seconds=300 - i)
        ids.append(row["id"])
        store.record(row)
    assert store.flush()
    deadline = time.monotonic() + 30
    while len(read_calls(store.engine, limit=None)) > 100 and time.monotonic() < deadline:
        time.sleep(0.1)
    kept = {r["id"] for r in read_calls(store.engine, limit=None)}
    store.close()
    assert 0 < len(kept) <= 100
    assert kept == set(ids[-len(kept) :])  # the newest stay
    assert store.evicted == 300 - len(kept)


def test_the_store_and_its_folder_are_readable_by_their_owner_only(tmp_path) -> None:
    folder = tmp_path / "new" / "specagent"
    store = AuditStore(f"sqlite:///{folder / 'audit.sqlite'}")
    store.record(_row())
    assert store.flush()
    assert folder.stat().st_mode & 0o777 == 0o700
    files = list(folder.glob("audit.sqlite*"))
    assert len(files) >= 2  # the database and its write-ahead log
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o600, path.name
    store.close()


@pytest.mark.parametrize("days", [0, -1])
def test_a_retention_of_nothing_is_refused(sqlite_url, days) -> None:
    with pytest.raises(ValueError, match="retention_days must be more than 0"):
        AuditStore(sqlite_url, retention_days=days)


def test_closing_with_the_database_locked_says_what_is_lost(sqlite_url, caplog) -> None:
    store = AuditStore(sqlite_url, max_retry_s=0.2)
    blocker = store.engine.raw_connection()
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        for _ in range(5):
            store.record(_row("locked"))
        with caplog.at_level("ERROR", logger="specagent.audit"):
            store.close(timeout=1.0)
    finally:
        blocker.rollback()
        blocker.close()
    assert store.dropped == 5
    assert "closed with 5 rows unwritten" in caplog.text


def test_text_cells_are_printable_and_fit_their_columns() -> None:
    row = call_row(front_door="server", status=200, tenant="k/\x00\x1b[31mred" + "x" * 900)
    assert "\x00" not in row["tenant"]
    assert "\x1b" not in row["tenant"]
    assert row["tenant"].startswith("k/\\x00\\x1b[31mred")
    assert len(row["tenant"]) == 600


def test_passwords_are_masked_in_messages() -> None:
    url = "postgresql://audit:s3cr3t-pw@db.internal:5432/audit"
    assert "s3cr3t-pw" not in masked_url(url)
    assert "***" in masked_url(url)
    assert masked("could not connect with s3cr3t-pw", url) == "could not connect with ***"


def test_one_bad_row_costs_only_itself_and_the_store_says_so(postgres, caplog) -> None:
    """PostgreSQL refuses a NUL: the batch is written again row by row, only that row is
    dropped (counted, logged by id, never by value), and the store is unhealthy until a write
    goes through."""
    store = AuditStore(postgres.url, flush_s=5.0)
    good = [_row("batch", tenant=f"other/user-{i}") for i in range(10)]
    bad = _row("batch", tenant="k/\x00")
    with caplog.at_level("ERROR", logger="specagent.audit"):
        for row in [*good[:5], bad, *good[5:]]:
            store.record(row)
        assert store.flush(60)
    stored = {r["id"] for r in read_calls(store.engine, policy="batch", limit=None)}
    assert stored == {r["id"] for r in good}
    assert store.dropped == store.rejected == 1
    assert bad["id"] in caplog.text
    assert "user-" not in caplog.text  # no other row's values in the log
    assert store.healthy  # a write went through after the refused row
    store.record(bad)  # alone: nothing goes through, the store says it is not storing
    store.flush(60)
    assert not store.healthy
    store.record(_row("batch"))
    assert store.flush(60)
    assert store.healthy
    store.close()
