"""The target's whole forward over n new tokens with each linear-kernel form, on this machine.
Writes JSON to benchmarks/results/.

    python benchmarks/linear_kernels.py                 # the Qwen2.5-Coder 1.5B target, float32
    python benchmarks/linear_kernels.py --dtype bfloat16 --lengths 1 4 8

Per length (rows fed to one forward after a cached context, as a verification feeds them): the
seconds of one forward with torch's kernels (what ``generate`` and transformers' assisted
generation run), with the transposed form and with the packed weights
(``specagent/decoding/kernels.py``), best of ``--repeats``, the forms taking turns per repeat so
a drifting host slows each alike. Then what the runtime's own choice (``choose_kernels``) keeps.
Each form's last logits are compared with torch's (largest difference), and its greedy token.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent.catalog import resolve_model
from specagent.decoding.engine import crop_to
from specagent.engines.transformers import ModelRunner
from specagent.engines.transformers.kernels import LinearPlan, PackedWeights
from specagent.measuring.records import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lengths", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the rows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    started = time.perf_counter()

    from transformers import AutoModelForCausalLM

    path = resolve_model(args.target)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    runner = ModelRunner(model)
    packed = PackedWeights.of(model)
    forms: dict[str, Any] = {"torch": lambda n: LinearPlan()}
    forms["transposed"] = lambda n: LinearPlan(transposed_rows=frozenset({n}))
    if packed is not None:
        forms["packed"] = lambda n: LinearPlan(packed_rows=frozenset({n}))

    vocab = runner.vocab_size
    context = [(i * 7919) % (vocab - 1) + 1 for i in range(args.context)]
    cache = runner.new_cache()
    runner.forward(context, cache, keep=1)
    seconds: dict[str, dict[int, float]] = {name: {} for name in forms}
    difference: dict[str, dict[int, float]] = {name: {} for name in forms}
    same_token: dict[str, dict[int, bool]] = {name: {} for name in forms}
    for n in args.lengths:
        rows = context[-n:]
        reference = None
        for repeat in range(args.repeats + 1):  # the first pass warms each form up
            for name, plan_of in forms.items():
                # A runner per form (the engine fixes a runner's plan): same model, same cache.
                planned = ModelRunner(model, kernels=plan_of(n), packed=packed)
                start = time.perf_counter()
                logits = planned.forward(rows, cache)
                elapsed = time.perf_counter() - start
                crop_to(cache, args.context)
                if repeat:
                    best = seconds[name].get(n, float("inf"))
                    seconds[name][n] = round(min(best, elapsed), 4)
                if name == "torch" and reference is None:
                    reference = logits
                if repeat == 1:
                    assert reference is not None
                    difference[name][n] = float((logits - reference).abs().max())
                    same_token[name][n] = bool(torch.equal(logits.argmax(-1), reference.argmax(-1)))
        line = "  ".join(f"{name} {seconds[name][n]:.3f}" for name in forms)
        print(f"{n:3d} rows: {line}", flush=True)

    chooser = ModelRunner(model)  # what a runtime's first cost measurement settles
    tuning = chooser.tune(args.lengths, context_tokens=args.context, prefill_lengths=())
    while True:
        try:
            next(tuning)
        except StopIteration as done:
            chosen: dict[int, float] = done.value
            break
    plan = chooser.kernels
    result = {
        "target": args.target,
        "dtype": args.dtype,
        "context_tokens": args.context,
        "packed_bytes": packed.nbytes if packed is not None else None,
        "forward_seconds": seconds,
        "relative_to_torch_single_token": {
            name: {n: round(t / seconds["torch"][args.lengths[0]], 3) for n, t in times.items()}
            for name, times in seconds.items()
        },
        "max_logit_difference_vs_torch": difference,
        "same_greedy_tokens_as_torch": same_token,
        "runtime_choice": {
            "transposed_rows": sorted(plan.transposed_rows),
            "packed_rows": sorted(plan.packed_rows),
            "seconds": {n: round(t, 4) for n, t in chosen.items()},
        },
    }
    name = args.name or f"linear_kernels_{Path(args.target).name}_{args.dtype}"
    print(f"wrote {write_result(result, args.out, name, started)}")


if __name__ == "__main__":
    main()
