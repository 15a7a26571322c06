"""Replay the edits of ``specagent bench --workload edits`` against an oracle output, on a
machine's verify curve: how many single-token target steps each drafting rule needs, without
the host's drift, and on the curve of a machine kind this host is not.

    python benchmarks/replay_edits.py --curves here zen4 xeon-amx \
        --out benchmarks/results/replay-edits_qwen2.5-coder-1.5b-instruct.json

The oracle output of a task is its expected text in a code fence (what the model returns when it
applies the edit as asked; the bench checks how often it does). In greedy lossless decoding the
target's verdict on a draft depends only on the output it would produce, so a replay takes the
steps a real run takes. Rules replayed, each over the task's rendered prompt:

- ``plain``: one step per token;
- ``specagent``: the ``suffix`` drafter as ``auto`` runs it without a draft model (n-gram match
  and aligned copying of the call's own text, lengths by expected tokens per unit of cost on the
  curve, k = 64), and again with the text to edit (the rewrite: the expected text) as the
  call's prediction;
- ``ngram_mod``: llama.cpp's ``ngram-mod`` as llama-server runs it (a hash of every 24-token
  window of the prompt and output to the token after it, the output's windows added 32 tokens
  at a time; a draft chains the table from the last 24 tokens, 48 to 64 tokens or none; three
  drafts in a row under half accepted reset the table);
- ``oracle``: ``specagent`` given the output itself as the prediction (a drafter that knows the
  answer, its draft lengths still its own);
- ``bound``: every output token verified at the curve's cheapest cost per row (the most any
  drafter could save on this curve).

Curves, in single-token steps per forward of n rows: ``here``, this machine's, as the runtime's
cost book measured (or stored) it for the target on the llama.cpp engine (saved under the
machine's kind); ``zen4``, the llama.cpp engine's curve for Qwen2.5-Coder-1.5B Q4_K_M as the cost
book measured it on the Zen 4 (32 tokens of context, 1-65 rows); ``xeon-amx``, the Xeon's
measured points (2 rows 1.39, 4 rows 2.08, 8 rows 3.23, 16 rows 3.41, 32 rows about 3.7; linear
between, past 32 extrapolated from 16-32). Prefills are left out (every rule pays the same one;
``specagent bench --workload edits`` times them, and each task's floor).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from specagent.catalog import resolve_model
from specagent.chat import render_prompt
from specagent.decoding.costs import CostModel
from specagent.decoding.drafters.suffix import SuffixDrafter
from specagent.machine import machine_info, machine_kind
from specagent.measuring.edit_tasks import EditTask, edit_tasks, rewrite_task

ZEN4 = (
    1.0, 1.69, 2.35, 2.9, 3.78, 4.48, 5.4, 6.99, 7.05, 7.11, 7.17, 7.23, 7.45, 7.67, 7.89, 8.11,
    8.56, 9.02, 9.47, 9.92, 10.37, 10.83, 11.28, 11.73, 12.13, 12.52, 12.92, 13.32, 13.71, 14.11,
    14.5, 14.9, 15.06, 15.23, 15.39, 15.55, 15.71, 15.88, 16.04, 16.2, 16.37, 16.53, 16.69, 16.86,
    17.02, 17.18, 17.34, 17.51, 17.74, 17.96, 18.19, 18.42, 18.65, 18.88, 19.11, 19.34, 19.57,
    19.8, 20.02, 20.25, 20.48, 20.71, 20.94, 21.17, 26.62,
)  # fmt: skip
"""The llama.cpp engine's verify curve (1-65 rows), Qwen2.5-Coder-1.5B Q4_K_M, Zen 4, as the
cost book measured it for the edits bench (each length timed in turns with a single step)."""
XEON_POINTS = {1: 1.0, 2: 1.39, 4: 2.08, 8: 3.23, 16: 3.41, 32: 3.7}
K = 64
NGRAM_N, NGRAM_MIN, NGRAM_MAX = 24, 48, 64


def measured_curve(target: str) -> CostModel:
    """This machine's verify curve for ``target`` on the llama.cpp engine, up to K + 1 rows, as
    the runtime's cost book has it (measured now where this machine stored none)."""
    from specagent.measuring.edit_bench import edit_policies
    from specagent.runtime import SpecRuntime

    runtime = SpecRuntime.from_pretrained(target, engine="llama.cpp", policies=edit_policies(False))
    try:
        if not runtime.wait_measured(timeout=3600):
            raise RuntimeError("the step costs were still being measured after an hour")
        return runtime._decoder.costs.model(None)
    finally:
        runtime.close()


def curve(name: str, target: str) -> CostModel:
    if name == "here":
        return measured_curve(target)
    if name == "xeon-amx":
        points = sorted(XEON_POINTS.items())
        slope = (XEON_POINTS[32] - XEON_POINTS[16]) / 16
        values = []
        for n in range(1, K + 2):
            if n >= 32:
                values.append(XEON_POINTS[32] + slope * (n - 32))
                continue
            (a, ca), (b, cb) = next(
                (p, q) for p, q in itertools.pairwise(points) if p[0] <= n <= q[0]
            )
            values.append(ca + (cb - ca) * (n - a) / (b - a))
        return CostModel(verify=tuple(values))
    return CostModel(verify=ZEN4)


