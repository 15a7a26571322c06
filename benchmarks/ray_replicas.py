"""Calls per second on Ray Serve with 1 and 2 replicas, each held to one CPU core.

    python benchmarks/ray_replicas.py                # tiny random model, Qwen2.5-Coder tokenizer
    python benchmarks/ray_replicas.py --clients 16 --calls 96

A local Ray instance (this machine's cores), the app of ``specagent.server.ray_app`` with one
and then two replicas (``cpus_per_replica=1``: one torch thread each), the same greedy calls from
``--clients`` concurrent HTTP clients (distinct conversations, so prefix affinity spreads them);
every response is checked against the same call on one in-process runtime. Writes
``benchmarks/results/ray-replicas_tiny_<machine kind>.json`` with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
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
from specagent.server import hash_key

KEY = "bench-key-0123456789abcdefghij"


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Conversation {i}: where is order A-{10000 + i}?"}]


async def load(url: str, clients: int, calls: int, tokens: int) -> tuple[float, dict[int, str]]:
    texts: dict[int, str] = {}
    queue = list(range(calls))
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300, limits=limits
    ) as client:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                body = {
                    "model": "tiny",
                    "messages": messages(i),
                    "max_tokens": tokens,
                    "temperature": 0,
                }
                response = await client.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                texts[i] = response.json()["choices"][0]["message"]["content"]

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in range(clients):
                group.start_soon(worker)
        return time.perf_counter() - start, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients")
    parser.add_argument("--calls", type=int, default=64, help="calls per round")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens per call")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per replica count")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from specagent.server.ray_app import build_app

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.tokenizer))
    report: dict[str, Any] = {
        "model": f"tiny-llama-4x128 ({args.tokenizer} tokenizer), float32",
        "machine": machine_info(),
        "clients": args.clients,
        "calls": args.calls,
        "max_tokens": args.tokens,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        tiny_model(tokenizer).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        key_file = Path(tmp) / "keys.yaml"
        key_file.write_text(f"keys:\n  - name: bench\n    sha256: {hash_key(KEY)}\n")
        alone = SpecRuntime.from_pretrained(
            str(model_dir),
            policies=shipped_policies(),
            dtype="float32",
            options=RuntimeOptions(probe_store=None),
        )
        expected = {
            i: alone.generate_sync(messages(i), max_new_tokens=args.tokens, temperature=0).text
            for i in range(args.calls)
        }
        alone.close()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            for replicas in (1, 2):
                app = build_app(
                    str(model_dir),
                    replicas=replicas,
                    cpus_per_replica=1.0,
                    key_file=str(key_file),
                    runtime_options={"dtype": "float32"},
                )
                serve.run(app, name="specagent", route_prefix="/")
                url = f"http://127.0.0.1:{port}"
                anyio.run(load, url, args.clients, min(args.calls, 8), args.tokens)  # warm-up
                seconds, equal = [], 0
                for _ in range(args.rounds):
                    wall, texts = anyio.run(load, url, args.clients, args.calls, args.tokens)
                    seconds.append(wall)
                    equal += sum(texts[i] == expected[i] for i in range(args.calls))
                median = statistics.median(seconds)
                report["runs"][str(replicas)] = {
                    "calls_per_s": args.calls / median,
                    "rounds_s": seconds,
                    "equal_to_one_runtime": f"{equal}/{args.calls * args.rounds}",
                }
                print(replicas, json.dumps(report["runs"][str(replicas)]), flush=True)
                serve.delete("specagent")
        finally:
            serve.shutdown()
            ray.shutdown()
    one, two = report["runs"]["1"]["calls_per_s"], report["runs"]["2"]["calls_per_s"]
    report["speedup_2_over_1"] = two / one
    print(f"2 replicas / 1 replica: {two / one:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ray-replicas_tiny_{machine_kind()}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
