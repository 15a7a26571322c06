"""``specagent bench --workload agent``: speed on agent episodes, not on single prompts.

An episode is a conversation an agent has (``data/agent_episodes.jsonl``, 12 of them): a tool
call then an answer that quotes the tool's result, an answer rewritten as an email, a function
returned again with one change, an SQL query fixed after its error, the same JSON shape extracted
from document after document. Every method runs every episode as an agent would, one turn after
the other through one runtime, and every method is handed the same conversation: plain greedy's
replies become the assistant messages later turns build on, so each turn's prompt is the same for
every method and its output can be compared with plain's (in bf16, where a near-tie can flip,
one method's diverging reply would otherwise change every later prompt of its episode).
Methods: transformers' plain greedy ``generate``, prompt lookup and assisted generation, and
specagent's policies, all on the runtime's model objects (so in one dtype), taking turns per
episode. Each specagent method calls under a tenant of its own, and the history is cleared every
round, so no method ever sees text from another method or round. specagent runs twice when the
runtime keeps a prefix cache: paying every turn's whole prefill, as the transformers baselines
do, and as an agent runs it (``+reuse``: each turn starts from the KV the previous turn left,
prompt and reply, and prefills only the new message).

Reported per turn and per episode: decode time, tokens, tokens/s, and for specagent acceptance
and where the accepted tokens came from (history, draft model, grammar); every lossless output is
compared with plain greedy token for token, and where one differs, ``explain_divergence`` says
whether the first differing token was a tie within the dtype's rounding (the two tokens'
margin under the target in float32 is within twice the dtype's logit error along plain's path)
or a real difference, and which of the two tokens float32 prefers. Ratios use total decode time
over an episode (and over all of them), medians of the rounds.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..chat import render_prompt
from ..machine import machine_info
from ..policy import Policy
from ..policy.schema import AutoConfig, DraftModelConfig, NoDrafterConfig
from ..runtime import SpecRuntime
from .baselines import Method, prepared_methods
from .divergence import explain_divergence, tally_differences
from .records import dtypes_of, geomean, peak_rss_mb

__all__ = [
    "AgentBenchResult",
    "Episode",
    "agent_policies",
    "load_episodes",
    "run_agent_bench",
    "save_agent_bench",
]

TENANT = "bench"


@dataclass(frozen=True)
class Episode:
    id: str
    kind: str
    system: str
    turns: list[str]


def load_episodes(path: str | Path | None = None) -> list[Episode]:
    """The shipped episodes, or a JSONL file of ``{"id", "kind", "system", "turns": [...]}``."""
    source = Path(path) if path else Path(str(resources.files("specagent") / "data"))
    if path is None:
        source = source / "agent_episodes.jsonl"
    episodes = []
    for line in source.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            episodes.append(Episode(item["id"], item["kind"], item["system"], list(item["turns"])))
    return episodes


def agent_policies(has_draft: bool) -> list[Policy]:
    """``lossless-auto``: history (this tenant's earlier calls and the call's own text), the
    draft model when there is one, or plain decoding, per step; ``lossless-plain``: the
    runtime's own plain decoding (no drafts), to show what its measured kernels alone give
    beside what drafting adds; and, with a draft model, ``lossless-draft_model`` (the draft
    model alone) to show what history adds."""
    policies = [
        Policy(
            name="lossless-auto",
            description="agent bench",
            mode="lossless",
            drafter=AutoConfig(num_speculative_tokens=20, history="tenant"),
        ),
        Policy(
            name="lossless-plain",
            description="agent bench: no drafts",
            mode="lossless",
            drafter=NoDrafterConfig(),
        ),
    ]
    if has_draft:
        policies.append(
            Policy(
                name="lossless-draft_model",
                description="agent bench",
                mode="lossless",
                drafter=DraftModelConfig(num_speculative_tokens=20),
            )
        )
    return policies


@dataclass
class TurnResult:
    tokens: int
    seconds: float
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    accepted_by_source: dict[str, int] | None = None
    tree_steps: int | None = None
    """specagent: verifications of a token tree (``SpecStats.num_tree_steps``)."""
    equal_to_plain: bool | None = None
    divergence: dict[str, Any] | None = None
    """Where an output first differs from plain greedy, and whether the two tokens were a tie
    within the rounding of the dtype (``explain_divergence``)."""


@dataclass
class AgentBenchResult:
    target: str
    draft: str | None
    max_new_tokens: int
    device: str
    rounds: int
    episodes: dict[str, dict[str, list[TurnResult]]] = field(default_factory=dict)
    """Per episode and method: the median round's turns."""
    summary: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=machine_info)
    precision: dict[str, Any] = field(default_factory=dict)
    peak_rss_mb: float | None = None
    history: dict[str, int] = field(default_factory=dict)
    """The most the runtime's history held after one method's pass over every episode
    (tokens, documents, index entries)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["episodes"] = {
            e: {m: [asdict(t) for t in turns] for m, turns in rows.items()}
            for e, rows in self.episodes.items()
        }
        return data


def run_agent_bench(
    runtime: SpecRuntime,
    *,
    episodes: list[Episode] | None = None,
    max_new_tokens: int = 32,
    repeats: int = 1,
    methods: Iterable[str] | None = None,
    target_name: str = "target",
    draft_name: str | None = None,
    log: Callable[[str], None] = print,
    baselines: Mapping[str, Method] | None = None,
    new_round: Callable[[], None] | None = None,
) -> AgentBenchResult:
    """Run every method over every episode, ``repeats`` rounds; the runtime's policies must be
    ``agent_policies``.

    Methods take turns per episode (plain first, then each method runs the whole episode), not
    per round: a machine whose speed drifts over minutes (a shared cloud host) then slows every
    method's run of an episode alike, where a method that ran its whole pass in a slow spell
    would otherwise look slower than it is. Each specagent method calls under its own tenant,
    so its history and prefix cache hold only its own runs; the history is cleared at the start
    of every round, the prefix cache before every method's run of an episode. ``baselines``
    adds methods of other programs on the same model files (``EngineTools.other_programs``),
    and ``new_round`` starts them afresh before each round (untimed), as the history is
    cleared."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    episodes = episodes if episodes is not None else load_episodes()
    own: dict[str, Method] = {}
    for policy in runtime.policies:
        if policy.name != "default":
            name = f"specagent_{policy.name}"
            own[name] = _spec_method(runtime, policy.name, max_new_tokens, reuse=False)
            if runtime.prefix_cache is not None:
                own[f"{name}+reuse"] = _spec_method(
                    runtime, policy.name, max_new_tokens, reuse=True
                )
    runs = prepared_methods(runtime, own, max_new_tokens, methods, baselines, log)

    out = AgentBenchResult(target_name, draft_name, max_new_tokens, str(runtime.device), repeats)
    out.precision = dtypes_of(runtime)
    passes: dict[str, dict[str, list[list[TurnResult]]]] = {e.id: {} for e in episodes}
    differ: list[tuple[TurnResult, list[int], list[int], list[int]]] = []
    for round_index in range(repeats):
        if runtime.history is not None:
            runtime.history.clear()  # nothing carried over from an earlier round
        if new_round is not None:
            new_round()
        totals = dict.fromkeys(runs, 0.0)
        for episode in episodes:
            reference: list[list[int]] = []
            replies: list[str] | None = None
            for name, method in runs.items():  # plain first: the reference
                if runtime.prefix_cache is not None:
                    runtime.prefix_cache.clear()  # every method starts the episode cold
                start = time.perf_counter()
                turns, outputs, ids, texts = _run_episode(
                    runtime, episode, method, round_index, replies
                )
                totals[name] += time.perf_counter() - start
                if name == "plain":
                    reference, replies = outputs, texts
                else:
                    for turn, prompt, mine, theirs in zip(
                        turns, ids, outputs, reference, strict=True
                    ):
                        turn.equal_to_plain = mine == theirs
                        if mine != theirs:
                            differ.append((turn, prompt, theirs, mine))
                passes[episode.id].setdefault(name, []).append(turns)
        log(f"round {round_index + 1}: " + ", ".join(f"{n} {t:.0f}s" for n, t in totals.items()))
        held = runtime.history.stats() if runtime.history is not None else {}
        if held.get("tokens", 0) > out.history.get("tokens", 0):
            out.history = held  # the fullest it got at the end of a round, over all methods
    for episode_id, by_method in passes.items():
        out.episodes[episode_id] = {name: _median(rounds) for name, rounds in by_method.items()}
    out.summary = _summarise(out.episodes, {e.id: e.kind for e in episodes})
    if runtime.prefix_cache is not None:
        # Only the ``+reuse`` methods find anything: the others clear it before every call.
        out.summary["prefix_reuse"] = {
            "hits": runtime.prefix_cache.hits,
            "reused_tokens": runtime.prefix_cache.reused_tokens,
        }
    out.peak_rss_mb = peak_rss_mb()  # before the float32 reference below is built
    reported = {id(t) for rows in out.episodes.values() for turns in rows.values() for t in turns}
    explain = [d for d in differ if id(d[0]) in reported]
    if explain:
        log(f"explaining {len(explain)} outputs that differ from plain greedy")
        explained = explain_divergence(runtime, [d[1:] for d in explain])
        for (turn, *_), divergence in zip(explain, explained, strict=True):
            turn.divergence = divergence
    out.summary["divergences"] = _divergence_summary(out.episodes)
    return out


