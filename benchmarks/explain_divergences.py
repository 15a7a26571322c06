"""Explain again, with the current ``divergence.explain_divergence``, the outputs of an agent
bench result that differ from plain greedy; rewrites the result's divergence reports in place.

    python benchmarks/explain_divergences.py benchmarks/results/NAME_agent.json

For results written before the explanation changed, without re-timing the whole bench: each
episode with a differing turn is run again with plain greedy ``generate`` (the same model, path
and dtype as the result names, on this machine kind), which gives back every turn's prompt and
plain's output (checked against the token the result recorded at the first difference); each
recorded difference is then judged anew.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent import Policy, SpecRuntime
from specagent.catalog import PAIRS
from specagent.machine import machine_info
from specagent.measuring.agent_bench import (
    TurnResult,
    _divergence_summary,
    _run_episode,
    load_episodes,
)
from specagent.measuring.baselines import baseline_methods
from specagent.measuring.divergence import explain_divergence

PLAIN = Policy(name="plain", description="no drafting", mode="lossless", drafter={"kind": "none"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--pair", default="qwen2.5-coder")
    args = parser.parse_args()
    started = time.perf_counter()
    result = json.loads(args.result.read_text())
    dtype = result["precision"]["target"]["dtype"]
    target, _ = PAIRS[args.pair]
    runtime = SpecRuntime.from_pretrained(target, policies=[PLAIN], dtype=dtype)
    plain = baseline_methods(runtime, result["max_new_tokens"])["plain"]
    episodes = {e.id: e for e in load_episodes()}
    places, cases = [], []
    for episode_id, rows in result["episodes"].items():
        differing = [
            (name, i, turn["divergence"])
            for name, turns in rows.items()
            for i, turn in enumerate(turns)
            if turn.get("divergence") and "plain_token" in turn["divergence"]
        ]
        if not differing:
            continue
        _, outputs, prompts, _ = _run_episode(runtime, episodes[episode_id], plain, 0)
        for name, i, old in differing:
            reference, at = outputs[i], old["at"]
            if reference[at] != old["plain_token"]:
                raise SystemExit(
                    f"{episode_id} turn {i}: plain greedy gave {reference[at]} at {at} on this "
                    f"run, the result recorded {old['plain_token']}: another machine kind or "
                    "library version; rerun the bench instead"
                )
            places.append((rows[name][i], f"{episode_id} {name} turn {i}"))
            cases.append((prompts[i], reference, [*reference[:at], old["token"]]))
    for (turn, where), new in zip(places, explain_divergence(runtime, cases), strict=True):
        turn["divergence"] = new
        print(where, new, flush=True)
    counts = _divergence_summary(
        {
            e: {m: [TurnResult(**t) for t in turns] for m, turns in rows.items()}
            for e, rows in result["episodes"].items()
        }
    )
    result["summary"]["divergences"] = counts
    explained: dict[str, Any] = {
        "by": "benchmarks/explain_divergences.py",
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
    }
    result["divergences_explained"] = explained
    args.result.write_text(json.dumps(result, indent=1) + "\n")
    runtime.close()
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
