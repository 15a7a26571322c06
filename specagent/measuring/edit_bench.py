"""``specagent bench --workload edits``: the text asked back whole with a few changes, where
speculation pays most (``edit_tasks``: real standard-library code and business documents, edits
of several kinds).

Every method runs every task, methods taking turns per task and round (plain first: the
reference). specagent runs its lossless policies twice: as a call with only the prompt, and with
the text to edit given as the call's predicted output (``prediction``, OpenAI's predicted
outputs): the prediction only drafts, so a lossless call's tokens are the same either way, and
the bench checks that they are. A ``rewrite`` task asks for the JSON configuration as YAML
(text that is not in the prompt), with the expected YAML only as the prediction.

Reported per task and method: tokens, seconds, tokens/s, whether the output applied the edit and
how close its text is to the expected one, acceptance and where accepted tokens came from; every
lossless output is compared with plain greedy token for token (a difference explained as a
near-tie or not, ``explain_divergence``). The history is cleared before every specagent call:
each call drafts from its own prompt (and prediction) only, never from an earlier round's output
of the same task.

Beside the methods, each task's *floor*: the seconds of one forward of the target over the prompt
and plain's output together, as a prefill runs it (``floor_seconds``). Any lossless method on
this engine passes every one of those positions through the target at least once, and no forward
does it cheaper per position than a prefill's wide one (speculative verification also computes
every row's logits), so no method can finish a task in less. ``summary["floor"]`` says how
close each method came (``share_of_floor``) and the most any method could gain on each baseline
(``ceiling_vs``) and on the best of each task (``ceiling_vs_best_baseline``): on a CPU where a
wide forward still costs a third of a single step per position, that ceiling, not the drafter,
bounds the edits.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..chat import render_prompt
from ..machine import machine_info
from ..policy import Policy
from ..policy.schema import AutoConfig, NoDrafterConfig
from ..runtime import SpecRuntime
from .baselines import Method, prepared_methods, start_round
from .divergence import explain_divergence, tally_differences
from .edit_tasks import EditTask, edit_tasks, rewrite_task
from .records import dtypes_of, geomean, in_turn, peak_rss_mb

__all__ = ["EditBenchResult", "edit_policies", "run_edit_bench"]

UNFIT = ("llama_prompt_lookup",)
"""Baselines left out unless named: llama-cpp-python's prompt lookup writes its logits into a
buffer of ``n_batch`` rows (``logits_all`` off) and fails once a call's context passes it, as
every edit's does (``logits_all`` on would hold 16k x 152k floats)."""
PREDICTED = "+prediction"
"""Suffix of a specagent method that gets the text to edit as the call's prediction."""


def edit_policies(has_draft: bool) -> list[Policy]:
    """``lossless-auto`` as the shipped lossless policies draft (history of the call's own
    text, the draft model where there is one), and ``lossless-plain`` (no drafts)."""
    del has_draft  # the auto drafter uses the draft model when the runtime has one
    return [
        Policy(
            name="lossless-auto",
            description="edits bench",
            mode="lossless",
            drafter=AutoConfig(num_speculative_tokens=64, history="call"),
        ),
        Policy(
            name="lossless-plain",
            description="edits bench: no drafts",
            mode="lossless",
            drafter=NoDrafterConfig(),
        ),
    ]


@dataclass
class EditRun:
    tokens: int
    seconds: float
    tokens_per_s: float
    applied: bool
    similarity: float
    equal_to_plain: bool | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    accepted_by_source: dict[str, int] | None = None
    divergence: dict[str, Any] | None = None


@dataclass
class EditBenchResult:
    target: str
    max_new_tokens: int
    rounds: int
    tasks: dict[str, dict[str, EditRun]] = field(default_factory=dict)
    """Per task and method: the median round."""
    kinds: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=machine_info)
    precision: dict[str, Any] = field(default_factory=dict)
    peak_rss_mb: float | None = None
    floors: dict[str, float] = field(default_factory=dict)
    """Per task: the median round's ``floor_seconds`` (the least any lossless method needs)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["tasks"] = {
            t: {m: asdict(r) for m, r in rows.items()} for t, rows in self.tasks.items()
        }
        return data


class Predicted(Protocol):
    """A specagent method: the bench's ``Method``, and the same with a prediction."""

    def __call__(
        self, ids: list[int], seed: int, prediction: str | None = None
    ) -> tuple[list[int], Any]: ...


