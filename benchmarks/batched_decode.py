"""Batched decoding on the transformers engine: what one output token costs when 16 calls decode
together, at a short and at an agent-sized context, against transformers' own batched
``generate`` over a static cache, on the same model in the same process.

The model is small enough that a step is bound by the framework, not by arithmetic (as a GPU
step is): a seeded random Llama, 12 layers, hidden 256. specagent runs 16 concurrent greedy calls
through the public runtime (plain steps: the cost of a batched round, not of drafting), with each
call's KV in the runner's slot pool (``kv_slots=True``, the default), the same with compiled
forwards over the slots (``engines.transformers.compiled``, forced on), and in an ordinary cache
per call (``kv_slots=False``); transformers runs the same 16 prompts as one left-padded batch
with ``cache_implementation="static"``. The cost of one output token is timed over the decode
phase alone: for specagent from the moment every call has its first token (the prompts run
first, one forward each) to the last token, over the tokens emitted in that span; for
transformers from its first generated step to its last (a streamer's timestamps). Prefills of
16 x 2,048 tokens swing by seconds between rounds here, so they are left out rather than
subtracted. Methods take turns, five rounds, medians.

Speculative rounds verify several tokens per call under a per-row mask, which for a
grouped-query model is where transformers' sdpa attention copies every key/value head per query
head. The second part runs the same 16 calls with a draft model (a copy of the target, k = 4
fixed: every round a 5-token verification per call) and times the model's attention as the
runner chose it (``engines.transformers.attention``: grouped heads in place, where that measured
faster) against transformers' sdpa, the two taking turns; a batched verification alone (16
calls x 5 tokens over their slots) is timed the same way, without the prefill's noise.

    python benchmarks/batched_decode.py            # contexts 32 and 2048, 16 calls
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from specagent import Policy, RuntimeOptions, SpecRuntime
from specagent.engines.transformers import ModelRunner
from specagent.machine import ProbeStore
from specagent.measuring.records import write_result

PLAIN = Policy(
    name="plain", description="plain greedy steps", mode="lossless", drafter={"kind": "none"}
)
DRAFTED = Policy(
    name="drafted",
    description="a draft model proposing 4 tokens every round",
    mode="lossless",
    drafter={
        "kind": "draft_model",
        "num_speculative_tokens": 4,
        "adaptive": False,
        "confidence_threshold": 0.0,
        "lookup_guesses": False,
    },
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


def specagent_seconds(
    runtime: SpecRuntime, batch: list[list[int]], new_tokens: int, policy: str = "plain"
) -> float:
    async def run() -> float:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt in batch:
                tg.start_soon(
                    lambda p=prompt: runtime.generate(
                        p, policy=policy, max_new_tokens=new_tokens, temperature=0.0
                    )
                )
        return time.perf_counter() - start

    return anyio.run(run)


def specagent_decode(
    runtime: SpecRuntime, batch: list[list[int]], new_tokens: int, policy: str = "plain"
) -> float:
    """Seconds per output token while every call decodes: from the last call's first token
    to the last token of all, over the tokens emitted in between."""

    async def run() -> float:
        firsts: list[float] = []
        stamps: list[tuple[float, int]] = []

        async def one(prompt: list[int]) -> None:
            seen = False
            async for chunk in runtime.stream(
                prompt, policy=policy, max_new_tokens=new_tokens, temperature=0.0
            ):
                if chunk.token_ids:
                    now = time.perf_counter()
                    if not seen:
                        firsts.append(now)
                        seen = True
                    stamps.append((now, len(chunk.token_ids)))

        async with anyio.create_task_group() as tg:
            for prompt in batch:
                tg.start_soon(one, prompt)
        start = max(firsts)
        end = max(at for at, _ in stamps)
        tokens = sum(n for at, n in stamps if at > start)
        return (end - start) / max(tokens, 1)

    return anyio.run(run)


class _StepTimes(BaseStreamer):
    """When transformers' ``generate`` hands out each step's tokens (the first put is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


def transformers_decode(model: Any, batch: list[list[int]], new_tokens: int) -> float:
    """Seconds per output token of transformers' batched static-cache ``generate`` after its
    first generated step."""
    steps = _StepTimes()
    static_generate(model, batch, new_tokens, streamer=steps)
    first, last = steps.times[1], steps.times[-1]  # [0]: the prompt
    return (last - first) / ((len(steps.times) - 2) * len(batch))


def static_generate(
    model: Any, batch: list[list[int]], new_tokens: int, streamer: Any = None
) -> None:
    """transformers' greedy batched ``generate`` over a static cache, exactly ``new_tokens``."""
    ids = torch.tensor(batch, device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
            streamer=streamer,
        )
    assert out.shape[1] == ids.shape[1] + new_tokens


def transformers_seconds(model: Any, batch: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    static_generate(model, batch, new_tokens)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def per_token_rounds(
    methods: dict[str, Any], batch: list[list[int]], tokens: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per output token of each method, a value per round (methods taking turns)."""
    for method in methods.values():
        method(batch, 4)  # warm up (and compile every batch size a round meets)
    per_token: dict[str, list[float]] = {name: [] for name in methods}
    for round_index in range(rounds):
        order = list(methods) if round_index % 2 == 0 else list(methods)[::-1]
        for name in order:
            per_token[name].append(methods[name](batch, tokens))
    return per_token


def summary(per_token: dict[str, list[float]], reference: str) -> dict[str, Any]:
    medians = {name: statistics.median(values) for name, values in per_token.items()}
    return {
        "ms_per_token": {name: round(v * 1000, 3) for name, v in medians.items()},
        "rounds_ms_per_token": {
            name: [round(v * 1000, 3) for v in values] for name, values in per_token.items()
        },
        f"vs_{reference}": {name: round(v / medians[reference], 2) for name, v in medians.items()},
    }


def verification_rounds(contexts: list[int], calls: int, rounds: int) -> dict[str, Any]:
    """One batched verification (5 tokens per call over its slot) timed alone: the runner's
    attention against transformers' sdpa, alternating, milliseconds per round (medians)."""
    model = small_llama()
    runner = ModelRunner(model, slots=True)
    chosen = runner.attention or "sdpa"
    out: dict[str, Any] = {"chosen_attention": chosen}
    for context in contexts:
        sequences = [runner.new_cache() for _ in range(calls)]
        for prompt, sequence in zip(prompts(calls, context), sequences, strict=True):
            runner.forward(prompt, sequence, keep=1)
        times: dict[str, list[float]] = {chosen: [], "sdpa": []}
        for round_index in range(2 * rounds + 1):
            for name in list(times) if round_index % 2 == 0 else list(times)[::-1]:
                model.config._attn_implementation = name
                start = time.perf_counter()
                runner.forward_batch([([7] * 5, s) for s in sequences], keep=[5] * calls)
                if round_index:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
                for sequence in sequences:
                    sequence.crop(context)
        medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
        out[str(context)] = {
            "ms_per_round": {name: round(ms, 2) for name, ms in medians.items()},
            "vs_sdpa": round(medians[chosen] / medians["sdpa"], 3),
        }
        print("verification round", context, out[str(context)], flush=True)
    model.config._attn_implementation = chosen
    return out


def drafted_rounds(contexts: list[int], calls: int, tokens: int, rounds: int) -> dict[str, Any]:
    """16 calls with a draft model at k = 4: the runner's attention against transformers' sdpa
    (switched between rounds on both models; the runners read it at every forward)."""
    target = small_llama()
    draft = copy.deepcopy(target)
    runtime = SpecRuntime(
        target,
        draft,
        policies=[DRAFTED],
        device="cpu",
        options=RuntimeOptions(prefix_cache_tokens=0),
    )
    runtime.eos_token_ids = []
    specagent_seconds(runtime, prompts(2, 32), 2, policy="drafted")
    runtime.wait_measured()
    chosen = target.config._attn_implementation

    def with_attention(name: str) -> Any:
        def run(batch: list[list[int]], new_tokens: int) -> float:
            for model in (target, draft):
                model.config._attn_implementation = name
            return specagent_decode(runtime, batch, new_tokens, policy="drafted")

        return run

    methods = {
        f"attention_{chosen}": with_attention(chosen),
        "attention_sdpa": with_attention("sdpa"),
    }
    out: dict[str, Any] = {"chosen_attention": chosen}
    for context in contexts:
        per_token = per_token_rounds(methods, prompts(calls, context), tokens, rounds)
        out[str(context)] = summary(per_token, "attention_sdpa")
        print("drafted", context, out[str(context)]["ms_per_token"], flush=True)
    runtime.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 2048])
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=160, help="new tokens per call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    started = time.perf_counter()
    model = small_llama()
    runtimes = {
        name: SpecRuntime(
            model,
            policies=[PLAIN],
            device="cpu",
            options=RuntimeOptions(prefix_cache_tokens=0),
            engine_options={"kv_slots": slots},
        )
        for name, slots in (("specagent_slots", True), ("specagent_per_call_caches", False))
    }
    # The slots with compiled forwards, as on a machine that recorded them as faster (forced).
    recorded = ProbeStore(Path(tempfile.mkdtemp()))
    key = runtimes["specagent_slots"]._decoder.target_runner.speed_key()  # type: ignore[union-attr]
    recorded.put(f"compiled-step:{key}", {"compiled": True, "reason": "forced"})
    runtimes["specagent_slots_compiled"] = SpecRuntime(
        model,
        policies=[PLAIN],
        device="cpu",
        options=RuntimeOptions(prefix_cache_tokens=0, probe_store=recorded),
    )
    for runtime in runtimes.values():
        runtime.eos_token_ids = []
        specagent_seconds(runtime, prompts(2, 32), 2)
        runtime.wait_measured()  # the step-cost measurement runs between rounds: not in them
    methods = {
        **{name: (lambda b, n, rt=rt: specagent_decode(rt, b, n)) for name, rt in runtimes.items()},
        "transformers_static_generate": lambda b, n: transformers_decode(model, b, n),
    }
    tokens = args.tokens
    result: dict[str, Any] = {"calls": args.calls, "tokens": tokens, "contexts": {}}
    for context in args.contexts:
        per_token = per_token_rounds(methods, prompts(args.calls, context), tokens, args.rounds)
        result["contexts"][str(context)] = summary(per_token, "transformers_static_generate")
        print(context, result["contexts"][str(context)]["ms_per_token"], flush=True)
    for runtime in runtimes.values():
        runtime.close()
    result["verification_round"] = verification_rounds(args.contexts, args.calls, args.rounds)
    result["drafted"] = drafted_rounds(args.contexts, args.calls, tokens, args.rounds)
    path = write_result(
        result, args.out, f"batched-decode_llama-12x256_{args.calls}-calls", started
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
