"""Compiled forwards over the KV slots against eager ones, on this machine. Writes JSON to
benchmarks/results/.

    python benchmarks/compiled_steps.py            # the Qwen2.5-Coder pair, dtype auto
    python benchmarks/compiled_steps.py --max-new-tokens 32 --prompts code json

Per model (the 1.5B target, the 0.5B draft, each in the dtype ``auto`` picks): what
``engines.transformers.compiled.choose_compiled_step`` measures to decide (an eager step over a
slot, the compiled one, the compile time) at a short and an agent-length context. Then
end to end, on the bench prompts, greedy, in one process with the same model objects: plain
``generate``, specagent lossless with the draft model with eager steps, and the same with
compiled steps on both models (forced on, whatever the decision, to see what it would buy);
each output checked against plain greedy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent import Policy, RuntimeOptions, SpecRuntime
from specagent.chat import render_prompt
from specagent.engines.transformers import ModelRunner
from specagent.engines.transformers.compiled import WIDTHS, choose_compiled_step
from specagent.machine import ProbeStore
from specagent.measuring.baselines import baseline_methods
from specagent.measuring.bench import PROMPTS
from specagent.measuring.records import dtypes_of, write_result

POLICY = Policy(
    name="lossless-draft_model",
    description="bench",
    mode="lossless",
    drafter={"kind": "draft_model", "num_speculative_tokens": 20},
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", nargs="*", default=None, help="bench prompt names")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    started = time.perf_counter()

    eager = SpecRuntime.from_pretrained(
        args.target, args.draft, policies=[POLICY], engine_options={"compile_steps": False}
    )
    steps: dict[str, Any] = {}
    vocab = eager.vocab_size
    for role, model in (("target", eager.target), ("draft", eager.draft)):
        for context in (64, 1024):
            # The measurement choose_compiled_step makes at load, on a runner of its own.
            runner = ModelRunner(model, vocab_size=vocab, slots=True)
            choice = choose_compiled_step(runner, key="", store=None, context_tokens=context)
            steps[f"{role}, {context}-token context"] = choice.to_json()
            print(role, context, choice.reason, f"(compiled in {choice.compile_seconds} s)")

    # A runtime built as on a machine that recorded compiled steps as faster (forced here, to
    # see what they would do end to end).
    recorded = ProbeStore(Path(tempfile.mkdtemp()))
    # (The eager runtime's runners name the keys the engine looks up for these models.)
    for runner in (eager._decoder.target_runner, eager._decoder.draft_runner):
        assert runner is not None
        key = runner.speed_key()
        recorded.put(f"compiled-step:{key}", {"compiled": True, "reason": "forced"})
    compiled = SpecRuntime(
        eager.target,
        eager.draft,
        eager.tokenizer,
        policies=[POLICY],
        device=eager.device,
        options=RuntimeOptions(probe_store=recorded),
    )
    assert all(choice["compiled"] for choice in compiled.compiled_steps.values())

    plain = baseline_methods(eager, args.max_new_tokens)["plain"]
    names = args.prompts or list(PROMPTS)
    n = args.max_new_tokens

    def run(rt: SpecRuntime, ids: list[int]) -> tuple[list[int], float]:
        start = time.perf_counter()
        out = rt.generate_sync(ids, policy=POLICY.name, max_new_tokens=n)
        return out.token_ids, time.perf_counter() - start

    warm = render_prompt(
        [{"role": "user", "content": "Hi"}], eager.tokenizer, vocab_size=eager.vocab_size
    )
    for rt in (eager, compiled):
        run(rt, warm)
        rt.wait_measured()
    rows: dict[str, Any] = {}
    for name in names:
        ids = render_prompt(PROMPTS[name], eager.tokenizer, vocab_size=eager.vocab_size)
        start = time.perf_counter()
        reference, _ = plain(ids, 0)
        plain_s = time.perf_counter() - start
        eager_tokens, eager_s = run(eager, ids)
        compiled_tokens, compiled_s = run(compiled, ids)
        rows[name] = {
            "tokens": len(reference),
            "plain_seconds": round(plain_s, 2),
            "eager_seconds": round(eager_s, 2),
            "compiled_seconds": round(compiled_s, 2),
            "eager_vs_plain": round(plain_s / eager_s, 3),
            "compiled_vs_plain": round(plain_s / compiled_s, 3),
            "compiled_vs_eager": round(eager_s / compiled_s, 3),
            "eager_equal_to_plain": eager_tokens == reference,
            "compiled_equal_to_plain": compiled_tokens == reference,
        }
        print(name, rows[name])
    eager.close()
    compiled.close()
    result = {
        "target": args.target,
        "draft": args.draft,
        "precision": dtypes_of(eager),
        "compiled_widths": list(WIDTHS),
        "max_new_tokens": n,
        "step_decision": steps,
        "end_to_end": rows,
    }
    path = write_result(result, args.out, f"compiled-steps_{Path(args.target).name}", started)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
