"""Replay the agent episodes' drafting against recorded target outputs, with the measured step
costs: how many target forwards (and how wide) and how many draft forwards each drafting method
needs, and what that costs in single-token target steps, without the host's drift.

    python benchmarks/replay_agent_drafting.py record TRACES.json   # real target, ~7 min on CPU
    python benchmarks/replay_agent_drafting.py replay TRACES.json   # draft model only, ~3 min
    python benchmarks/replay_agent_drafting.py record TRACES.json --workload prompts \
        --max-new-tokens 48                                         # 13 single prompts
    python benchmarks/replay_agent_drafting.py record TRACES.json \
        --target qwen2.5-coder-1.5b-instruct --engine llama.cpp     # the GGUF, no draft

``record`` runs every episode through the public runtime (``lossless-auto`` with prefix reuse,
as ``specagent bench --workload agent`` does) and keeps each turn's prompt, output and stats;
with ``--workload prompts``, single prompts (the bench's and the evaluation set's), each an
episode of one turn with the runtime's plain greedy output (replayed one after another under
one tenant, as a tenant's unrelated calls would be).
``replay`` runs the decoding loop again with the real drafters (the real draft model, history,
schedules and measured costs) against an oracle target that answers every verification with the
recorded output: in greedy lossless decoding the target's verdict on a draft depends only on the
output it would produce, so the steps taken, draft forwards run and tokens accepted are those of
a real run (up to the draft's own rounding on this machine). Transformers' prompt lookup is
replayed by its own candidate rule (earliest match of the last 2 tokens, else 1; 6 tokens).
The agent bench's policies are replayed as shipped and once more with token trees on
(``lossless-auto-trees``): the oracle answers a tree's rows by their depth, which is all a
greedy walk reads.

Costs are in single-token target steps (``CostModel``: measured on this machine and stored);
prefills are left out, as every specagent method reuses the same prefixes. A guide for choosing
between drafting rules; the bench's timed ratios are what the project reports.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent import Policy, RuntimeOptions, SpecRuntime
from specagent.catalog import PAIRS
from specagent.chat import render_prompt
from specagent.decoding.costs import CostModel
from specagent.decoding.engine import ForwardInputs
from specagent.decoding.loop import DecodeCounters, speculative_generate
from specagent.decoding.proposal import row_depths
from specagent.decoding.registry import DRAFTERS
from specagent.decoding.sampling import SamplingParams
from specagent.machine import machine_info
from specagent.measuring.agent_bench import (
    _run_episode,
    _spec_method,
    agent_policies,
    load_episodes,
)
from specagent.measuring.bench import PROMPTS
from specagent.measuring.evaluation.prompts import load_prompt_set
from specagent.measuring.records import dtypes_of
from specagent.runtime.memory import PrefixCache

TENANT = "replay"


def record(
    path: Path,
    max_new_tokens: int,
    workload: str = "agent",
    models: tuple[str, str | None] = PAIRS["qwen2.5-coder"],
    engine: str = "transformers",
) -> None:
    target, draft = models
    runtime = SpecRuntime.from_pretrained(
        target,
        draft,
        policies=agent_policies(draft is not None),
        engine=engine,
        options=RuntimeOptions(prefix_cache_tokens=65536),
    )
    runtime.wait_measured(timeout=3600)
    method = _spec_method(runtime, "lossless-auto", max_new_tokens, reuse=True)
    method([1, 2, 3], 0)  # warm up
    started = time.perf_counter()
    if workload == "prompts":
        episodes = record_prompts(runtime, max_new_tokens)
    else:
        episodes = record_episodes(runtime, method)
    data = {
        "target": target,
        "draft": draft,
        "engine": runtime.engine,
        "max_new_tokens": max_new_tokens,
        "eos_token_ids": list(runtime.eos_token_ids),
        "precision": dtypes_of(runtime),
        "machine": machine_info(),
        "seconds": round(time.perf_counter() - started, 1),
        "episodes": episodes,
    }
    path.write_text(json.dumps(data))
    print(f"wrote {path}")


def record_episodes(runtime: SpecRuntime, method: Any) -> dict[str, list[dict[str, Any]]]:
    """The agent episodes, each turn's prompt and output through ``method``."""
    episodes = {}
    for episode in load_episodes():
        if runtime.prefix_cache is not None:
            runtime.prefix_cache.clear()
        turns, outputs, prompts, _ = _run_episode(runtime, episode, method, 0)
        episodes[episode.id] = [
            {
                "prompt": prompt,
                "output": output,
                "seconds": turn.seconds,
                "accepted_by_source": turn.accepted_by_source,
                "mean_acceptance_length": turn.mean_acceptance_length,
            }
            for turn, output, prompt in zip(turns, outputs, prompts, strict=True)
        ]
        print(episode.id, [t.seconds for t in turns], flush=True)
    return episodes


