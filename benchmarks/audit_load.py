"""What the audit store costs a server under load, whether it loses or doubles a row, and
whether any call's text reaches it.

    python benchmarks/audit_load.py                    # tiny random model, Qwen2.5-Coder tokenizer
    python benchmarks/audit_load.py --clients 64 --rounds 8

1. Cost: rounds of ``--clients`` concurrent streams against servers with the audit store on
   (SQLite, then PostgreSQL: a server started here from Debian's binaries) and one started with
   ``--no-audit``, in ABBA order; the medians of the rounds' wall times and their ratio.
2. Every call once: after the rounds, the store holds exactly one row per call each audited
   server answered (200s counted by the client against the rows).
3. An outage: PostgreSQL is stopped in the middle of a round and started again; no call fails,
   and every call of the round is in the store once it is back.
4. No text: the database files (SQLite's, PostgreSQL's data directory) are searched for every
   prompt's and every output's text.

Writes ``benchmarks/results/audit-load_tiny_<machine kind>.json`` with the machine it ran on,
and (``--chart``) the SQLite store it made, for charting (``docs/audit.md``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "audit"))

from pg_server import PostgresServer
from runtime_load import tiny_model
from server_load import messages, start_server, streams

from specagent.audit import AuditStore, read_calls
from specagent.catalog import resolve_model
from specagent.machine import machine_info, machine_kind


async def rounds_abba(
    urls: dict[str, str], model: str, clients: int, tokens: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, int], list[str]]:
    """Each server's round walls (ABBA over the servers' order), the 200s each answered and
    every output text."""
    walls: dict[str, list[float]] = {name: [] for name in urls}
    answered = dict.fromkeys(urls, 0)
    outputs: list[str] = []
    names = list(urls)
    for r in range(rounds):
        order = names if r % 4 in (0, 3) else list(reversed(names))
        policy = POLICIES[r % len(POLICIES)]  # every server gets the same rounds
        for name in order:
            wall, _, _, texts = await streams(urls[name], f"{model}:{policy}", clients, tokens)
            assert len(texts) == clients, f"{name}: {len(texts)} of {clients} calls answered"
            walls[name].append(wall)
            answered[name] += len(texts)
            outputs.extend(texts.values())
    return walls, answered, outputs


async def outage_round(
    url: str, model: str, clients: int, tokens: int, postgres: PostgresServer
) -> dict[str, Any]:
    """A round during which PostgreSQL stops and starts again."""
    result: dict[str, Any] = {}

    async def calls() -> None:
        wall, _, _, texts = await streams(url, model, clients, tokens)
        result.update(wall_s=round(wall, 3), answered=len(texts), texts=list(texts.values()))

    async with anyio.create_task_group() as group:
        group.start_soon(calls)
        await anyio.sleep(0.3)
        await anyio.to_thread.run_sync(postgres.stop)
        await anyio.sleep(2.0)
        await anyio.to_thread.run_sync(postgres.start)
    return result


POLICIES = ("customer-reply", "internal-summary", "meeting-notes", "code-assist")
"""The shipped policies the rounds take in turn (lossless and relaxed: the store's per-minute
view then has something to chart per policy)."""


def text_found(paths: list[Path], texts: list[str]) -> list[str]:
    """Which of ``texts`` (each at least 12 characters) occur in any file under ``paths``."""
    wanted = {t.encode() for t in texts if len(t) >= 12}
    found: set[bytes] = set()
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            data = path.read_bytes()
            found.update(t for t in wanted if t in data)
    return sorted(t.decode() for t in found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=8, help="ABBA rounds (a multiple of 4)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--chart", type=Path, help="keep the SQLite store here, for charting")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.tokenizer))
    pg_folder = Path(tempfile.mkdtemp(prefix="specagent-pg-"))
    postgres = PostgresServer(pg_folder)
    servers = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / "tiny"
            tiny_model(tokenizer).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            sqlite_file = Path(tmp) / "audit.sqlite"
            setups = {
                "none": ("--no-audit",),
                "sqlite": ("--audit", f"sqlite:///{sqlite_file}"),
                "postgresql": ("--audit", postgres.url),
            }
            urls = {}
            for name, extra in setups.items():
                url, process = start_server(model_dir, Path(tmp) / name, extra=extra)
                urls[name], servers = url, [*servers, process]
            model = "tiny"
            walls, answered, outputs = anyio.run(
                rounds_abba, urls, model, args.clients, args.tokens, args.rounds
            )
            outage = anyio.run(
                outage_round, urls["postgresql"], model, args.clients, args.tokens, postgres
            )
            for process in servers:  # drained and closed: what the stores held is written
                process.send_signal(signal.SIGTERM)
                process.wait(120)
            servers = []
            rows = {
                "sqlite": read_calls(AuditStore(f"sqlite:///{sqlite_file}").engine, limit=None),
                "postgresql": read_calls(AuditStore(postgres.url).engine, limit=None),
            }
            prompts = [messages(i)[0]["content"] for i in range(args.clients)]
            leaked = text_found(
                [*Path(tmp).glob("audit.sqlite*"), postgres.data], [*prompts, *outputs]
            )
            if args.chart:
                args.chart.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(sqlite_file, args.chart)
    finally:
        for process in servers:
            process.kill()
        postgres.stop()
        shutil.rmtree(pg_folder, ignore_errors=True)
    ok = {name: sum(1 for r in found if r["status"] == "200") for name, found in rows.items()}
    ids = {name: len({r["id"] for r in found}) == len(found) for name, found in rows.items()}
    base = statistics.median(walls["none"])
    report = {
        "model": f"tiny-llama-4x128 ({args.tokenizer} tokenizer), float32",
        "machine": machine_info(),
        "clients": args.clients,
        "max_tokens": args.tokens,
        "rounds": args.rounds,
        "wall_s": {
            name: {
                "median": round(statistics.median(w), 3),
                "ratio_to_none": round(statistics.median(w) / base, 4),
                "rounds": [round(x, 3) for x in w],
            }
            for name, w in walls.items()
        },
        "calls_answered": answered,
        "outage_round": {k: v for k, v in outage.items() if k != "texts"},
        "rows_with_status_200": ok,
        "every_call_once": {
            "sqlite": ok["sqlite"] == answered["sqlite"] and ids["sqlite"],
            "postgresql": ok["postgresql"] == answered["postgresql"] + outage["answered"]
            and ids["postgresql"],
        },
        "text_found_in_database_files": leaked,
    }
    print(json.dumps(report, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"audit-load_tiny_{machine_kind()}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
