"""The draft's prefill in float32 against its own dtype (bf16), end to end. Writes JSON to
benchmarks/results/.

    python benchmarks/draft_prefill.py                 # Qwen2.5-Coder pair, dtype auto
    python benchmarks/draft_prefill.py --episodes 12 --prompts code summary json_extraction

On a CPU without native bf16, ``dtype=auto`` runs the draft in bf16 (its single-token step is
twice as fast as in float32) but a bf16 forward over many tokens costs per row what float32
costs per forward, so prefilling the prompt into the draft's cache can cost more than the
target's own prefill. Where the draft's dtype measurement says so, a float32 copy of the draft
runs those forwards (``engines.transformers.PrefillTwin``). Here, on the first turn of agent
episodes (long system prompts, every prefill paid: no prefix reuse) and on bench prompts: plain
``generate``, specagent ``lossless-auto`` with the float32 prefill, and the same without it
(same runtime, same models), greedy, each output checked against plain greedy. Each specagent
call runs under a tenant of its own, so no call drafts from another's text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent import RuntimeOptions, SpecRuntime
from specagent.chat import render_prompt
from specagent.measuring.agent_bench import agent_policies, load_episodes
from specagent.measuring.baselines import baseline_methods
from specagent.measuring.bench import PROMPTS
from specagent.measuring.records import dtypes_of, geomean, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--episodes", type=int, default=6, help="first turns of every n-th")
    parser.add_argument("--prompts", nargs="*", default=["code", "prose"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    started = time.perf_counter()
    rt = SpecRuntime.from_pretrained(
        args.target,
        args.draft,
        policies=agent_policies(True),
        options=RuntimeOptions(prefix_cache_tokens=0),
        engine_options={"compile_steps": False},
    )
    runner = rt._decoder.draft_runner
    assert runner is not None
    twin = runner.prefill_twin
    print("draft:", rt.precision.get("draft", {}).get("reason"), flush=True)
    if twin is None:
        raise SystemExit("the draft's long forwards did not measure faster in float32 here")
    n = args.max_new_tokens
    plain = baseline_methods(rt, n)["plain"]
    episodes = load_episodes()
    step = max(1, len(episodes) // args.episodes)
    chats = {
        f"episode {e.id}": [
            {"role": "system", "content": e.system},
            {"role": "user", "content": e.turns[0]},
        ]
        for e in episodes[::step][: args.episodes]
    }
    chats.update({f"prompt {name}": PROMPTS[name] for name in args.prompts})

    def spec(ids: list[int], tenant: str, with_twin: bool) -> tuple[list[int], float, float]:
        runner.prefill_twin = twin if with_twin else None
        start = time.perf_counter()
        out = rt.generate_sync(ids, policy="lossless-auto", max_new_tokens=n, tenant=tenant)
        return out.token_ids, time.perf_counter() - start, out.stats.ttft_s

    warm = render_prompt(
        [{"role": "user", "content": "Hi"}], rt.tokenizer, vocab_size=rt.vocab_size
    )
    plain(warm, 0)
    spec(warm, "warm", True)
    spec(warm, "warm", False)
    rt.wait_measured()
    rows: dict[str, Any] = {}
    for i, (name, messages) in enumerate(chats.items()):
        ids = render_prompt(messages, rt.tokenizer, vocab_size=rt.vocab_size)
        start = time.perf_counter()
        reference, _ = plain(ids, 0)
        plain_s = time.perf_counter() - start
        fast, fast_s, fast_ttft = spec(ids, f"float32-prefill-{i}", True)
        slow, slow_s, slow_ttft = spec(ids, f"bf16-prefill-{i}", False)
        rows[name] = {
            "prompt_tokens": len(ids),
            "new_tokens": len(reference),
            "plain_seconds": round(plain_s, 2),
            "float32_prefill_seconds": round(fast_s, 2),
            "bf16_prefill_seconds": round(slow_s, 2),
            "float32_prefill_ttft": round(fast_ttft, 2),
            "bf16_prefill_ttft": round(slow_ttft, 2),
            "float32_prefill_vs_plain": round(plain_s / fast_s, 3),
            "bf16_prefill_vs_plain": round(plain_s / slow_s, 3),
            "equal_to_plain": fast == reference and slow == reference,
        }
        print(name, rows[name], flush=True)
    rt.close()
    result = {
        "target": args.target,
        "draft": args.draft,
        "precision": dtypes_of(rt),
        "max_new_tokens": n,
        "rows": rows,
        "geomean_vs_plain": {
            key: round(geomean(r[key] for r in rows.values()), 3)
            for key in ("float32_prefill_vs_plain", "bf16_prefill_vs_plain")
        },
    }
    path = write_result(result, args.out, f"draft-prefill_{Path(args.target).name}", started)
    print(json.dumps(result["geomean_vs_plain"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