def record_prompts(runtime: SpecRuntime, max_new_tokens: int) -> dict[str, list[dict[str, Any]]]:
    """Single prompts (the bench's five and the evaluation set's eight), each an episode of one
    turn: its prompt and the runtime's plain greedy output (``lossless-plain``)."""
    prompts = dict(PROMPTS)
    prompts.update({p.id: p.messages for p in load_prompt_set()})
    episodes = {}
    for name, messages in prompts.items():
        ids = render_prompt(messages, runtime.tokenizer, vocab_size=runtime.vocab_size)
        result = runtime.generate_sync(ids, policy="lossless-plain", max_new_tokens=max_new_tokens)
        episodes[name] = [{"prompt": ids, "output": result.token_ids}]
        print(name, f"{result.stats.latency_s:.1f}s", flush=True)
    return episodes


class PositionCache:
    """What the oracle target keeps of a call: how many positions it has seen (no KV)."""

    def __init__(self) -> None:
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        self.length = self.length + length if length < 0 else length


class OracleTarget:
    """A target whose next token after every position is the recorded output's (then EOS):
    greedy verification against it accepts exactly what the real target would. Records the
    width of every decoding forward: the rows it verifies (a call's first forward also feeds
    the prompt before them, which is left out, as prefills are)."""

    inputs = ForwardInputs(trees=True)

    def __init__(self, reference: list[int], vocab_size: int, eos: int) -> None:
        self.reference = reference
        self.vocab_size = vocab_size
        self.eos = eos
        self.device = torch.device("cpu")
        self.widths: list[int] = []

    def new_cache(self) -> PositionCache:
        return PositionCache()

    def kept(self, cache: PositionCache, copied: bool) -> PositionCache:
        return copy.deepcopy(cache) if copied else cache

    def keep_path(self, cache: PositionCache, start: int, path: list[int]) -> None:
        cache.length = start + 1 + len(path)  # no KV to move: the accepted path's positions

    def forward(
        self,
        input_ids: list[int],
        cache: PositionCache,
        keep: int | None = None,
        tree: list[int] | None = None,
        vocab: torch.Tensor | None = None,
    ) -> Any:
        start = cache.length
        cache.length += len(input_ids)
        rows = len(input_ids) if keep is None else keep
        # Each row's depth past the first fed token (a token tree's rows sit at their depth).
        depths = row_depths(tree) if tree is not None else list(range(len(input_ids)))
        logits = torch.zeros(rows, self.vocab_size)
        for i in range(rows):
            after = start + depths[len(input_ids) - rows + i] + 1
            token = self.reference[after] if after < len(self.reference) else self.eos
            logits[i, token] = 1.0
        self.widths.append(rows)
        return logits


@dataclasses.dataclass
class Replayed:
    """One turn's (or a sum of turns') forwards and their cost in single-token target steps."""

    target_units: float = 0.0
    draft_units: float = 0.0
    target_forwards: int = 0
    draft_forwards: int = 0
    accepted: dict[str, int] = dataclasses.field(default_factory=dict)
    draft_widths: list[int] = dataclasses.field(default_factory=list)

    @property
    def units(self) -> float:
        return self.target_units + self.draft_units

    def add(self, other: Replayed) -> None:
        self.target_units += other.target_units
        self.draft_units += other.draft_units
        self.target_forwards += other.target_forwards
        self.draft_forwards += other.draft_forwards
        self.draft_widths.extend(other.draft_widths)
        for source, n in other.accepted.items():
            self.accepted[source] = self.accepted.get(source, 0) + n


def draft_forward_cost(costs: CostModel, width: int) -> float:
    """A draft forward over ``width`` tokens: the measured curve, past it the catch-up slope
    (as ``catch_up_pays`` prices it)."""
    if width <= len(costs.draft):
        return costs.draft_cost(width)
    return costs.draft_step + costs.catch_up_cost(width - 1)


