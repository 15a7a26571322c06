"""Side-by-side speed benchmark: plain decoding, transformers' assisted generation, specagent.

All methods run in one process, on the same prompts (agent workloads: code, summary of a given
text, JSON extraction, a tool call, free prose), with the same token budget. Reported per
prompt: tokens/s, speed-up against plain decoding and against assisted generation, acceptance
rate and mean acceptance length, and whether each lossless output equals plain greedy decoding
token for token. Results go to JSON and a PNG chart.

The baselines and specagent's lossless methods decode greedily. Relaxed mode runs sampled (at
``SAMPLED``, as the shipped relaxed policies do), side by side with a lossless twin at the same
temperature and seed: under greedy decoding every token a relaxed rule takes instead of the
target's argmax counts as divergence 1, so a relaxed call soon meets its budget and finishes
losslessly, and the text it does change changes every later step; what a relaxed policy buys is
measured where it is used. Each round samples with its own seed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..chat import render_prompt
from ..machine import machine_info
from ..policy import Policy
from ..policy.schema import (
    AutoConfig,
    DrafterBlock,
    DraftModelConfig,
    PromptLookupConfig,
    SamplingConfig,
    TypicalAcceptance,
)
from ..runtime import SpecRuntime
from .baselines import Method, prepared_methods, start_round
from .divergence import explain_divergence, tally_differences
from .records import dtypes_of, geomean, in_turn, peak_rss_mb

__all__ = ["PROMPTS", "BenchResult", "run_bench", "write_chart"]

_ARTICLE = (
    "The city council voted on Tuesday to expand the bike-lane network by 40 kilometres over "
    "the next three years. Supporters said the plan would cut traffic and emissions; shop owners "
    "on Main Street worried about losing parking. The first 12 kilometres will be built next "
    "spring, funded by a regional climate grant of 8 million euros."
)

PROMPTS: dict[str, list[dict[str, str]]] = {
    "code": [
        {
            "role": "user",
            "content": "Write a Python function `is_prime(n)` that returns "
            "True if n is prime. Include a docstring.",
        }
    ],
    "summary": [
        {"role": "user", "content": f"Summarise this article in two sentences:\n\n{_ARTICLE}"}
    ],
    "json_extraction": [
        {
            "role": "user",
            "content": "Extract name, email and order number as "
            "JSON from: 'Hi, this is Maria Lopez (maria.lopez@example.com). My order "
            "A-10234 arrived damaged.'",
        }
    ],
    "tool_call": [
        {
            "role": "system",
            "content": "You can call get_weather(city: str, unit: str). Answer "
            'with a JSON object {"name": ..., "arguments": {...}}.',
        },
        {"role": "user", "content": "What's the weather in Lisbon in celsius?"},
    ],
    "prose": [
        {
            "role": "user",
            "content": "Write a short paragraph about why people enjoy walking in the mountains.",
        }
    ],
}


@dataclass
class MethodResult:
    tokens: int
    seconds: float
    tokens_per_s: float
    tokens_per_s_rounds: list[float] | None = None
    """Every round's tokens/s when the benchmark ran several (``tokens_per_s`` is the median)."""
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    divergence: float | None = None
    equal_to_plain: bool | None = None
    difference: dict[str, Any] | None = None
    """For a lossless greedy output that differs from plain greedy's: where, and whether the
    dtype's rounding explains it (``divergence.explain_divergence``; first round)."""


@dataclass
class BenchResult:
    target: str
    draft: str | None
    max_new_tokens: int
    device: str
    results: dict[str, dict[str, MethodResult]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=machine_info)
    """CPU model and ISA flags, BLAS, threads, library versions: what the numbers hold for."""
    precision: dict[str, Any] = field(default_factory=dict)
    """Each model's dtype (shared by every method) and why it was chosen."""
    peak_rss_mb: float | None = None
    """Peak resident memory of the process (models, caches and every method) at the end."""

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "draft": self.draft,
            "max_new_tokens": self.max_new_tokens,
            "device": self.device,
            "machine": self.machine,
            "precision": self.precision,
            "peak_rss_mb": self.peak_rss_mb,
            "summary": self.summary,
            "results": {
                p: {m: vars(r) for m, r in rows.items()} for p, rows in self.results.items()
            },
        }


