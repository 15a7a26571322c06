"""The HTTP server's cost and behaviour under load, side by side with the in-process runtime.

    python benchmarks/server_load.py              # tiny random model, Qwen2.5-Coder tokenizer
    python benchmarks/server_load.py --calls 100 --clients 64

1. Overhead: the same greedy calls (one token each by default, so the server's share shows)
   through ``runtime.generate`` in-process, through ``POST /v1/chat/completions`` and through
   ``POST /v1/responses`` (stored) on a localhost server (one keep-alive HTTP client),
   interleaved call by call; the median of the paired differences is what the server adds to a
   call, and what the Responses API adds beside chat completions.
2. Concurrency: ``--clients`` streaming clients at once (SSE), each client's time to first
   content chunk (p50/p95) and the wall time, and whether every response equals the same call
   alone (greedy). Only localhost traffic; every loop is bounded.
3. The dashboard's cost: rounds of ``--clients`` concurrent streams against two servers, one
   with ``/dashboard`` and a browser's poll of its data every second, one started with
   ``--no-dashboard``, alternating (ABBA); the medians of each round's wall time and mean call
   time, and their ratio (rounds differ by about 10% on a 2-core machine, so the ratio cannot
   resolve 1%); and the cost accounted directly: folding a call into the dashboard's log times
   the calls per second, plus one poll answered per second, as a share of a second.

Writes ``benchmarks/results/server-load_tiny_<machine kind>.json`` with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_load import tiny_model

from specagent import RuntimeOptions, SpecRuntime, shipped_policies
from specagent.catalog import resolve_model
from specagent.machine import machine_info, machine_kind
from specagent.server.dashboard import CallLog, CallRecord

KEY = "bench-key-0123456789abcdefghij"
TOPICS = ["order", "refund", "parcel", "invoice", "meeting", "summary", "code", "weather"]


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"A question about the {TOPICS[i % 8]}, number {i}."}]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_server(
    model_dir: Path,
    cache: Path,
    keys: str = f"bench={KEY}",
    extra: tuple[str, ...] = (),
    max_concurrent: int | None = 256,
) -> tuple[str, subprocess.Popen]:
    """``specagent serve`` in its own process, as it is deployed (a client in the same process
    would share the GIL with it and measure thread hand-offs, not the server). One key stands
    for many clients here: by default it may hold every slot (``max_concurrent``; None: the
    server's default, a quarter of the slots per key)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "SPECAGENT_API_KEYS": keys,
        "SPECAGENT_CACHE": str(cache),
        "XDG_DATA_HOME": str(cache),  # its default audit store, if it keeps one
    }
    command = [sys.executable, "-m", "specagent.cli", "serve", "--target", str(model_dir)]
    process = subprocess.Popen(
        [
            *command,
            "--port",
            str(port),
            "--dtype",
            "float32",
            *(("--max-concurrent", str(max_concurrent)) if max_concurrent else ()),
            *extra,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return url, process
        except httpx.TransportError:
            pass
        time.sleep(0.2)


async def overhead(runtime: SpecRuntime, url: str, calls: int, tokens: int) -> dict[str, Any]:
    """The same call in-process and through chat completions, and a call of the same form
    through the Responses API (stored, as by default), interleaved call by call; the medians of
    the paired differences."""
    headers = {"Authorization": f"Bearer {KEY}"}
    local, chat, responses = [], [], []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        for i in range(calls + 3):
            # Its own prompt for each endpoint: a prompt the server saw a moment before would
            # come from its prefix cache.
            prompt, other = messages(2 * i), messages(2 * i + 1)
            start = time.perf_counter()
            result = await runtime.generate(prompt, max_new_tokens=tokens, temperature=0)
            local_s = time.perf_counter() - start
            start = time.perf_counter()
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "model": runtime.model_name,
                    "messages": prompt,
                    "max_tokens": tokens,
                    "temperature": 0,
                },
            )
            chat_s = time.perf_counter() - start
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == result.text
            expected = await runtime.generate(other, max_new_tokens=tokens, temperature=0)
            start = time.perf_counter()
            response = await client.post(
                "/v1/responses",
                json={
                    "model": runtime.model_name,
                    "input": other,
                    "max_output_tokens": tokens,
                    "temperature": 0,
                },
            )
            responses_s = time.perf_counter() - start
            assert response.status_code == 200, response.text
            assert response.json()["output"][0]["content"][0]["text"] == expected.text
            if i >= 3:  # the first calls warm every path up
                local.append(local_s)
                chat.append(chat_s)
                responses.append(responses_s)
    paired = [r - loc for r, loc in zip(chat, local, strict=True)]
    translated = [r - c for r, c in zip(responses, chat, strict=True)]
    return {
        "calls": calls,
        "max_tokens": tokens,
        "in_process_median_ms": 1000 * statistics.median(local),
        "http_median_ms": 1000 * statistics.median(chat),
        "overhead_median_ms": 1000 * statistics.median(paired),
        "overhead_p95_ms": 1000 * percentile(paired, 0.95),
        "responses_http_median_ms": 1000 * statistics.median(responses),
        "responses_minus_chat_median_ms": 1000 * statistics.median(translated),
        "responses_minus_chat_p95_ms": 1000 * percentile(translated, 0.95),
    }