def _divergence_summary(episodes: dict[str, dict[str, list[TurnResult]]]) -> dict[str, Any]:
    """Per method: turns equal to plain, turns differing at a near-tie, and turns differing for
    another reason (which would be a bug in a lossless method)."""
    return tally_differences(
        (name, turn.equal_to_plain, turn.divergence)
        for rows in episodes.values()
        for name, turns in rows.items()
        if name != "plain"
        for turn in turns
    )


def _run_episode(
    runtime: SpecRuntime,
    episode: Episode,
    method: Method,
    seed: int,
    replies: list[str] | None = None,
) -> tuple[list[TurnResult], list[list[int]], list[list[int]], list[str]]:
    """The episode's turns, each built on the replies before it (``replies`` where given, the
    method's own otherwise): each turn's result, output ids, prompt ids and reply text."""
    tokenizer = runtime.tokenizer
    if tokenizer is None:
        raise ValueError("agent episodes are chat conversations: the runtime needs a tokenizer")
    messages = [{"role": "system", "content": episode.system}]
    turns: list[TurnResult] = []
    outputs: list[list[int]] = []
    prompts: list[list[int]] = []
    texts: list[str] = []
    for index, text in enumerate(episode.turns):
        messages.append({"role": "user", "content": text})
        ids = render_prompt(messages, runtime.tokenizer, vocab_size=runtime.vocab_size)
        start = time.perf_counter()
        tokens, stats = method(ids, seed)
        turn = TurnResult(len(tokens), round(time.perf_counter() - start, 3))
        if stats is not None:
            turn.acceptance_rate = round(stats.acceptance_rate, 3)
            turn.mean_acceptance_length = round(stats.mean_acceptance_length, 3)
            turn.accepted_by_source = dict(stats.accepted_by_source)
            turn.tree_steps = stats.num_tree_steps
        reply = str(tokenizer.decode(list(tokens), skip_special_tokens=True))
        messages.append({"role": "assistant", "content": replies[index] if replies else reply})
        turns.append(turn)
        outputs.append(list(tokens))
        prompts.append(list(ids))
        texts.append(reply)
    return turns, outputs, prompts, texts


