"""Do cells that other sequences hold in the llama.cpp engine's shared pool slow one call's steps?

A call's forward attends over every cell up to the highest one in use (llama.cpp's ``n_kv``),
masked where the cell is not the call's; kept prefixes and other calls fill the pool, so they
could tax every step. This times one call (a 900-token prompt) doing single-token steps and
16-token verifications with the pool otherwise empty, with ``--fill`` other sequences of 512
tokens held after it, and with only the highest of them held (``n_kv`` as large, the cells
between free). The conditions alternate within each round, each first in turn (the host
drifts); the other sequences are restored copies of one prefilled sequence's saved state (as
the engine keeps prefixes, ``LlamaCppRunner.kept``), so filling costs no prefill.

    python benchmarks/held_cells.py --model qwen2.5-coder-1.5b-instruct --fill 60 --rounds 4
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent.catalog import resolve_gguf
from specagent.engines.llama_cpp import LlamaCppModel, LlamaSequence
from specagent.errors import GenerationError
from specagent.machine import machine_info, machine_kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--fill", type=int, default=60, help="other sequences of 512 tokens")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    model = LlamaCppModel(resolve_gguf(args.model))
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    def timed(seq: LlamaSequence, width: int, repeats: int) -> float:
        start, seconds = seq.length, []
        for _ in range(repeats):
            began = time.perf_counter()
            model.decode([(seq, tokens(width), width)])
            seconds.append(time.perf_counter() - began)
        seq.crop(start)
        return statistics.median(seconds) * 1000

    call = model.sequence()
    model.decode([(call, tokens(900), 1)])
    source = model.sequence()
    model.decode([(source, tokens(512), 1)])
    state = model.runner().kept(source, copied=False)
    del source

    def held(condition: str) -> list[LlamaSequence]:
        others = []
        for _ in range(0 if condition == "empty" else args.fill):
            try:
                others.append(copy.deepcopy(state))  # restored into a new sequence
            except GenerationError:
                msg = f"the pool of {model.context_tokens} cells is full: lower --fill"
                raise SystemExit(msg) from None
        return others[-1:] if condition == "highest only" else others

    machine = machine_info()
    print(f"{machine_kind(machine)}: {machine['cpu']} {machine['cpu_family_model']}, "
          f"{' '.join(machine['isa_flags'])}; {model.description}, {model.threads} threads, "
          f"llama-cpp-python {machine['llama_cpp_python']}; {model.fast_paths}")  # fmt: skip
    results: dict[str, list[tuple[float, float]]] = {}
    conditions = ["empty", f"{args.fill} x 512 held", "highest only"]
    for round_index in range(args.rounds):
        shift = round_index % len(conditions)  # each condition first in turn: drift is shared
        for condition in conditions[shift:] + conditions[:shift]:
            others = held(condition)
            results.setdefault(condition, []).append((timed(call, 1, 6), timed(call, 16, 3)))
            del others
            step, verify = results[condition][-1]
            print(f"round {round_index + 1} {condition:18s} step {step:6.1f} ms  "
                  f"verify 16 {verify:7.1f} ms", flush=True)  # fmt: skip
    for condition, rows in results.items():
        step = statistics.median(r[0] for r in rows)
        verify = statistics.median(r[1] for r in rows)
        print(f"median  {condition:18s} step {step:6.1f} ms  verify 16 {verify:7.1f} ms")


if __name__ == "__main__":
    main()