SAMPLED = SamplingConfig(temperature=0.7, top_p=0.95)
"""Sampling of the relaxed comparison (the shipped ``internal-summary`` policy's)."""


def bench_policies(has_draft: bool) -> list[Policy]:
    """For each drafter the models allow: lossless (greedy), and a sampled lossless / relaxed
    pair (typical acceptance, divergence budget 0.10); and ``lossless-auto``, the shipped
    policies' drafter."""
    # Draft models draft up to 20 tokens, as transformers' assisted generation does (with the
    # same 0.4 confidence stop); prompt lookup up to 6, as its baseline here.
    drafters: list[DrafterBlock] = [PromptLookupConfig(num_speculative_tokens=6)]
    if has_draft:
        drafters.append(DraftModelConfig(num_speculative_tokens=20))
    policies = []
    for drafter in drafters:
        kind = drafter.kind
        relaxed = TypicalAcceptance(rule="typical", epsilon=0.3, delta=0.09, max_divergence=0.1)
        policies += [
            Policy(name=f"lossless-{kind}", description="bench", mode="lossless", drafter=drafter),
            Policy(
                name=f"sampled-lossless-{kind}",
                description="bench",
                mode="lossless",
                drafter=drafter,
                sampling=SAMPLED,
            ),
            Policy(
                name=f"sampled-relaxed-{kind}",
                description="bench",
                mode="relaxed",
                drafter=drafter,
                acceptance=relaxed,
                sampling=SAMPLED,
            ),
        ]
    # What the shipped policies run (``auto``: per step a match in the call's own text, the
    # draft model or plain decoding), greedy; its history is the call's own (single prompts:
    # no earlier call of the bench may draft for a later one).
    auto = AutoConfig(num_speculative_tokens=20, history="call")
    policies.append(
        Policy(name="lossless-auto", description="bench", mode="lossless", drafter=auto)
    )
    return policies


