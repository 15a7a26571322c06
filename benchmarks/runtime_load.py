"""Runtime under load: time to first token with and without prefix reuse, and throughput and
latency against concurrency. Writes JSON and a PNG to benchmarks/results/.

    python benchmarks/runtime_load.py                       # SmolLM2-135M from the package index
    python benchmarks/runtime_load.py --tiny                # a tiny random model, same tokenizer
    python benchmarks/runtime_load.py --target PATH --concurrency 1 4 16

Prefix reuse: an agent resends a ~1,000-token system prompt (instructions and tool schemas) with a
different question each turn; TTFT is measured on the same turns by a runtime with the prefix
cache and one without, in one process.

Concurrency: N greedy calls at once against the same calls one at a time, with continuous
batching (each step verifies every active call in one batched target forward) and without it
(``batching=False``: the worker steps the calls one by one), plus whether every concurrent
result equals the same call run alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent import Policy, RuntimeOptions, SpecRuntime
from specagent.catalog import resolve_model
from specagent.machine import machine_info, machine_kind

TOOLS_BLURB = (
    "Tool lookup_order(order_id: string) returns the order's status, carrier and delivery date. "
    "Tool shop_policy(topic: one of late, refund, damaged, exchange) returns the shop's rule. "
    "Tool escalate(reason: string, priority: low|high) hands the ticket to a human. "
)
SYSTEM = (
    "You are the support agent of an online shop. Be brief, kind and precise. Never promise "
    "refunds the policy does not allow. Always look up the order before answering. "
    + TOOLS_BLURB
    * 15
)
QUESTIONS = [
    "Where is my order A-10234?",
    "Can I return shoes I wore once?",
    "My parcel is damaged.",
    "Do you ship to Norway?",
    "I want to exchange a size M for L.",
    "Why was I charged twice?",
]
POLICY = Policy(
    name="bench",
    description="lossless, prompt lookup",
    mode="lossless",
    drafter={"kind": "prompt_lookup", "num_speculative_tokens": 6},
)


def messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
    ]


def ttft_with_and_without_reuse(model: Any, tokenizer: Any, turns: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, tokens in (("without_reuse", 0), ("with_reuse", 65536)):
        rt = SpecRuntime(
            target=model,
            tokenizer=tokenizer,
            policies=[POLICY],
            options=RuntimeOptions(prefix_cache_tokens=tokens),
        )
        # One tenant: its calls may reuse each other's KV (calls that name none share nothing).
        rt.generate_sync(messages(0), policy="bench", max_new_tokens=2, tenant="shop")  # warm-up
        ttfts = []
        for i in range(1, turns + 1):
            result = rt.generate_sync(messages(i), policy="bench", max_new_tokens=8, tenant="shop")
            ttfts.append(result.stats.ttft_s)
        out[label] = {
            "ttft_s_median": round(statistics.median(ttfts), 4),
            "ttft_s": [round(t, 4) for t in ttfts],
            "prompt_tokens": result.usage.input_tokens,
        }
        if rt.prefix_cache is not None:
            out[label]["reused_tokens_total"] = rt.prefix_cache.reused_tokens
        rt.close()
    out["ttft_ratio_without_over_with"] = round(
        out["without_reuse"]["ttft_s_median"] / out["with_reuse"]["ttft_s_median"], 2
    )
    return out


def concurrency(
    model: Any, tokenizer: Any, levels: list[int], new_tokens: int, repeats: int
) -> dict[str, Any]:
    """Per level N: the N calls one at a time, then all at once with batched steps, then all at
    once stepped one call at a time (``batching=False``), on the same runtime models. The three
    run in turn ``repeats`` times; each ratio is taken within one round (so a slow spell of the
    machine hits both sides) and the median round is reported."""
    batched = SpecRuntime(
        target=model,
        tokenizer=tokenizer,
        policies=[POLICY],
        options=RuntimeOptions(prefix_cache_tokens=0),
    )
    stepped = batched.with_policies([POLICY], replace(batched.options, batching=False))
    short = [[{"role": "user", "content": q}] for q in QUESTIONS]
    batched.generate_sync(short[0], policy="bench", max_new_tokens=4)
    stepped.generate_sync(short[0], policy="bench", max_new_tokens=4)
    rows: dict[str, Any] = {}

    for n in levels:
        prompts = [short[i % len(short)] for i in range(n)]
        rounds: list[dict[str, Any]] = []
        for _ in range(repeats):
            start = time.perf_counter()
            sequential = [
                batched.generate_sync(p, policy="bench", max_new_tokens=new_tokens) for p in prompts
            ]
            seq_rate = sum(r.usage.output_tokens for r in sequential) / (
                time.perf_counter() - start
            )
            one: dict[str, Any] = {"sequential_tokens_per_s": seq_rate}
            for label, rt in (("batched", batched), ("round_robin", stepped)):
                results, latencies, seconds = _run_concurrently(rt, prompts, new_tokens)
                rate = sum(r.usage.output_tokens for r in results) / seconds
                latencies.sort()
                one[label] = {
                    "tokens_per_s": rate,
                    "throughput_ratio": rate / seq_rate,
                    "latency_p50_s": latencies[len(latencies) // 2],
                    "latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
                    "same_tokens_as_alone": [r.token_ids for r in results]
                    == [r.token_ids for r in sequential],
                }
            rounds.append(one)
        rounds.sort(key=lambda r: r["batched"]["throughput_ratio"])
        median = rounds[len(rounds) // 2]
        row: dict[str, Any] = {
            "sequential_tokens_per_s": round(median["sequential_tokens_per_s"], 2),
            "batched_ratio_per_round": [round(r["batched"]["throughput_ratio"], 3) for r in rounds],
        }
        for label in ("batched", "round_robin"):
            row[label] = {
                key: round(value, 3) if isinstance(value, float) else value
                for key, value in median[label].items()
            }
            row[label]["same_tokens_as_alone"] = all(
                r[label]["same_tokens_as_alone"] for r in rounds
            )
        rows[str(n)] = row
        print(n, json.dumps(row), flush=True)
    batched.close()
    stepped.close()
    return rows


def _run_concurrently(
    rt: SpecRuntime, prompts: list[Any], new_tokens: int
) -> tuple[list[Any], list[float], float]:
    results: list[Any] = [None] * len(prompts)
    latencies: list[float] = []

    async def run_all() -> None:
        async def one(i: int) -> None:
            t0 = time.perf_counter()
            results[i] = await rt.generate(prompts[i], policy="bench", max_new_tokens=new_tokens)
            latencies.append(time.perf_counter() - t0)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)

    start = time.perf_counter()
    anyio.run(run_all)
    return results, latencies, time.perf_counter() - start


def tiny_model(tokenizer: Any) -> Any:
    """A seeded 4-layer, 128-wide Llama over the tokenizer's vocabulary (random weights): the
    per-step overhead regime of small models, where batching matters most on a CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    levels = list(report["concurrency"])
    for label, style in (("batched", "o-"), ("round_robin", "^:")):
        left.plot(
            levels,
            [report["concurrency"][n][label]["tokens_per_s"] for n in levels],
            style,
            label=f"concurrent, {label.replace('_', ' ')}",
        )
    left.plot(
        levels,
        [report["concurrency"][n]["sequential_tokens_per_s"] for n in levels],
        "s--",
        label="one at a time",
    )
    left.set_xlabel("calls")
    left.set_ylabel("tokens/s")
    left.legend()
    left.set_title("throughput")
    reuse = report["prefix_reuse"]
    right.bar(
        ["without reuse", "with reuse"],
        [reuse["without_reuse"]["ttft_s_median"], reuse["with_reuse"]["ttft_s_median"]],
    )
    right.set_ylabel("median TTFT (s)")
    right.set_title(f"~{reuse['with_reuse']['prompt_tokens']}-token prompt, repeated prefix")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 48])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds per concurrency level (median reported)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random model on the target's tokenizer"
    )
    parser.add_argument(
        "--engine",
        default="transformers",
        choices=["transformers", "llama.cpp"],
        help="llama.cpp: the target's GGUF as shipped (a catalog name or a .gguf path)",
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.engine == "llama.cpp":
        loaded = SpecRuntime.from_pretrained(args.target, engine="llama.cpp")
        model, tokenizer = loaded.target, loaded.tokenizer
        name = f"{args.target} (llama.cpp: {model.description})"
    else:
        path = resolve_model(args.target)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = tiny_model(tokenizer) if args.tiny else AutoModelForCausalLM.from_pretrained(path)
        model.eval()
        name = f"tiny-llama-4x128 ({args.target} tokenizer)" if args.tiny else args.target
    report: dict[str, Any] = {"target": name, "engine": args.engine, "machine": machine_info()}
    report["prefix_reuse"] = ttft_with_and_without_reuse(model, tokenizer, args.turns)
    print(json.dumps(report["prefix_reuse"], indent=1), flush=True)
    report["concurrency"] = concurrency(
        model, tokenizer, args.concurrency, args.new_tokens, args.repeats
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"runtime-load_{'tiny' if args.tiny else Path(args.target).name}"
    if args.engine == "llama.cpp":
        stem += "_llama-cpp"
    stem += f"_{machine_kind()}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    chart(report, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