def specagent_steps(
    prompt: list[int], output: list[int], costs: CostModel, prediction: Sequence[int] = ()
) -> tuple[int, float]:
    drafter = SuffixDrafter(costs=costs, prediction=prediction)
    context, done, steps, spent = list(prompt), 0, 0, 0.0
    while done < len(output):
        found, rate = drafter.candidate(context, min(K, len(output) - done))
        tokens = drafter.take(found, None).tokens if found.tokens and rate >= 1.0 else []
        accepted = _accepted(tokens, output, done)
        drafter.observe(len(tokens), accepted)
        emitted = min(accepted + 1, len(output) - done)
        context += output[done : done + emitted]
        done += emitted
        steps += 1
        spent += costs.verify_cost(len(tokens) + 1)
    return steps, spent


def ngram_mod_steps(prompt: list[int], output: list[int], costs: CostModel) -> tuple[int, float]:
    table: dict[tuple[int, ...], int] = {}
    for i in range(len(prompt) - NGRAM_N):
        table[tuple(prompt[i : i + NGRAM_N])] = prompt[i + NGRAM_N]
    added = len(prompt) - NGRAM_N
    context, done, steps, spent, low = list(prompt), 0, 0, 0.0, 0
    while done < len(output):
        # llama-server drafts after the first token of the step's output is known: the
        # context here ends with it (the previous step's last token).
        if added + 32 < len(context):
            for i in range(added, len(context) - NGRAM_N):
                table[tuple(context[i : i + NGRAM_N])] = context[i + NGRAM_N]
            added = len(context) - NGRAM_N
        window = list(context[-NGRAM_N:])
        draft: list[int] = []
        while len(draft) < NGRAM_MAX:
            token = table.get(tuple(window[-NGRAM_N:]))
            if token is None:
                break
            draft.append(token)
            window.append(token)
        if len(draft) < NGRAM_MIN:
            draft = []
        draft = draft[: len(output) - done]
        accepted = _accepted(draft, output, done)
        if draft:
            low = low + 1 if accepted < len(draft) / 2 else 0
            if low >= 3:
                table, low = {}, 0
        emitted = min(accepted + 1, len(output) - done)
        context += output[done : done + emitted]
        done += emitted
        steps += 1
        spent += costs.verify_cost(len(draft) + 1)
    return steps, spent


def _accepted(draft: Sequence[int], output: Sequence[int], done: int) -> int:
    n = 0
    while n < len(draft) and done + n < len(output) and draft[n] == output[done + n]:
        n += 1
    return n


def replay(tasks: list[EditTask], tokenizer: Any, costs: CostModel) -> dict[str, Any]:
    """Every rule over every task on one curve: single-token steps per task, and totals."""
    rows: dict[str, dict[str, float]] = {}
    cheapest = min(costs.verify_cost(n) / n for n in range(1, K + 2))
    for task in tasks:
        prompt = render_prompt(task.messages(), tokenizer, vocab_size=len(tokenizer))
        fence = "yaml" if task.kind == "rewrite" else task.language
        fenced = f"```{fence}\n{task.expected}\n```"
        output = list(tokenizer(fenced, add_special_tokens=False)["input_ids"])
        prediction = list(tokenizer(task.prediction, add_special_tokens=False)["input_ids"])
        rows[task.id] = {
            "tokens": len(output),
            "plain": float(len(output)),
            "ngram_mod": round(ngram_mod_steps(prompt, output, costs)[1], 2),
            "specagent": round(specagent_steps(prompt, output, costs)[1], 2),
            "specagent+prediction": round(specagent_steps(prompt, output, costs, prediction)[1], 2),
            "oracle": round(specagent_steps(prompt, output, costs, output)[1], 2),
            "bound": round(len(output) * cheapest, 2),
        }
    methods = ("plain", "ngram_mod", "specagent", "specagent+prediction", "oracle", "bound")
    totals = {m: sum(r[m] for r in rows.values()) for m in methods}
    summary = {
        "speedup_vs_plain": {m: round(totals["plain"] / t, 3) for m, t in totals.items()},
        "specagent_vs_ngram_mod": round(totals["ngram_mod"] / totals["specagent"], 3),
        "specagent+prediction_vs_ngram_mod": round(
            totals["ngram_mod"] / totals["specagent+prediction"], 3
        ),
        "oracle_vs_ngram_mod": round(totals["ngram_mod"] / totals["oracle"], 3),
        "bound_vs_ngram_mod": round(totals["ngram_mod"] / totals["bound"], 3),
    }
    return {"verify_curve": [round(v, 3) for v in costs.verify], "summary": summary, "tasks": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--curves", nargs="+", choices=["here", "zen4", "xeon-amx"], default=["zen4", "xeon-amx"]
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.target))
    tasks: list[EditTask] = [*edit_tasks(), rewrite_task()]
    replays = {}
    for name in args.curves:
        key = machine_kind() if name == "here" else name
        replays[key] = replay(tasks, tokenizer, curve(name, args.target))
        print(key, json.dumps(replays[key]["summary"], indent=1))
    result = {"target": args.target, "machine": machine_info(), "curves": replays}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
