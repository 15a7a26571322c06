"""GPU benchmark in one go: step costs, predicted speed-up, and loop overhead against
transformers' assisted generation, on a real draft/target architecture pair.

Only ~64 MiB travels to the GPU machine, so weights are random: models are built from the real
configs of Qwen2.5-7B-Instruct (target) and Qwen2.5-0.5B-Instruct (draft), in bf16. Timings of
forwards do not depend on the weights' values; acceptance does, so it is controlled instead:

1. step costs: target forward over n = 1..9 new tokens after a 512-token context, draft step;
2. the speed-up these costs predict for per-token acceptance a = 0.5..0.9 (best k per a);
3. loop overhead: with the target as its own draft (acceptance 1.0) and with the random 0.5B
   draft (acceptance ~0), tokens/s of plain ``generate``, transformers assisted generation and
   specagent, same prompts, same process; plus prompt lookup on a repetitive prompt;
4. greedy equality of specagent's output with plain greedy decoding;
5. compiled forwards (``engines.transformers.compiled``: fixed-shape forwards over the KV
   slots, CUDA graphs on CUDA): each model's single-token step eager against compiled, as
   ``SpecRuntime(compile_steps=True)`` decides, and specagent with the draft model end to end
   with compiled forwards on both models against eager, outputs compared, each draft decided
   on the device and read once (the default on a GPU) against read token by token, with the
   host's waits for the device per generated token counted (CUDA's sync debug mode);
6. streams: plain greedy calls through the public runtime (each call's KV in a slot of the
   runner's pool, concurrent calls in one batched forward per round), one call and 16 at once,
   eager and compiled, against transformers' ``generate`` with a static cache (which compiles
   its step on CUDA) on one prompt and on the 16 as a batch; one call's tokens against
   transformers' greedy ones.

    python benchmarks/gpu_step_costs.py --out benchmarks/results/gpu-step-costs_h200.json
    python benchmarks/gpu_step_costs.py --tiny   # a CPU smoke run of the same code paths
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from batched_decode import PLAIN, specagent_seconds, transformers_seconds

from specagent import RuntimeOptions, SpecRuntime
from specagent.decoding.costs import CostModel, expected_tokens, measure_costs
from specagent.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specagent.decoding.engine import crop_to
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import AdaptiveSchedule, FixedSchedule
from specagent.engines.transformers import ModelRunner
from specagent.engines.transformers.compiled import choose_compiled_step
from specagent.machine import ProbeStore

# Real configs (config.json of the Qwen2.5 instruct checkpoints), written out: no hub here.
QWEN_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
QWEN_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 152064,  # the 0.5B checkpoint has 151936 rows; padded to the target's so
    # transformers' assisted generation accepts the pair (same tokenizer, same ids)
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY_TARGET = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
TINY_DRAFT = dict(TINY_TARGET, num_hidden_layers=1)


def build(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    torch.manual_seed(seed)
    cfg = Qwen2Config(**config, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_costs(target: Any, draft: Any, device: torch.device, context: int, repeats: int) -> dict:
    t_runner, d_runner = (
        ModelRunner(target),
        ModelRunner(draft, vocab_size=ModelRunner(target).vocab_size),
    )
    prompt = torch.randint(3, 1000, (context,)).tolist()

    def forward_cost(runner: ModelRunner, n: int) -> float:
        cache = runner.new_cache()
        runner.forward(prompt, cache, keep=1)
        new = prompt[:n]

        def once() -> None:
            runner.forward(new, cache)
            crop_to(cache, context)

        return timed(once, device, repeats)

    target_ms = {n: 1000 * forward_cost(t_runner, n) for n in range(1, 10)}
    draft_ms = 1000 * forward_cost(d_runner, 1)
    unit = target_ms[1]
    costs = CostModel(
        draft_step=draft_ms / unit, verify=tuple(target_ms[n] / unit for n in range(1, 10))
    )
    predicted = {}
    for a in (0.5, 0.6, 0.7, 0.8, 0.9):
        rates = {k: expected_tokens(a, k) / costs.step_cost(k) for k in range(0, 9)}
        best = max(rates, key=lambda k: rates[k])
        predicted[str(a)] = {
            "best_k": best,
            "speedup_vs_plain": round(rates[best], 3),
            "speedup_k4": round(rates[4], 3),
        }
    return {
        "context_tokens": context,
        "target_forward_ms": {str(n): round(v, 3) for n, v in target_ms.items()},
        "target_forward_relative": {str(n): round(v / unit, 3) for n, v in target_ms.items()},
        "draft_step_ms": round(draft_ms, 3),
        "draft_step_relative": round(draft_ms / unit, 3),
        "predicted": predicted,
        "measured_cost_model": {"draft_step": costs.draft_step, "verify": list(costs.verify)},
    }


def hf_generate(model: Any, ids: list[int], new: int, **kwargs: Any) -> list[int]:
    inputs = torch.tensor([ids], device=model.device)
    out = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        **kwargs,
    )
    return out[0, len(ids) :].tolist()


def spec_generate(
    target_runner: ModelRunner, ids: list[int], new: int, drafter: Any, schedule: Any
) -> tuple[list[int], Any]:
    events = list(
        speculative_generate(
            target_runner,
            ids,
            params=SamplingParams(0.0),
            generator=make_generator(0, target_runner.device),
            max_new_tokens=new,
            drafter=drafter,
            schedule=schedule,
        )
    )
    return events[-1].output_ids, events[-1].counters


def loop_overhead(target: Any, draft: Any, device: torch.device, new: int, repeats: int) -> dict:
    vocab = ModelRunner(target).vocab_size
    t_runner = ModelRunner(target)
    prompt = torch.randint(3, 1000, (128,)).tolist()
    rows: dict[str, Any] = {}
    reference = hf_generate(target, prompt, new)

    def record(name: str, fn: Any, output: list[int] | None = None, counters: Any = None) -> None:
        try:
            seconds = timed(fn, device, repeats)
        except Exception as exc:  # one failing baseline must not lose the other rows
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            return
        row = {"tokens_per_s": round(new / seconds, 2), "seconds": round(seconds, 4)}
        if output is not None:
            row["greedy_equal_to_plain"] = output == reference
        if counters is not None:
            row["acceptance_rate"] = round(counters.acceptance_rate, 3)
            row["mean_acceptance_length"] = round(counters.mean_acceptance_length, 3)
        rows[name] = row

    record("plain_generate", lambda: hf_generate(target, prompt, new))
    # Acceptance 1.0: the target drafts for itself. Any gap to the ideal is loop overhead.
    record(
        "hf_assisted_self_k4",
        lambda: hf_generate(
            target,
            prompt,
            new,
            assistant_model=target,
            num_assistant_tokens=4,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        ),
    )
    self_runner = ModelRunner(target, vocab_size=vocab)
    out, counters = spec_generate(
        t_runner, prompt, new, DraftModelDrafter(self_runner), FixedSchedule(4)
    )
    record(
        "specagent_self_k4",
        lambda: spec_generate(
            t_runner, prompt, new, DraftModelDrafter(self_runner), FixedSchedule(4)
        ),
        out,
        counters,
    )
    # Acceptance ~0: a random 0.5B draft. Speculation cannot pay; adaptive k must notice.
    d_runner = ModelRunner(draft, vocab_size=vocab)
    record("hf_assisted_draft05b", lambda: hf_generate(target, prompt, new, assistant_model=draft))
    out, counters = spec_generate(
        t_runner, prompt, new, DraftModelDrafter(d_runner), FixedSchedule(4)
    )
    record(
        "specagent_draft05b_k4",
        lambda: spec_generate(t_runner, prompt, new, DraftModelDrafter(d_runner), FixedSchedule(4)),
        out,
        counters,
    )
    costs = measure_costs(t_runner, d_runner, 5)
    out, counters = spec_generate(
        t_runner, prompt, new, DraftModelDrafter(d_runner), AdaptiveSchedule(max_k=4, costs=costs)
    )
    record(
        "specagent_draft05b_adaptive",
        lambda: spec_generate(
            t_runner,
            prompt,
            new,
            DraftModelDrafter(d_runner),
            AdaptiveSchedule(max_k=4, costs=costs),
        ),
        out,
        counters,
    )
    # Prompt lookup on a repetitive prompt (random models loop, so lookup finds matches).
    record("hf_prompt_lookup", lambda: hf_generate(target, prompt, new, prompt_lookup_num_tokens=4))
    out, counters = spec_generate(t_runner, prompt, new, PromptLookupDrafter(), FixedSchedule(4))
    record(
        "specagent_prompt_lookup_k4",
        lambda: spec_generate(t_runner, prompt, new, PromptLookupDrafter(), FixedSchedule(4)),
        out,
        counters,
    )
    base = rows["plain_generate"]["tokens_per_s"]
    for row in rows.values():
        if "tokens_per_s" in row:
            row["speedup_vs_plain"] = round(row["tokens_per_s"] / base, 3)
    for ours, theirs in (
        ("specagent_self_k4", "hf_assisted_self_k4"),
        ("specagent_draft05b_adaptive", "hf_assisted_draft05b"),
        ("specagent_prompt_lookup_k4", "hf_prompt_lookup"),
    ):
        if "tokens_per_s" in rows[ours] and "tokens_per_s" in rows[theirs]:
            rows[f"ratio_{ours}_vs_{theirs}"] = round(
                rows[ours]["tokens_per_s"] / rows[theirs]["tokens_per_s"], 3
            )
    return rows


def compiled_steps(target: Any, draft: Any, device: torch.device, new: int) -> dict:
    """What compiled forwards over slots buy here, and whether they keep the tokens."""
    vocab = ModelRunner(target).vocab_size
    runners = {
        "target": ModelRunner(target, slots=True),
        "draft": ModelRunner(draft, vocab_size=vocab, slots=True),
    }
    out: dict[str, Any] = {
        role: choose_compiled_step(runner, key="", store=None, context_tokens=512).to_json()
        for role, runner in runners.items()
    }
    ids = [(i * 7919) % (vocab - 1) + 1 for i in range(256)]
    schedule = FixedSchedule(4)
    results = {}
    # Eager forwards; compiled ones with the draft read token by token on the host; compiled
    # ones with each draft decided on the device and read once (the default on a GPU).
    for mode, compiled, on_device in (
        ("eager", False, False),
        ("compiled_host_drafts", True, False),
        ("compiled", True, True),
    ):
        # A pair of runners per mode, as an engine builds them with and without the decision.
        runners = {
            "target": ModelRunner(target, slots=True),
            "draft": ModelRunner(draft, vocab_size=vocab, slots=True),
        }
        if compiled:
            for runner in runners.values():
                runner._use_compiled(runner.compiler())  # the decision, forced for the experiment

        def decode(runners: dict = runners, on_device: bool = on_device) -> list[int]:
            drafter = DraftModelDrafter(runners["draft"], on_device=on_device)
            return spec_generate(runners["target"], ids, new, drafter, schedule)[0]

        decode()  # warm-up (compiles)
        syncs = device_syncs(decode, device)
        sync(device)
        start = time.perf_counter()
        tokens = decode()
        sync(device)
        results[mode] = (tokens, time.perf_counter() - start, syncs)
    out["end_to_end"] = {
        **{
            f"{mode}_tokens_per_s": round(new / seconds, 2)
            for mode, (_, seconds, _) in results.items()
        },
        **{
            f"{mode}_device_syncs_per_token": round(syncs / new, 2) if syncs is not None else None
            for mode, (_, _, syncs) in results.items()
        },
        "compiled_equal_to_eager": results["compiled"][0] == results["eager"][0],
        "host_drafts_equal_to_device_drafts": (
            results["compiled_host_drafts"][0] == results["compiled"][0]
        ),
    }
    return out


def device_syncs(fn: Any, device: torch.device) -> int | None:
    """How often ``fn`` made the host wait for the GPU (CUDA's sync debug mode warns at each
    synchronising operation: a read of a device value, a blocking copy); None off CUDA."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def streams(target: Any, device: torch.device, new: int, calls: int, repeats: int) -> dict:
    """Tokens/s of one call and of ``calls`` at once, specagent (eager and compiled forwards)
    against transformers."""
    runtime = SpecRuntime(
        target, policies=[PLAIN], device=device.type, options=RuntimeOptions(prefix_cache_tokens=0)
    )
    runtime.eos_token_ids = []  # random weights: every call runs to its length
    # A runtime as on a machine that recorded compiled forwards as faster (forced here).
    recorded = ProbeStore(Path(tempfile.mkdtemp()))
    assert runtime._decoder.target_runner is not None
    key = runtime._decoder.target_runner.speed_key()
    recorded.put(f"compiled-step:{key}", {"compiled": True, "reason": "forced"})
    compiled = SpecRuntime(
        target,
        policies=[PLAIN],
        device=device.type,
        options=RuntimeOptions(prefix_cache_tokens=0, probe_store=recorded),
    )
    compiled.eos_token_ids = []
    batch = [[(i * 131 + j * 7) % 1000 + 3 for j in range(128)] for i in range(calls)]
    methods = {
        "specagent_1": (1, lambda: specagent_seconds(runtime, batch[:1], new)),
        f"specagent_{calls}": (calls, lambda: specagent_seconds(runtime, batch, new)),
        "specagent_compiled_1": (1, lambda: specagent_seconds(compiled, batch[:1], new)),
        f"specagent_compiled_{calls}": (calls, lambda: specagent_seconds(compiled, batch, new)),
        "transformers_static_1": (1, lambda: transformers_seconds(target, batch[:1], new)),
        f"transformers_static_{calls}": (calls, lambda: transformers_seconds(target, batch, new)),
    }
    rows: dict[str, Any] = {}
    for name, (n, fn) in methods.items():
        try:
            seconds = timed(fn, device, repeats)
        except Exception as exc:  # one failing method must not lose the other rows
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        rows[name] = {"seconds": round(seconds, 4), "tokens_per_s": round(n * new / seconds, 2)}

    def ratio(a: str, b: str) -> float | None:
        if "tokens_per_s" not in rows[a] or "tokens_per_s" not in rows[b]:
            return None
        return round(rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"], 3)

    for ours in ("specagent", "specagent_compiled"):
        rows[f"{ours}_{calls}_vs_1"] = ratio(f"{ours}_{calls}", f"{ours}_1")
        rows[f"{ours}_vs_transformers_static_1"] = ratio(f"{ours}_1", "transformers_static_1")
        rows[f"{ours}_vs_transformers_static_{calls}"] = ratio(
            f"{ours}_{calls}", f"transformers_static_{calls}"
        )
    compiled_one = compiled.generate_sync(
        batch[0], policy="plain", max_new_tokens=new, temperature=0.0
    )
    ours = runtime.generate_sync(batch[0], policy="plain", max_new_tokens=new, temperature=0.0)
    theirs = hf_generate(target, batch[0], new, cache_implementation="static")
    differs_at = next(
        (i for i, (a, b) in enumerate(zip(ours.token_ids, theirs, strict=True)) if a != b), None
    )
    rows["greedy_equal_to_transformers"] = differs_at is None
    rows["first_difference_at"] = differs_at  # bf16 near-ties may part the two after a while
    rows["compiled_equal_to_eager"] = compiled_one.token_ids == ours.token_ids
    runtime.close()
    compiled.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models (a CPU smoke run)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_cfg, draft_cfg = (TINY_TARGET, TINY_DRAFT) if args.tiny else (QWEN_7B, QWEN_05B)
    started = time.time()
    target = build(target_cfg, device, dtype, seed=0)
    draft = build(draft_cfg, device, dtype, seed=1)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "target": "Qwen2.5-7B config (random weights)" if not args.tiny else "tiny",
        "draft": "Qwen2.5-0.5B config (random weights)" if not args.tiny else "tiny",
    }
    with torch.inference_mode():
        report["step_costs"] = step_costs(target, draft, device, 512, args.repeats)
        print(json.dumps(report["step_costs"], indent=1), flush=True)
        report["loop"] = loop_overhead(target, draft, device, args.new_tokens, args.repeats)
        print(json.dumps(report["loop"], indent=1), flush=True)
        report["compiled_steps"] = compiled_steps(target, draft, device, args.new_tokens)
        print(json.dumps(report["compiled_steps"], indent=1), flush=True)
    report["streams"] = streams(target, device, args.new_tokens, 16, args.repeats)
    print(json.dumps(report["streams"], indent=1), flush=True)
    report["wall_s"] = round(time.time() - started, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