def replay_specagent(
    runtime: SpecRuntime, policy: Policy, traces: dict[str, Any]
) -> dict[str, list[Replayed]]:
    """Every episode through the decoding loop with the policy's real drafter and schedule,
    the oracle target, the runtime's draft model, history and measured costs."""
    engine = runtime._decoder
    history = runtime.history
    draft = engine.draft_runner
    draft_widths: list[int] = []
    prompt_length = 0  # the turn's prompt: what a draft forward feeds of it is a prefill
    if draft is not None:
        real_forward = draft.forward

        def counted(input_ids: list[int], cache: Any, *rest: Any, **extra: Any) -> Any:
            # A call's first draft forward feeds the prompt not yet cached with its first
            # guesses; that part is a prefill, left out as the target's are.
            prefill = max(0, prompt_length - 1 - cache.get_seq_length())
            draft_widths.append(len(input_ids) - prefill)
            return real_forward(input_ids, cache, *rest, **extra)

        draft.forward = counted  # type: ignore[method-assign]
    kind = DRAFTERS[policy.drafter.kind]
    verify = engine.costs.measured(None)
    draft_costs = engine.costs.measured(draft) if draft is not None else verify
    eos = list(traces["eos_token_ids"])
    prefixes = PrefixCache(65536)
    key = (TENANT, policy.name)
    if history is not None:
        history.clear()
    out: dict[str, list[Replayed]] = {}
    try:
        for episode_id, turns in traces["episodes"].items():
            prefixes.clear()
            scoped = prefixes.scoped(TENANT)
            rows = out[episode_id] = []
            for turn in turns:
                prompt, output = turn["prompt"], turn["output"]
                prompt_length = len(prompt)
                oracle = OracleTarget([*prompt, *output], runtime.vocab_size, eos[0])
                parts = dataclasses.replace(
                    engine.parts,
                    prefixes=scoped,
                    call_end=len(prompt) + traces["max_new_tokens"],
                    history=history.indexes(key) if history is not None else (),
                )
                drafter, schedule = kind.build(policy.drafter, parts)
                draft_widths.clear()
                events = list(
                    speculative_generate(
                        oracle,  # type: ignore[arg-type]
                        prompt,
                        params=SamplingParams(temperature=0.0),
                        generator=torch.Generator().manual_seed(0),
                        max_new_tokens=traces["max_new_tokens"],
                        drafter=drafter,
                        schedule=schedule,
                        eos_token_ids=eos,
                    )
                )
                if drafter is not None:
                    drafter.leave_cache()
                produced = events[-1].output_ids
                if produced != output:
                    raise SystemExit(f"{episode_id}: the replay produced another output")
                if history is not None:
                    history.record(key, prompt, output)
                counters: DecodeCounters = events[-1].counters
                rows.append(
                    Replayed(
                        target_units=sum(verify.verify_cost(w) for w in oracle.widths),
                        draft_units=sum(draft_forward_cost(draft_costs, w) for w in draft_widths),
                        target_forwards=len(oracle.widths),
                        draft_forwards=len(draft_widths),
                        accepted=dict(counters.accepted_by_source),
                        draft_widths=list(draft_widths),
                    )
                )
    finally:
        if draft is not None:
            del draft.forward
    return out


def replay_hf_prompt_lookup(
    traces: dict[str, Any], verify: CostModel, tokens: int = 6, ngram: int = 2
) -> dict[str, list[Replayed]]:
    """Transformers' prompt lookup: the earliest earlier occurrence of the last ``ngram``
    tokens (then fewer), the ``tokens`` after it, cut at an EOS; verified by the target."""
    eos = set(traces["eos_token_ids"])
    stop = traces["eos_token_ids"][0]
    out: dict[str, list[Replayed]] = {}
    for episode_id, turns in traces["episodes"].items():
        rows = out[episode_id] = []
        for turn in turns:
            context, output = list(turn["prompt"]), turn["output"]
            end = len(context) + traces["max_new_tokens"]
            # What the target emits: the output, then the EOS that ended it (if one did).
            truth = [*output, *([stop] if len(output) < traces["max_new_tokens"] else [])]
            done, row = 0, Replayed()
            while done < len(truth):
                limit = min(tokens, end - len(context) - 1)
                candidate = earliest_continuation(context, limit, ngram)
                for i, token in enumerate(candidate):
                    if token in eos:
                        candidate = candidate[:i]
                        break
                accepted = 0
                while (
                    accepted < len(candidate)
                    and done + accepted < len(truth)
                    and candidate[accepted] == truth[done + accepted]
                ):
                    accepted += 1
                row.target_units += verify.verify_cost(len(candidate) + 1)
                row.target_forwards += 1
                row.accepted["history"] = row.accepted.get("history", 0) + accepted
                new = truth[done : done + accepted + 1]
                context.extend(new)
                done += len(new)
            rows.append(row)
    return out


