"""Batched decoding on the transformers engine: what one output token costs when 16 calls decode
together, at a short and at an agent-sized context, against transformers' own batched
``generate`` over a static cache, on the same model in the same process.

The model is small enough that a step is bound by the framework, not by arithmetic (as a GPU
step is): a seeded random Llama, 12 layers, hidden 256. specagent runs 16 concurrent greedy calls
through the public runtime (plain steps: the cost of a batched round, not of drafting), with each
call's KV in the runner's slot pool (``kv_slots=True``, the default) and in an ordinary cache
per call (``kv_slots=False``); transformers runs the same 16 prompts as one left-padded batch
with ``cache_implementation="static"``. Each side is timed at two output lengths, and the cost
of one output token is the difference over the extra tokens (the prefill cancels out); methods
take turns, five rounds, medians.

    python benchmarks/batched_decode.py            # contexts 32 and 2048, 16 calls
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specagent import Policy, SpecRuntime
from specagent.bench import write_result

PLAIN = Policy(
    name="plain", description="plain greedy steps", mode="lossless", drafter={"kind": "none"}
)


def small_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def prompts(calls: int, context: int) -> list[list[int]]:
    return [[(i * 131 + j * 7) % 2000 + 3 for j in range(context)] for i in range(calls)]


def specagent_seconds(runtime: SpecRuntime, batch: list[list[int]], new_tokens: int) -> float:
    async def run() -> float:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt in batch:
                tg.start_soon(
                    lambda p=prompt: runtime.generate(
                        p, policy="plain", max_new_tokens=new_tokens, temperature=0.0
                    )
                )
        return time.perf_counter() - start

    return anyio.run(run)


def transformers_seconds(model: Any, batch: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch, device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
    assert out.shape[1] == ids.shape[1] + new_tokens
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 2048])
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs=2, default=[8, 40], help="short, long")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    started = time.perf_counter()
    model = small_llama()
    runtimes = {
        name: SpecRuntime(
            model, policies=[PLAIN], device="cpu", prefix_cache_tokens=0, kv_slots=slots
        )
        for name, slots in (("specagent_slots", True), ("specagent_per_call_caches", False))
    }
    for runtime in runtimes.values():
        runtime.eos_token_ids = []
    methods = {
        **{
            name: (lambda b, n, rt=rt: specagent_seconds(rt, b, n)) for name, rt in runtimes.items()
        },
        "transformers_static_generate": lambda b, n: transformers_seconds(model, b, n),
    }
    short, long = args.tokens
    result: dict[str, Any] = {"calls": args.calls, "tokens": [short, long], "contexts": {}}
    for context in args.contexts:
        batch = prompts(args.calls, context)
        for method in methods.values():
            method(batch[:2], 2)  # warm up
        per_token: dict[str, list[float]] = {name: [] for name in methods}
        for round_index in range(args.rounds):
            order = list(methods) if round_index % 2 == 0 else list(methods)[::-1]
            for name in order:
                t_short = methods[name](batch, short)
                t_long = methods[name](batch, long)
                per_token[name].append((t_long - t_short) / ((long - short) * args.calls))
        medians = {name: statistics.median(values) for name, values in per_token.items()}
        reference = medians["transformers_static_generate"]
        result["contexts"][str(context)] = {
            "ms_per_token": {name: round(v * 1000, 3) for name, v in medians.items()},
            "rounds_ms_per_token": {
                name: [round(v * 1000, 3) for v in values] for name, values in per_token.items()
            },
            "vs_transformers_static": {
                name: round(v / reference, 2) for name, v in medians.items()
            },
        }
        print(context, result["contexts"][str(context)]["ms_per_token"], flush=True)
    for runtime in runtimes.values():
        runtime.close()
    path = write_result(
        result, args.out, f"batched-decode_llama-12x256_{args.calls}-calls", started
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
