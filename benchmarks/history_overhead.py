"""What history drafting adds to a step when it finds nothing: the time of one ``auto``/``suffix``
history lookup (the call's own context indexed incrementally, plus a full tenant history) on
text that matches nothing, against the time of one plain decoding step of the target. Writes
JSON to benchmarks/results/.

    python benchmarks/history_overhead.py --step-seconds 0.70   # a measured plain step

The plain step's time comes from a bench result (``--from-bench``: the agent bench JSON, total
plain seconds over total plain tokens, prefills included, so a lower bound on the share) or is
given. The history holds ``--history-tokens`` tokens of random text in documents of 300 tokens
(the runtime's default budget is 32,768); each lookup follows one new token, as a step does.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent.decoding.drafters import SuffixDrafter
from specagent.machine import machine_info, machine_kind
from specagent.runtime.memory import HistoryStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history-tokens", type=int, default=32768)
    parser.add_argument("--context-tokens", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-seconds", type=float, default=None)
    parser.add_argument(
        "--from-bench",
        type=Path,
        default=Path("benchmarks/results/bench-agent_transformers_qwen2.5-coder_zen3.json"),
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    rng = random.Random(0)
    vocab = 150_000
    store = HistoryStore(max_tokens=args.history_tokens)
    for _doc in range(args.history_tokens // 300):
        store.record(
            "tenant",
            [rng.randrange(vocab) for _ in range(150)],
            [rng.randrange(vocab) for _ in range(150)],
        )
    drafter = SuffixDrafter(store.indexes("tenant"))
    context = [rng.randrange(vocab) for _ in range(args.context_tokens)]
    drafter.candidate(context, 16)  # the prompt is indexed once, at the first step
    times, found = [], 0
    for _ in range(args.steps):
        context.append(rng.randrange(vocab))
        start = time.perf_counter()
        proposal, _ = drafter.candidate(context, 16)
        times.append(time.perf_counter() - start)
        found += bool(proposal.tokens)

    records = []  # what the end of a call adds: its text into the history (evicting the oldest)
    for _ in range(10):
        text = [rng.randrange(vocab) for _ in range(len(context))]
        start = time.perf_counter()
        store.record("tenant", text[: args.context_tokens], text[args.context_tokens :])
        records.append(time.perf_counter() - start)
    record_seconds = statistics.median(records)

    step = args.step_seconds
    source = "given"
    if step is None and args.from_bench.exists():
        bench = json.loads(args.from_bench.read_text())
        plain = [t for e in bench["episodes"].values() for t in e["plain"]]
        step = sum(t["seconds"] for t in plain) / sum(t["tokens"] for t in plain)
        source = str(args.from_bench)
    median = statistics.median(times)
    result = {
        "history_tokens": store.stats()["tokens"],
        "context_tokens": args.context_tokens,
        "lookups": args.steps,
        "lookups_that_found_a_draft": found,
        "lookup_seconds_median": median,
        "lookup_seconds_p95": sorted(times)[int(0.95 * len(times))],
        "record_seconds_at_the_end_of_a_call": record_seconds,
        "record_seconds_max": max(records),
        "record_tokens": len(context),
        "plain_step_seconds": step,
        "plain_step_source": source,
        "share_of_a_plain_step": (median / step) if step else None,
        "record_share_of_a_plain_step": (record_seconds / step) if step else None,
        "machine": machine_info(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"history-overhead_{machine_kind()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