def earliest_continuation(context: Sequence[int], limit: int, ngram: int) -> list[int]:
    length = len(context)
    if limit <= 0:
        return []
    for n in range(min(ngram, length - 1), 0, -1):
        tail = list(context[length - n :])
        for start in range(0, length - n + 1):
            if list(context[start : start + n]) == tail and start + n < length:
                return list(context[start + n : min(start + n + limit, length)])
    return []


def replay(path: Path, out: Path | None, draft_dtype: str) -> None:
    """Replay plain, prompt lookup and the agent bench's policies over the recorded traces."""
    traces = json.loads(path.read_text())
    # The bench's own plain policy is the replay's "plain": in target steps they are one.
    policies = [p for p in agent_policies(True) if p.drafter.kind != "none"]
    auto = policies[0]
    trees = auto.drafter.model_copy(update={"tree": True})
    policies.insert(1, auto.model_copy(update={"name": "lossless-auto-trees", "drafter": trees}))
    plain = Policy(name="plain", description="replay", mode="lossless", drafter={"kind": "none"})
    if traces["draft"] is None:
        policies = [p for p in policies if p.drafter.kind != "draft_model"]
    runtime = SpecRuntime.from_pretrained(
        traces["target"],
        traces["draft"],
        policies=[*policies, plain],
        draft_dtype=draft_dtype,
        engine=traces.get("engine", "transformers"),
        options=RuntimeOptions(prefix_cache_tokens=65536),
    )
    runtime.wait_measured(timeout=3600)
    verify = runtime._decoder.costs.measured(None)
    results = {"hf_prompt_lookup": replay_hf_prompt_lookup(traces, verify)}
    for policy in [plain, *policies]:
        started = time.perf_counter()
        results[policy.name] = replay_specagent(runtime, policy, traces)
        print(f"replayed {policy.name} in {time.perf_counter() - started:.0f}s", flush=True)
    totals = report(results)
    if out is not None:
        draft = runtime._decoder.draft_runner
        data = {
            "traces": str(path),
            "machine": machine_info(),
            "precision": dtypes_of(runtime),
            "costs": dataclasses.asdict(runtime._decoder.costs.measured(draft)),
            "total_units": totals,
            "episodes": {
                name: {e: [dataclasses.asdict(r) for r in rows] for e, rows in by_episode.items()}
                for name, by_episode in results.items()
            },
        }
        out.write_text(json.dumps(data, indent=1))
        print(f"wrote {out}")


def report(results: dict[str, dict[str, list[Replayed]]]) -> dict[str, float]:
    """Print each method's cost per episode and in total (and against plain); returns the
    totals."""
    plain = results["plain"]
    base = {e: sum(r.units for r in rows) for e, rows in plain.items()}
    names = list(results)
    print("episode".ljust(20) + "".join(n[:18].rjust(20) for n in names))
    totals = dict.fromkeys(names, 0.0)
    for episode_id in plain:
        line = episode_id.ljust(20)
        for name in names:
            units = sum(r.units for r in results[name][episode_id])
            totals[name] += units
            line += f"{units:9.1f} ({base[episode_id] / units:4.2f}x)".rjust(20)
        print(line)
    plain_total = totals["plain"]
    print(
        "total".ljust(20)
        + "".join(f"{totals[n]:9.1f} ({plain_total / totals[n]:4.2f}x)".rjust(20) for n in names)
    )
    for name in names:
        merged = Replayed()
        for rows in results[name].values():
            for row in rows:
                merged.add(row)
        print(
            f"{name}: target {merged.target_units:.1f} units in {merged.target_forwards} forwards, "
            f"draft {merged.draft_units:.1f} in {merged.draft_forwards}, accepted {merged.accepted}"
        )
    return {name: round(units, 2) for name, units in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["record", "replay"])
    parser.add_argument("traces", type=Path)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--workload",
        default="agent",
        choices=["agent", "prompts"],
        help="record: the agent episodes, or single prompts (one turn each)",
    )
    parser.add_argument("--out", type=Path, help="replay: write the result as JSON here")
    parser.add_argument(
        "--draft-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "int8"],
        help="the draft's dtype (auto: as the runtime measures it here; int8: int8 weights)",
    )
    parser.add_argument(
        "--target", default=None, help="record: this target alone (default: the Qwen pair)"
    )
    parser.add_argument(
        "--engine", default="transformers", choices=["transformers", "llama.cpp"], help="record"
    )
    args = parser.parse_args()
    if args.mode == "record":
        models = (args.target, None) if args.target else PAIRS["qwen2.5-coder"]
        record(args.traces, args.max_new_tokens, args.workload, models, args.engine)
    else:
        replay(args.traces, args.out, args.draft_dtype)


if __name__ == "__main__":
    main()