def _spec(runtime: SpecRuntime, policy: str, max_new_tokens: int, tenant: str) -> Predicted:
    """specagent through the public runtime, as ``tenant``: a method's prefix cache holds only
    its own calls (the same task's prompt, another method's, is never found whole)."""

    def run(ids: list[int], seed: int, prediction: str | None = None) -> tuple[list[int], Any]:
        if runtime.history is not None:
            runtime.history.clear()
        result = runtime.generate_sync(
            ids,
            policy=policy,
            max_new_tokens=max_new_tokens,
            seed=seed,
            tenant=tenant,
            prediction=prediction,
        )
        return result.token_ids, result.stats

    return run


def run_edit_bench(
    runtime: SpecRuntime,
    *,
    max_new_tokens: int = 1024,
    repeats: int = 1,
    methods: Iterable[str] | None = None,
    tasks: Iterable[str] | None = None,
    target_name: str = "target",
    log: Callable[[str], None] = print,
    baselines: Mapping[str, Method] | None = None,
    new_round: Callable[[], None] | None = None,
) -> EditBenchResult:
    """Every method over every task, ``repeats`` rounds (the runtime's policies:
    ``edit_policies``), each method first in turn from one task to the next (``in_turn``);
    ``new_round`` starts the ``baselines`` of other programs afresh before each round
    (untimed). Each method reuses what its last call's KV shares with the next prompt (the
    system prompt), as a user's process does (``baselines.start_round``)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if runtime.tokenizer is None:
        raise ValueError("the edits are chat prompts: the runtime needs a tokenizer")
    chosen = [*edit_tasks(), rewrite_task()]
    if tasks is not None:
        only = set(tasks)
        unknown = only - {t.id for t in chosen}
        if unknown:
            raise ValueError(f"unknown edit tasks {sorted(unknown)}")
        chosen = [t for t in chosen if t.id in only]
    own: dict[str, Method] = {}
    predicted: dict[str, Predicted] = {}
    for policy in runtime.policies:
        if policy.name == "default":
            continue
        name = f"specagent_{policy.name}"
        own[name] = _spec(runtime, policy.name, max_new_tokens, f"bench-{policy.name}")
        if policy.drafter.kind != "none":
            predicted[f"{name}{PREDICTED}"] = _spec(
                runtime, policy.name, max_new_tokens, f"bench-{policy.name}{PREDICTED}"
            )
    wanted = set(methods) if methods is not None else None
    runs = prepared_methods(
        runtime,
        own,
        max_new_tokens,
        None if wanted is None else wanted - set(predicted),
        baselines,
        log,
        unless_named=UNFIT,
    )
    predicted = {n: r for n, r in predicted.items() if wanted is None or n in wanted}
    out = EditBenchResult(
        target_name, max_new_tokens, repeats, kinds={t.id: t.kind for t in chosen}
    )
    out.precision = dtypes_of(runtime)
    rounds: dict[str, dict[str, list[EditRun]]] = {t.id: {} for t in chosen}
    floors: dict[str, list[float]] = {t.id: [] for t in chosen}
    differ: list[tuple[EditRun, list[int], list[int], list[int]]] = []
    timed_own = {name: runs[name] for name in own if name in runs}
    for round_index in range(repeats):
        start_round(runtime, {**timed_own, **predicted}, new_round)
        for task_index, task in enumerate(chosen):
            ids = render_prompt(task.messages(), runtime.tokenizer, vocab_size=runtime.vocab_size)
            outputs: dict[str, tuple[EditRun, list[int]]] = {}
            for name in in_turn([*runs, *predicted], round_index * len(chosen) + task_index):
                start = time.perf_counter()
                if name in predicted:
                    tokens, stats = predicted[name](ids, round_index, task.prediction)
                else:
                    tokens, stats = runs[name](ids, round_index)
                seconds = time.perf_counter() - start
                text = str(runtime.tokenizer.decode(tokens, skip_special_tokens=True))
                outputs[name] = (_row(task, tokens, seconds, text, stats), tokens)
            reference = outputs["plain"][1]
            floors[task.id].append(floor_seconds(runtime, ids, reference))
            for name in [*runs, *predicted]:
                row, tokens = outputs[name]
                if name != "plain":
                    row.equal_to_plain = tokens == reference
                    if tokens != reference and name.startswith("specagent_"):
                        differ.append((row, ids, reference, tokens))
                rounds[task.id].setdefault(name, []).append(row)
        log(f"round {round_index + 1} of {repeats} done")
    for task_id, by_method in rounds.items():
        out.tasks[task_id] = {
            name: sorted(rows, key=lambda r: r.seconds)[len(rows) // 2]
            for name, rows in by_method.items()
        }
    out.floors = {t: round(statistics.median(f), 3) for t, f in floors.items()}
    out.peak_rss_mb = peak_rss_mb()
    reported = {id(r) for rows in out.tasks.values() for r in rows.values()}
    explain = [d for d in differ if id(d[0]) in reported]
    if explain:
        log(f"explaining {len(explain)} outputs that differ from plain greedy")
        for (row, *_), report in zip(
            explain, explain_divergence(runtime, [d[1:] for d in explain]), strict=True
        ):
            row.divergence = report
    out.summary = summarise(out.tasks, out.floors)
    return out


def floor_seconds(runtime: SpecRuntime, prompt: list[int], output: list[int]) -> float:
    """Seconds of one forward of the runtime's target over ``prompt`` and ``output`` together,
    as a prefill runs it (in the engine's batches, logits of the last position only): the least
    compute any lossless method needs to emit ``output`` after ``prompt`` on this engine."""
    runner = runtime._decoder.target_runner
    cache = runner.new_cache()
    start = time.perf_counter()
    logits = runner.forward([*prompt, *output], cache, keep=1)
    float(logits[-1, 0])  # synchronise with the device before reading the clock
    return time.perf_counter() - start


def _row(task: EditTask, tokens: list[int], seconds: float, text: str, stats: Any) -> EditRun:
    row = EditRun(
        len(tokens),
        round(seconds, 3),
        round(len(tokens) / seconds, 3) if seconds else 0.0,
        task.applied(text),
        round(task.similarity(text), 3),
    )
    if stats is not None:
        row.acceptance_rate = round(stats.acceptance_rate, 3)
        row.mean_acceptance_length = round(stats.mean_acceptance_length, 3)
        row.accepted_by_source = dict(stats.accepted_by_source)
    return row


def summarise(
    tasks: dict[str, dict[str, EditRun]], floors: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """Tokens/s over all tasks, speed-ups (total time and per task) against plain, each
    baseline and the best baseline per task, edits applied, lossless outputs' agreement, and
    where ``floors`` are given, each method's share of the floor and the floor's speed-up on
    each baseline and on the best (the ceiling: the most any lossless method could gain)."""
    methods = list(next(iter(tasks.values())))
    seconds = {m: {t: rows[m].seconds for t, rows in tasks.items() if m in rows} for m in methods}
    tokens = {m: sum(rows[m].tokens for rows in tasks.values() if m in rows) for m in methods}
    baselines = [m for m in methods if not m.startswith("specagent_")]
    summary: dict[str, Any] = {
        "tokens_per_s": {
            m: round(tokens[m] / sum(seconds[m].values()), 3) if seconds[m] else 0.0
            for m in methods
        },
        "applied": {
            m: sum(rows[m].applied for rows in tasks.values() if m in rows) for m in methods
        },
        "tasks": len(tasks),
    }
    for baseline in baselines:
        summary[f"speedup_vs_{baseline}"] = {
            m: _ratios(seconds[baseline], seconds[m]) for m in methods if m != baseline
        }
    best = {t: min(seconds[b][t] for b in baselines if t in seconds[b]) for t in tasks}
    summary["speedup_vs_best_baseline"] = {
        m: _ratios(best, seconds[m]) for m in methods if m.startswith("specagent_")
    }
    summary["divergences"] = tally_differences(
        (m, rows[m].equal_to_plain, rows[m].divergence)
        for rows in tasks.values()
        for m in rows
        if m.startswith("specagent_")
    )
    sources: dict[str, dict[str, int]] = {}
    for rows in tasks.values():
        for m, row in rows.items():
            for source, n in (row.accepted_by_source or {}).items():
                sources.setdefault(m, {})[source] = sources.get(m, {}).get(source, 0) + n
    summary["accepted_by_source"] = sources
    if floors:
        summary["floor"] = {
            "seconds": round(sum(floors.values()), 3),
            "share_of_floor": {m: _ratios(floors, seconds[m])["total_time"] for m in methods},
            "ceiling_vs": {b: _ratios(seconds[b], floors) for b in baselines},
            "ceiling_vs_best_baseline": _ratios(best, floors),
        }
    return summary


def _ratios(theirs: Mapping[str, float], mine: Mapping[str, float]) -> dict[str, Any]:
    shared = [t for t in mine if t in theirs and mine[t]]
    per_task = {t: round(theirs[t] / mine[t], 3) for t in shared}
    return {
        "total_time": round(sum(theirs[t] for t in shared) / sum(mine[t] for t in shared), 3),
        "geomean_tasks": round(geomean(per_task.values()), 3),
        "min_task": min(per_task.values()),
        "per_task": per_task,
        "median_task": round(statistics.median(per_task.values()), 3),
    }


def save_edit_bench(result: EditBenchResult, out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return path