async def streams(
    url: str, model: str, clients: int, tokens: int
) -> tuple[float, dict[int, float], dict[int, float], dict[int, str]]:
    """``clients`` streaming calls at once: the wall time, and per call its time to the first
    content chunk, its whole time and its text."""
    ttft: dict[int, float] = {}
    took: dict[int, float] = {}
    texts: dict[int, str] = {}
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120, limits=limits
    ) as client:

        async def one(i: int) -> None:
            body = {
                "model": model,
                "messages": messages(i),
                "max_tokens": tokens,
                "temperature": 0,
                "stream": True,
            }
            start = time.perf_counter()
            parts: list[str] = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:])["choices"]
                    text = choices[0]["delta"].get("content") if choices else None
                    if text and i not in ttft:
                        ttft[i] = time.perf_counter() - start
                    parts.append(text or "")
            took[i] = time.perf_counter() - start
            texts[i] = "".join(parts)

        start = time.perf_counter()
        with anyio.fail_after(600):
            async with anyio.create_task_group() as group:
                for i in range(clients):
                    group.start_soon(one, i)
        wall = time.perf_counter() - start
    return wall, ttft, took, texts


async def concurrent_streams(
    runtime: SpecRuntime, url: str, clients: int, tokens: int
) -> dict[str, Any]:
    alone = [
        (await runtime.generate(messages(i), max_new_tokens=tokens, temperature=0)).text
        for i in range(clients)
    ]
    wall, ttft, _, texts = await streams(url, runtime.model_name, clients, tokens)
    values = list(ttft.values())
    return {
        "clients": clients,
        "max_tokens": tokens,
        "wall_s": wall,
        "ttft_p50_ms": 1000 * statistics.median(values),
        "ttft_p95_ms": 1000 * percentile(values, 0.95),
        "complete": len(texts) == clients,
        "equal_to_alone": sum(texts.get(i) == alone[i] for i in range(clients)),
        "server_ready_after": httpx.get(f"{url}/ready", timeout=5).json(),
    }