def run_bench(
    runtime: SpecRuntime,
    *,
    max_new_tokens: int = 48,
    prompts: dict[str, list[dict[str, str]]] | None = None,
    target_name: str = "target",
    draft_name: str | None = None,
    log: Callable[[str], None] = print,
    repeats: int = 1,
    methods: Iterable[str] | None = None,
    baselines: Mapping[str, Method] | None = None,
    new_round: Callable[[], None] | None = None,
) -> BenchResult:
    """Run every method on every prompt (the runtime's policies must be ``bench_policies``).

    With ``repeats`` > 1 the whole set runs that many rounds, methods interleaved within each
    round (each method first in turn from one prompt to the next: ``records.in_turn``), and
    each cell reports its median round: a slow spell of a shared machine then hits
    every method alike instead of deciding one comparison. ``methods`` keeps only the methods
    named (plain always runs: it is the reference). Every method runs on the runtime's own
    model objects, so in the same dtype; ``baselines`` adds methods of other programs on the
    same model files (``EngineTools.other_programs``: llama.cpp's server), and ``new_round``
    starts them afresh before each round (untimed). Each method reuses what its last call's
    KV shares with the next prompt, as a user's process does (``baselines.start_round``: the
    runtime's prefix cache, when it has one)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    prompts = prompts or PROMPTS
    out = BenchResult(target_name, draft_name, max_new_tokens, str(runtime.device))
    out.precision = dtypes_of(runtime)
    sampled = {f"specagent_{p.name}" for p in runtime.policies if p.sampling.temperature > 0}
    own = {
        f"specagent_{policy.name}": _spec_method(runtime, policy.name, max_new_tokens)
        for policy in runtime.policies
        if policy.name != "default"
    }
    runs = prepared_methods(runtime, own, max_new_tokens, methods, baselines, log)
    rendered_prompts = {
        name: render_prompt(messages, runtime.tokenizer, vocab_size=runtime.vocab_size)
        for name, messages in prompts.items()
    }
    rounds: dict[str, dict[str, list[MethodResult]]] = {p: {} for p in prompts}
    differ: list[tuple[MethodResult, list[int], list[int], list[int]]] = []
    timed_own = {name: runs[name] for name in own if name in runs}
    for round_index in range(repeats):
        start_round(runtime, timed_own, new_round)
        for prompt_index, (prompt_name, ids) in enumerate(rendered_prompts.items()):
            outputs: dict[str, tuple[list[int], Any, float]] = {}
            turn = round_index * len(rendered_prompts) + prompt_index
            for name in in_turn(list(runs), turn):
                start = time.perf_counter()
                tokens, stats = runs[name](ids, round_index)
                outputs[name] = (tokens, stats, time.perf_counter() - start)
            reference = outputs["plain"][0]
            for name in runs:
                tokens, stats, seconds = outputs[name]
                row = MethodResult(
                    tokens=len(tokens),
                    seconds=round(seconds, 3),
                    tokens_per_s=round(len(tokens) / seconds, 3),
                )
                lossless = stats is None or stats.mode == "lossless"
                if name != "plain" and name not in sampled and lossless:
                    row.equal_to_plain = tokens == reference
                    if not row.equal_to_plain:
                        differ.append((row, ids, reference, tokens))
                if stats is not None:
                    row.acceptance_rate = round(stats.acceptance_rate, 3)
                    row.mean_acceptance_length = round(stats.mean_acceptance_length, 3)
                    row.divergence = (
                        None if stats.divergence is None else round(stats.divergence, 4)
                    )
                rounds[prompt_name].setdefault(name, []).append(row)
                log(
                    f"[{round_index + 1}/{repeats}] {prompt_name:16s} {name:36s} "
                    f"{row.tokens_per_s:7.2f} tok/s  acc={row.acceptance_rate}  "
                    f"equal={row.equal_to_plain}"
                )
    out.peak_rss_mb = peak_rss_mb()  # before the float32 reference of the explanations
    if differ:  # before the medians: a median round that was equal takes another's report
        log(f"explaining {len(differ)} outputs that differ from plain greedy")
        explained = explain_divergence(runtime, [case[1:] for case in differ])
        for (row, *_), report in zip(differ, explained, strict=True):
            row.difference = report
    for prompt_name, by_method in rounds.items():
        out.results[prompt_name] = {name: _median_round(rows) for name, rows in by_method.items()}
    out.summary = _summarise(out.results)
    out.summary["divergences"] = tally_differences(
        (name, row.equal_to_plain, row.difference)
        for by_method in out.results.values()
        for name, row in by_method.items()
        if row.equal_to_plain is not None
    )
    return out


def _median_round(rows: list[MethodResult]) -> MethodResult:
    """The round with the median tokens/s; equality to plain must hold in every round."""
    ordered = sorted(rows, key=lambda r: r.tokens_per_s)
    median = ordered[len(ordered) // 2]
    if len(rows) > 1:
        median.tokens_per_s_rounds = [r.tokens_per_s for r in rows]
        if median.equal_to_plain is not None:
            median.equal_to_plain = all(bool(r.equal_to_plain) for r in rows)
            differing = [r.difference for r in rows if r.difference is not None]
            if median.difference is None and differing:
                median.difference = differing[0]
    return median


def _spec_method(
    runtime: SpecRuntime, policy: str, max_new_tokens: int
) -> Callable[[list[int], int], tuple[list[int], Any]]:
    """specagent through the public runtime, as a tenant of its own: its prefix cache holds
    only its own calls (another method's prompt, the same, is never found whole)."""

    def run(ids: list[int], seed: int) -> tuple[list[int], Any]:
        result = runtime.generate_sync(
            ids, policy=policy, max_new_tokens=max_new_tokens, seed=seed, tenant=f"bench-{policy}"
        )
        return result.token_ids, result.stats

    return run


def _summarise(results: dict[str, dict[str, MethodResult]]) -> dict[str, Any]:
    """Speed-ups against plain and assisted decoding, per prompt and as geometric means, and of
    each sampled relaxed method against its lossless twin."""
    summary: dict[str, Any] = {"speedup_vs_plain": {}, "speedup_vs_hf_assisted": {}}
    methods = next(iter(results.values())).keys()
    for method in methods:
        ratios_plain, ratios_assisted = [], []
        for rows in results.values():
            ratios_plain.append(rows[method].tokens_per_s / rows["plain"].tokens_per_s)
            if "hf_assisted" in rows:
                ratios_assisted.append(rows[method].tokens_per_s / rows["hf_assisted"].tokens_per_s)
        summary["speedup_vs_plain"][method] = {
            "per_prompt": dict(zip(results, (round(r, 3) for r in ratios_plain), strict=True)),
            "geomean": round(geomean(ratios_plain), 3),
            "min": round(min(ratios_plain), 3),
        }
        if ratios_assisted:
            summary["speedup_vs_hf_assisted"][method] = {
                "per_prompt": dict(
                    zip(results, (round(r, 3) for r in ratios_assisted), strict=True)
                ),
                "geomean": round(geomean(ratios_assisted), 3),
            }
    baselines = [m for m in methods if not m.startswith("specagent_")]
    summary["speedup_vs_best_baseline"] = {
        method: _vs_best(
            {p: rows[method].tokens_per_s for p, rows in results.items()},
            {p: max(rows[b].tokens_per_s for b in baselines) for p, rows in results.items()},
        )
        for method in methods
        if method.startswith("specagent_")
    }
    summary["relaxed_vs_lossless"] = {}
    for method in methods:
        twin = method.replace("sampled-relaxed-", "sampled-lossless-")
        if twin == method or twin not in methods:
            continue
        ratios = [rows[method].tokens_per_s / rows[twin].tokens_per_s for rows in results.values()]
        summary["relaxed_vs_lossless"][method] = {
            "per_prompt": dict(zip(results, (round(r, 3) for r in ratios), strict=True)),
            "geomean": round(geomean(ratios), 3),
            "min": round(min(ratios), 3),
        }
    return summary


def _vs_best(mine: Mapping[str, float], best: Mapping[str, float]) -> dict[str, Any]:
    """Tokens/s against the fastest baseline on each prompt (whichever it is there)."""
    ratios = {p: mine[p] / best[p] for p in mine if best[p]}
    return {
        "per_prompt": {p: round(r, 3) for p, r in ratios.items()},
        "geomean": round(geomean(ratios.values()), 3),
        "min": round(min(ratios.values()), 3) if ratios else 0.0,
    }


def write_chart(result: BenchResult, path: Path) -> None:
    """A grouped bar chart of speed-up against plain decoding, per prompt and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(result.results)
    methods = [m for m in next(iter(result.results.values())) if m != "plain"]
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(prompts)), 4.5))
    for i, method in enumerate(methods):
        values = [
            result.results[p][method].tokens_per_s / result.results[p]["plain"].tokens_per_s
            for p in prompts
        ]
        ax.bar([x + i * width for x in range(len(prompts))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(prompts))], prompts)
    ax.set_ylabel("speed-up vs plain decoding")
    dtypes = ", ".join(
        f"{role} {info['dtype'] if isinstance(info, dict) else info}"
        for role, info in result.precision.items()
    )
    ax.set_title(
        f"{result.target} (draft: {result.draft}), {result.device} {result.machine.get('cpu')}, "
        f"{dtypes}\ngreedy (sampled-*: T {SAMPLED.temperature}), {result.max_new_tokens} tokens",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: BenchResult, out_dir: Path, stem: str, chart: bool = True) -> list[Path]:
    """The JSON and (``chart``) a PNG of it; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    if not chart:
        return [json_path]
    write_chart(result, png_path)
    return [json_path, png_path]