def _median(rounds: list[list[TurnResult]]) -> list[TurnResult]:
    """The round whose total decode time is the median."""
    ordered = sorted(rounds, key=lambda turns: sum(t.seconds for t in turns))
    return ordered[len(ordered) // 2]


def _spec_method(runtime: SpecRuntime, policy: str, max_new_tokens: int, *, reuse: bool) -> Method:
    """specagent through the public runtime, under a tenant of its own. ``reuse``: as an agent
    runs it, each turn starting from the KV the previous turn left (prefix cache); without,
    every turn pays its whole prefill, as the transformers baselines do."""
    tenant = f"{TENANT}-{policy}{'+reuse' if reuse else ''}"

    def run(ids: list[int], seed: int) -> tuple[list[int], Any]:
        if not reuse and runtime.prefix_cache is not None:
            runtime.prefix_cache.clear()  # between calls: the worker is idle
        result = runtime.generate_sync(
            ids, policy=policy, max_new_tokens=max_new_tokens, seed=seed, tenant=tenant
        )
        return result.token_ids, result.stats

    return run


def _summarise(
    episodes: dict[str, dict[str, list[TurnResult]]], kinds: dict[str, str]
) -> dict[str, Any]:
    methods = list(next(iter(episodes.values())))
    seconds = {
        m: {e: sum(t.seconds for t in rows[m]) for e, rows in episodes.items()} for m in methods
    }
    tokens = {m: sum(t.tokens for rows in episodes.values() for t in rows[m]) for m in methods}
    summary: dict[str, Any] = {"total_seconds": {}, "tokens_per_s": {}, "speedup_vs_plain": {}}
    for m in methods:
        total = sum(seconds[m].values())
        summary["total_seconds"][m] = round(total, 2)
        summary["tokens_per_s"][m] = round(tokens[m] / total, 3) if total else 0.0
        per_episode = {e: seconds["plain"][e] / s for e, s in seconds[m].items() if s}
        summary["speedup_vs_plain"][m] = {
            "total": round(sum(seconds["plain"].values()) / total, 3) if total else 0.0,
            "per_episode": {e: round(r, 3) for e, r in per_episode.items()},
            "geomean_episodes": round(geomean(per_episode.values()), 3),
            "min_episode": round(min(per_episode.values()), 3),
        }
    for baseline in (
        "hf_assisted",
        "hf_prompt_lookup",
        "llama_prompt_lookup",
        "llama_server",
        "llama_server_ngram_mod",
        "llama_server_ngram_cache",
    ):
        if baseline not in seconds:
            continue
        summary[f"speedup_vs_{baseline}"] = {
            m: {
                "total": round(sum(seconds[baseline].values()) / sum(seconds[m].values()), 3),
                "min_episode": round(
                    min(seconds[baseline][e] / seconds[m][e] for e in episodes), 3
                ),
            }
            for m in methods
            if m.startswith("specagent_")
        }
    baselines = [m for m in methods if not m.startswith("specagent_")]
    best_total = min(sum(seconds[b].values()) for b in baselines)
    best_tokens_per_s = max(summary["tokens_per_s"][b] for b in baselines)
    summary["best_baseline"] = {
        "total": min(baselines, key=lambda b: sum(seconds[b].values())),
        "tokens_per_s": best_tokens_per_s,
    }
    summary["speedup_vs_best_baseline"] = {
        m: {
            "total_time": round(best_total / sum(seconds[m].values()), 3),
            "tokens_per_s": round(summary["tokens_per_s"][m] / best_tokens_per_s, 3),
            "min_episode": round(
                min(min(seconds[b][e] for b in baselines) / seconds[m][e] for e in episodes), 3
            ),
        }
        for m in methods
        if m.startswith("specagent_")
    }
    sources: dict[str, dict[str, int]] = {}
    for m in methods:
        for rows in episodes.values():
            for turn in rows[m]:
                for source, n in (turn.accepted_by_source or {}).items():
                    sources.setdefault(m, {})[source] = sources.get(m, {}).get(source, 0) + n
    summary["accepted_by_source"] = sources
    summary["tree_steps"] = {
        m: sum(t.tree_steps or 0 for rows in episodes.values() for t in rows[m])
        for m in methods
        if m.startswith("specagent_")
    }
    summary["all_lossless_equal_to_plain"] = all(
        t.equal_to_plain is not False
        for rows in episodes.values()
        for m in methods
        for t in rows[m]
    )
    by_kind: dict[str, list[float]] = {}
    for e, kind in kinds.items():
        for m in methods:
            if m.startswith("specagent_") and seconds[m].get(e):
                by_kind.setdefault(f"{m}:{kind}", []).append(seconds["plain"][e] / seconds[m][e])
    summary["speedup_vs_plain_by_kind"] = {
        k: round(statistics.median(v), 3) for k, v in by_kind.items()
    }
    return summary


def save_agent_bench(
    result: AgentBenchResult, out_dir: Path, stem: str, chart: bool = True
) -> list[Path]:
    """JSON, and (``chart``) a PNG of each method's speed-up over plain per episode; the paths
    written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    if not chart:
        return [json_path]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speedups = result.summary["speedup_vs_plain"]
    methods = [m for m in speedups if m != "plain"]
    names = list(result.episodes)
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(9, 1.1 * len(names)), 4.8))
    for i, m in enumerate(methods):
        values = [speedups[m]["per_episode"].get(e, 0.0) for e in names]
        label = f"{m} (total {speedups[m]['total']:.2f}x)"
        ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(
        [x + width * (len(methods) - 1) / 2 for x in range(len(names))],
        names,
        rotation=30,
        ha="right",
    )
    ax.set_ylabel("speed-up vs plain (episode decode time)")
    ax.set_title(
        f"agent episodes: {result.target} (draft: {result.draft}), {result.machine.get('cpu')}, "
        f"{result.max_new_tokens} tokens per turn, {result.rounds} round(s)",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return [json_path, png_path]