async def dashboard_cost(
    model: str, with_page: str, without: str, clients: int, tokens: int, rounds: int
) -> dict[str, Any]:
    """Rounds of concurrent streams on the server with the dashboard (its data polled every
    second, as an open page does) and on the one without, in ABBA order."""
    walls: dict[str, list[float]] = {"dashboard": [], "none": []}
    calls: dict[str, list[float]] = {"dashboard": [], "none": []}
    page_ms: list[float] = []  # the page and its first data, as a browser opening it
    data_ms: list[float] = []  # each later poll

    async def poll(stop: anyio.Event) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=with_page, headers=headers, timeout=30) as client:
            start = time.perf_counter()
            assert (await client.get("/dashboard")).status_code == 200
            first = True
            while not stop.is_set():
                asked = time.perf_counter()
                response = await client.get("/dashboard/data", params={"window": "5m"})
                assert response.status_code == 200, response.text
                now = time.perf_counter()
                if first:
                    page_ms.append(1000 * (now - start))
                    first = False
                else:
                    data_ms.append(1000 * (now - asked))
                with anyio.move_on_after(1.0):
                    await stop.wait()

    for r in range(rounds):
        for which in ("dashboard", "none") if r % 4 in (0, 3) else ("none", "dashboard"):
            stop = anyio.Event()
            async with anyio.create_task_group() as group:
                if which == "dashboard":
                    group.start_soon(poll, stop)
                url = with_page if which == "dashboard" else without
                wall, _, took, texts = await streams(url, model, clients, tokens)
                stop.set()
            assert len(texts) == clients
            walls[which].append(wall)
            calls[which].append(statistics.mean(took.values()))
    wall_on, wall_off = statistics.median(walls["dashboard"]), statistics.median(walls["none"])
    # What the dashboard adds, accounted: each call folded into the log, each poll answered.
    log, done = CallLog(), CallRecord("p", 200, latency_s=1.0, ttft_s=0.1, output_tokens=64)
    start = time.perf_counter()
    for _ in range(20_000):
        log.record(done)
    record_s = (time.perf_counter() - start) / 20_000
    poll_s = statistics.median(data_ms) / 1000 if data_ms else 0.0
    accounted = (clients / wall_on) * record_s + poll_s  # per second of serving, one poll a second
    call_on, call_off = statistics.median(calls["dashboard"]), statistics.median(calls["none"])
    return {
        "clients": clients,
        "max_tokens": tokens,
        "rounds": rounds,
        "page_load_ms_under_load": {"p50": statistics.median(page_ms), "max": max(page_ms)},
        "data_poll_ms_under_load": {
            "p50": statistics.median(data_ms) if data_ms else None,
            "max": max(data_ms, default=None),
            "polls": len(data_ms),
        },
        "record_us": 1e6 * record_s,
        "accounted_share_of_a_second": accounted,
        "wall_s": {"dashboard": wall_on, "none": wall_off, "ratio": wall_on / wall_off},
        "mean_call_s": {"dashboard": call_on, "none": call_off, "ratio": call_on / call_off},
        "rounds_wall_s": walls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer",
        default="qwen2.5-coder-0.5b-instruct",
        help="catalog name or path of the tokenizer the tiny model uses",
    )
    parser.add_argument("--calls", type=int, default=60, help="calls per path for the overhead")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument(
        "--tokens", type=int, default=16, help="max_tokens per call of the concurrent streams"
    )
    parser.add_argument(
        "--overhead-tokens",
        type=int,
        default=1,
        help="max_tokens per call when measuring overhead (short: the server's share shows)",
    )
    parser.add_argument(
        "--dashboard-rounds",
        type=int,
        default=12,
        help="rounds per server for the dashboard's cost (0: leave it out)",
    )
    parser.add_argument(
        "--dashboard-tokens",
        type=int,
        default=64,
        help="max_tokens per call in the dashboard's rounds (longer rounds: a finer ratio)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.tokenizer))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        tiny_model(tokenizer).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        # the same weights in this process, as the in-process baseline
        runtime = SpecRuntime.from_pretrained(
            str(model_dir),
            policies=shipped_policies(),
            dtype="float32",  # as the server is started: same weights, dtype, prefix cache
            options=RuntimeOptions(probe_store=None),
        )
        runtime.wait_measured()
        url, server = start_server(model_dir, Path(tmp))
        try:
            report: dict[str, Any] = {
                "model": f"tiny-llama-4x128 ({args.tokenizer} tokenizer), float32",
                "machine": machine_info(),
                "server": "specagent serve in its own process, localhost",
                "overhead": anyio.run(overhead, runtime, url, args.calls, args.overhead_tokens),
            }
            print(json.dumps(report["overhead"], indent=1), flush=True)
            report["concurrency"] = anyio.run(
                concurrent_streams, runtime, url, args.clients, args.tokens
            )
            print(json.dumps(report["concurrency"], indent=1), flush=True)
            if args.dashboard_rounds:
                bare, bare_server = start_server(model_dir, Path(tmp), extra=("--no-dashboard",))
                try:
                    report["dashboard"] = anyio.run(
                        dashboard_cost,
                        runtime.model_name,
                        url,
                        bare,
                        args.clients,
                        args.dashboard_tokens,
                        args.dashboard_rounds,
                    )
                finally:
                    bare_server.send_signal(signal.SIGTERM)
                    bare_server.wait(60)
                print(json.dumps(report["dashboard"], indent=1), flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
            runtime.close()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"server-load_tiny_{machine_kind()}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
