"""How often a greedy lossless call differs from plain greedy decoding in low precision, and
whether the same call gives the same tokens under different load. Writes JSON to
benchmarks/results/.

    python benchmarks/reproducibility.py                     # Qwen2.5-Coder-0.5B, bf16
    python benchmarks/reproducibility.py --target PATH --dtype float32

In bf16 a forward over k + 1 tokens rounds differently from k + 1 forwards over one token, and a
batched forward (padded with other calls) differently again, so where the target's two best
tokens are within rounding of each other, a lossless call's greedy token can differ from plain
greedy ``generate``; with adaptive drafting, which forward shapes a call gets depends on the
measured costs and on what else the runtime is doing. Per prompt (the shipped evaluation prompts
and the first turn of every shipped agent episode), greedy:

- plain: transformers ``generate`` on the same model object, in the same dtype;
- lossless, adaptive prompt lookup: started while the runtime measures its costs (calls one at a
  time), then all prompts at once (batched), then one at a time once measured;
- the same policy with ``reproducible: true``: all at once, then one at a time.

Reported: how many outputs equal plain greedy, and how many differ between the runs of one
policy. A reproducible policy must give the same tokens in both of its runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent import Policy, RuntimeOptions, SpecRuntime
from specagent.catalog import resolve_model
from specagent.chat import render_prompt
from specagent.machine import machine_info, machine_kind
from specagent.measuring.agent_bench import load_episodes
from specagent.measuring.baselines import baseline_methods
from specagent.measuring.evaluation import load_prompt_set


def policy(name: str, reproducible: bool) -> Policy:
    return Policy(
        name=name,
        description="greedy lossless, adaptive prompt lookup",
        mode="lossless",
        reproducible=reproducible,
        drafter={"kind": "prompt_lookup", "num_speculative_tokens": 8},
    )


def prompts(runtime: SpecRuntime, limit: int | None) -> list[list[int]]:
    chats = [p.messages for p in load_prompt_set()]
    chats += [
        [{"role": "system", "content": e.system}, {"role": "user", "content": e.turns[0]}]
        for e in load_episodes()
    ]
    ids = [render_prompt(c, runtime.tokenizer, vocab_size=runtime.vocab_size) for c in chats]
    return ids[:limit] if limit else ids


def one_at_a_time(runtime: SpecRuntime, name: str, all_ids: list[list[int]], n: int) -> list:
    return [
        runtime.generate_sync(ids, policy=name, max_new_tokens=n, temperature=0.0).token_ids
        for ids in all_ids
    ]


def all_at_once(runtime: SpecRuntime, name: str, all_ids: list[list[int]], n: int) -> list:
    results: dict[int, list[int]] = {}

    async def run() -> None:
        async def one(i: int, ids: list[int]) -> None:
            out = await runtime.generate(ids, policy=name, max_new_tokens=n, temperature=0.0)
            results[i] = out.token_ids

        async with anyio.create_task_group() as tg:
            for i, ids in enumerate(all_ids):
                tg.start_soon(one, i, ids)

    anyio.run(run)
    return [results[i] for i in range(len(all_ids))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=None, help="use only the first N")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    runtime = SpecRuntime.from_pretrained(
        resolve_model(args.target),
        policies=[policy("adaptive", False), policy("reproducible", True)],
        dtype=args.dtype,
        # Measured in this process: its first calls run while it measures.
        options=RuntimeOptions(probe_store=None),
    )
    all_ids = prompts(runtime, args.prompts)
    n = args.max_new_tokens
    start = time.perf_counter()
    runs: dict[str, list[list[int]]] = {}
    runs["adaptive, one at a time, while measuring"] = one_at_a_time(
        runtime, "adaptive", all_ids, n
    )
    runtime.wait_measured()
    runs["adaptive, all at once"] = all_at_once(runtime, "adaptive", all_ids, n)
    runs["adaptive, one at a time"] = one_at_a_time(runtime, "adaptive", all_ids, n)
    runs["reproducible, all at once"] = all_at_once(runtime, "reproducible", all_ids, n)
    runs["reproducible, one at a time"] = one_at_a_time(runtime, "reproducible", all_ids, n)
    plain = baseline_methods(runtime, n)["plain"]  # transformers' greedy generate, same model
    reference = [plain(ids, 0)[0] for ids in all_ids]
    runtime.close()

    def differ(a: list[list[int]], b: list[list[int]]) -> int:
        return sum(x != y for x, y in zip(a, b, strict=True))

    result: dict[str, Any] = {
        "target": args.target,
        "dtype": args.dtype,
        "prompts": len(all_ids),
        "max_new_tokens": n,
        "equal_to_plain_greedy": {k: len(all_ids) - differ(v, reference) for k, v in runs.items()},
        "differ_between_runs": {
            "adaptive: while measuring vs measured": differ(
                runs["adaptive, one at a time, while measuring"], runs["adaptive, one at a time"]
            ),
            "adaptive: all at once vs one at a time": differ(
                runs["adaptive, all at once"], runs["adaptive, one at a time"]
            ),
            "reproducible: all at once vs one at a time": differ(
                runs["reproducible, all at once"], runs["reproducible, one at a time"]
            ),
        },
        "seconds": round(time.perf_counter() - start, 1),
        "machine": machine_info(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"reproducibility_{Path(args.target).name}_{args.dtype}_{machine_kind()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
