"""``specagent tune``: the fastest relaxed setting that stays within a quality budget.

A grid over the policy's own rule (its parameters) and k runs on a prompt set through
``evaluate``; a setting is *within budget* when on every prompt its mean divergence is at most
``max_divergence`` and its similarity to the lossless twin, relative to the noise floor, is at
least ``min_similarity``: a per-prompt worst case, because the runtime's guard is per call too.
Among those, the one with the most tokens per unit of modelled step cost wins.

Deterministic given the seed: candidates run with a fixed k (adaptive k would plan with timings),
seeds are ``seed, seed + 1, ...``, and the ranking uses counters and step costs, not wall time.
Pass ``costs`` to pin the step costs too (they are measured once per runtime otherwise).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from ..decoding.costs import CostModel
from ..decoding.registry import RULES
from ..errors import EvaluationError, PolicyError
from ..policy import Policy
from ..runtime import SpecRuntime
from .evaluation import (
    EvalPrompt,
    EvalReport,
    SettingReport,
    TextSimilarity,
    evaluate,
    setting_label,
)

__all__ = ["GRIDS", "Budget", "TuneResult", "search_space", "tune"]

GRIDS: dict[str, Mapping[str, tuple[Any, ...]]] = {name: kind.grid for name, kind in RULES.items()}
"""Parameter values searched per rule, from strict to loose (``decoding.registry.RULES``)."""


@dataclass(frozen=True)
class Budget:
    max_divergence: float | None = None
    """Highest mean TV divergence per token allowed on any prompt."""
    min_similarity: float | None = None
    """Lowest similarity to the lossless output (relative to the noise floor) on any prompt."""

    def __post_init__(self) -> None:
        if self.max_divergence is None and self.min_similarity is None:
            raise EvaluationError("a budget needs max_divergence and/or min_similarity")
        if self.max_divergence is not None and not 0 < self.max_divergence <= 1:
            raise EvaluationError(f"max_divergence must be in (0, 1], got {self.max_divergence}")
        if self.min_similarity is not None and not 0 < self.min_similarity <= 1:
            raise EvaluationError(f"min_similarity must be in (0, 1], got {self.min_similarity}")

    def violations(self, setting: SettingReport) -> list[str]:
        """What ``setting`` breaks, worst prompt first; empty when it is within budget."""
        found = []
        if self.max_divergence is not None:
            worst = max(setting.prompts, key=lambda r: r.divergence)
            if worst.divergence > self.max_divergence:
                found.append(
                    f"divergence {worst.divergence:.4f} > {self.max_divergence} on {worst.prompt}"
                )
        if self.min_similarity is not None:
            worst = min(setting.prompts, key=lambda r: r.relative_similarity)
            if worst.relative_similarity < self.min_similarity:
                found.append(
                    f"similarity {worst.relative_similarity:.3f} < {self.min_similarity} "
                    f"on {worst.prompt}"
                )
        return found

    def describe(self) -> str:
        parts = []
        if self.max_divergence is not None:
            parts.append(f"max_divergence {self.max_divergence}")
        if self.min_similarity is not None:
            parts.append(f"min_similarity {self.min_similarity}")
        return ", ".join(parts) + " (per prompt, worst case)"


def search_space(policy: Policy, ks: Sequence[int] | None = None) -> list[Policy]:
    """The candidates: every grid point of the policy's rule at every k, with a fixed k and no
    divergence guard (the raw cost of each setting is what is measured)."""
    if policy.acceptance is None:
        msg = f"tune needs a relaxed policy; {policy.name!r} is lossless (nothing to tune)"
        raise PolicyError(msg)
    k = policy.drafter.num_speculative_tokens
    ks = sorted(set(ks)) if ks else sorted({max(1, k // 2), k, min(32, 2 * k)})
    if any(not 1 <= value <= 32 for value in ks):
        raise EvaluationError(f"k values must be between 1 and 32, got {list(ks)}")
    grid = GRIDS[policy.acceptance.rule]
    candidates = []
    for values in itertools.product(*grid.values()):
        params = dict(zip(grid, values, strict=True))
        acceptance = policy.acceptance.model_copy(update={**params, "max_divergence": None})
        for k_value in ks:
            drafter = policy.drafter.fixed(k_value)
            data = policy.model_dump()
            data.update(drafter=drafter.model_dump(), acceptance=acceptance.model_dump())
            candidates.append(Policy.model_validate(data))
    return candidates


@dataclass
class TuneResult:
    policy: Policy
    """The tuned policy: the original with the chosen parameters and k, the budget's
    ``max_divergence`` as its runtime guard, and ``adaptive: false``."""
    chosen: SettingReport
    report: EvalReport
    budget: Budget
    within_budget: int
    source: Policy

    def to_yaml(self) -> str:
        """The policy as YAML, headed by a comment recording what was measured."""
        o = self.chosen.overall()
        costs = self.chosen.costs
        verify = ", ".join(f"{v:g}" for v in costs.verify[:9])
        header = [
            f"Tuned by `specagent tune` from policy {self.source.name!r} "
            f"({setting_label(self.source)}).",
            f"Budget: {self.budget.describe()}.",
            f"Prompt set: {self.report.prompt_set} ({len(self.chosen.prompts)} prompts); "
            f"seeds {self.chosen.seeds} at temperature {self.chosen.temperature:g}; "
            f"target {self.report.target}, draft {self.report.draft}, {self.report.device}.",
            f"Chosen: {self.chosen.label}, the fastest of {len(self.report.settings)} settings "
            f"({self.within_budget} within budget).",
            f"Measured: divergence mean {o['divergence']:.4f} (worst prompt "
            f"{o['max_divergence']:.4f}); similarity {o['similarity']:.3f} (floor "
            f"{o['similarity_floor']:.3f}); ROUGE-L {o['rouge_l']:.3f}; acceptance "
            f"{o['acceptance_rate']:.2f} (lossless {o['twin_acceptance_rate']:.2f}).",
            f"Speed over lossless at the same k: {o['modelled_speed_ratio']:.2f}x modelled, "
            f"{o['speed_ratio']:.2f}x measured; {o['modelled_tokens_per_cost']:.2f} tokens per "
            "target-forward cost.",
            f"Step costs (one target forward = 1): draft {costs.draft_step:g}; "
            f"verify 1..n tokens: {verify}.",
            "adaptive is false because k was chosen by measurement on this prompt set; the",
            "max_divergence guard still switches a call to lossless past the budget.",
        ]
        data = self.policy.model_dump(mode="json", exclude_none=True)
        acceptance = data["acceptance"]
        data["acceptance"] = {"rule": acceptance.pop("rule"), **acceptance}
        body = yaml.safe_dump(_plain(data), sort_keys=False, width=100)
        return "".join(f"# {line}\n" for line in header) + body


def tune(
    runtime: SpecRuntime,
    policy: Policy,
    prompts: Sequence[EvalPrompt],
    budget: Budget,
    *,
    ks: Sequence[int] | None = None,
    seed: int = 0,
    num_seeds: int = 4,
    similarity: TextSimilarity | None = None,
    costs: CostModel | None = None,
    progress: Callable[[str], None] | None = None,
    prompt_set: str = "",
) -> TuneResult:
    """Search ``policy``'s rule parameters and k on ``prompts``; return the fastest setting
    within ``budget``. Raises ``EvaluationError`` when none is (naming the closest)."""
    candidates = search_space(policy, ks)
    report = evaluate(
        runtime,
        candidates,
        prompts,
        similarity=similarity,
        num_seeds=num_seeds,
        seed=seed,
        costs=costs,
        progress=progress,
    )
    report.prompt_set = prompt_set
    feasible = [s for s in report.settings if not budget.violations(s)]
    if not feasible:
        closest = min(
            report.settings, key=lambda s: (len(budget.violations(s)), s.overall()["divergence"])
        )
        msg = (
            f"no setting of {policy.acceptance.rule if policy.acceptance else '?'} stays within "
            f"the budget ({budget.describe()}); closest: {closest.label}: "
            f"{'; '.join(budget.violations(closest))}"
        )
        raise EvaluationError(msg)
    order = {id(s): i for i, s in enumerate(report.settings)}  # grid order: strict first
    chosen = min(
        feasible,
        key=lambda s: (-s.modelled_tokens_per_cost, s.overall()["divergence"], order[id(s)]),
    )
    assert chosen.policy.acceptance is not None
    assert policy.acceptance is not None
    guard = budget.max_divergence or policy.acceptance.max_divergence
    tuned = Policy.model_validate(
        {
            **policy.model_dump(),
            "drafter": chosen.policy.drafter.model_dump(),
            "acceptance": {**chosen.policy.acceptance.model_dump(), "max_divergence": guard},
        }
    )
    return TuneResult(tuned, chosen, report, budget, len(feasible), policy)


def _plain(value: Any) -> Any:
    """Tuples to lists, so the YAML reads like a hand-written policy."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
