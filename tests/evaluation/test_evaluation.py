"""``specagent eval`` and ``tune`` end to end on tiny models, with the real similarity models."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
import yaml
from conftest import perturbed_copy

from specagent import EvaluationError, Policy, PolicyError, SpecRuntime
from specagent.cli import main
from specagent.decoding.costs import CostModel
from specagent.measuring.evaluation import (
    EvalPrompt,
    TextSimilarity,
    evaluate,
    load_prompt_set,
    lossless_twin,
)
from specagent.measuring.tuning import Budget, search_space, tune
from specagent.policy.loader import parse_policy

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    EvalPrompt("hello", [{"role": "user", "content": "Hello world"}], 24),
    EvalPrompt("code", [{"role": "user", "content": "def f(x):"}], 24),
    EvalPrompt("order", [{"role": "user", "content": "Your order"}], 24),
]
# Step costs pinned so that the modelled speed, and so tune's choice, cannot move with timing.
COSTS = CostModel(draft_step=0.1, verify=(1.0,) * 9)


def _policy(mode: str = "relaxed", temperature: float = 0.8, **acceptance: object) -> Policy:
    data: dict[str, object] = {
        "name": "notes",
        "description": "test",
        "mode": mode,
        "drafter": {
            "kind": "draft_model",
            "num_speculative_tokens": 4,
            "confidence_threshold": 0,
            "adaptive": False,  # fixed k: no timing enters the tokens
        },
        "sampling": {"temperature": temperature},
    }
    if mode == "relaxed":
        data["acceptance"] = acceptance or {"rule": "lenience", "lenience": 0.5}
    return Policy.model_validate(data)


@pytest.fixture(scope="module")
def similarity() -> TextSimilarity:
    return TextSimilarity()


@pytest.fixture(scope="module")
def runtime(target, tokenizer):
    # A draft far enough from the target that relaxed rules change what is emitted.
    rt = SpecRuntime(
        target=target, draft=perturbed_copy(target, 0.3, seed=1), tokenizer=tokenizer, device="cpu"
    )
    yield rt
    rt.close()


def test_shipped_prompt_set_loads() -> None:
    prompts = load_prompt_set()
    assert len(prompts) >= 6
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.messages[-1]["role"] == "user" for p in prompts)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"prompt": "hi"}\n{"prompt": "ok"\n', "line 2: not valid JSON"),
        ('{"prompt": "hi"}\n\n["a"]\n', "line 3: expected a JSON object"),
        ('{"id": "a"}\n', "line 1: give exactly one of 'messages' or 'prompt'"),
        ('{"prompt": "hi", "temperature": 1}\n', "line 1: unknown field(s) temperature"),
        ('{"messages": [{"role": "user"}]}\n', "line 1: field 'messages' must be"),
        ('{"prompt": "hi", "max_new_tokens": 0}\n', "'max_new_tokens' must be a positive"),
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "line 2: duplicate id 'a'"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_prompt_sets_name_the_problem(tmp_path: Path, content: str, expected: str) -> None:
    file = tmp_path / "prompts.jsonl"
    file.write_text(content)
    with pytest.raises(EvaluationError, match=r"prompts\.jsonl") as info:
        load_prompt_set(file)
    assert expected in str(info.value)


def test_missing_prompt_set(tmp_path: Path) -> None:
    with pytest.raises(EvaluationError, match=r"nope\.jsonl.*file not found"):
        load_prompt_set(tmp_path / "nope.jsonl")


def test_lossless_against_lossless_greedy_is_identical(runtime, similarity) -> None:
    lossless = _policy(mode="lossless", temperature=0.0)
    report = evaluate(runtime, [lossless], PROMPTS, similarity=similarity, costs=COSTS)
    (setting,) = report.settings
    assert setting.seeds == [0]  # greedy: one seed
    for row in setting.prompts:
        assert row.outputs == row.twin_outputs
        assert (row.similarity, row.rouge_l, row.divergence) == (1.0, 1.0, 0.0)
        assert row.similarity_floor == 1.0
        assert row.modelled_speed_ratio == pytest.approx(1.0)


@pytest.mark.slow  # the whole evaluation
def test_eval_end_to_end(runtime, similarity, tmp_path: Path) -> None:
    settings = [_policy(), _policy(rule="typical"), _policy(rule="top_k", top_k=3, ratio=0.2)]
    report = evaluate(
        runtime, settings, PROMPTS, similarity=similarity, num_seeds=3, seed=7, costs=COSTS
    )
    assert [s.label for s in report.settings] == [
        "lenience lenience=0.5 k=4",
        "typical epsilon=0.3 delta=0.09 k=4",
        "top_k top_k=3 ratio=0.2 k=4",
    ]
    for setting in report.settings:
        assert setting.seeds == [7, 8, 9]
        assert len(setting.prompts) == len(PROMPTS)
        for row in setting.prompts:
            assert len(row.outputs) == len(row.twin_outputs) == 3
            assert 0.0 <= row.divergence <= 1.0
            assert -1.0 <= row.similarity <= 1.0
            assert 0.0 <= row.rouge_l <= 1.0
            assert row.speed_ratio > 0
            # Samples of different seeds differ: the floor is a real measurement, not 1.
            assert row.similarity_floor < 1.0
        overall = setting.overall()
        assert overall["acceptance_rate"] >= overall["twin_acceptance_rate"]
    lenience = report.settings[0].overall()
    assert lenience["divergence"] > 0.05  # the draft is far off: relaxing costs something
    assert lenience["modelled_speed_ratio"] > 1.0

    json_path, png_path = report.save(tmp_path, "eval")
    data = json.loads(json_path.read_text())
    assert data["settings"][0]["policy"]["acceptance"]["rule"] == "lenience"
    assert set(data["settings"][0]["overall"]) >= {"divergence", "similarity", "speed_ratio"}
    assert png_path.stat().st_size > 1000
    page = (tmp_path / "eval.html").read_text()  # the report as a page, what /dashboard links
    assert "src='data:image/png;base64," in page  # the chart inside it: nothing to fetch
    for setting in report.settings:
        assert html.escape(setting.label) in page
        assert not any(out in page for row in setting.prompts for out in row.outputs if out)
    assert page.count("<tr><td>") == len(report.settings) * len(PROMPTS)  # a row per prompt
    table = report.table()
    assert "typical epsilon=0.3" in table


@pytest.mark.slow  # a tuning search over the rules' grid
def test_tune_stays_within_budget_on_a_known_curve(runtime, similarity) -> None:
    policy = _policy()
    # The curve: at each k, divergence rises as lenience falls, and so does the modelled speed.
    curve = evaluate(
        runtime,
        search_space(policy, [2, 4]),
        PROMPTS,
        similarity=similarity,
        num_seeds=2,
        costs=COSTS,
    )
    by_k: dict[int, list[tuple[float, float, float]]] = {}
    for s in curve.settings:
        assert s.policy.acceptance is not None
        by_k.setdefault(s.policy.drafter.num_speculative_tokens, []).append(
            (
                s.policy.acceptance.lenience,
                s.overall()["max_divergence"],
                s.modelled_tokens_per_cost,
            )  # type: ignore[union-attr]
        )
    for points in by_k.values():
        points.sort(reverse=True)  # strict (lenience 0.9) to loose (0.2)
        divergences = [d for _, d, _ in points]
        assert divergences == sorted(divergences)
        assert points[-1][2] > points[0][2]
    all_max = sorted(s.overall()["max_divergence"] for s in curve.settings)
    budget = Budget(max_divergence=all_max[len(all_max) // 2])

    result = tune(
        runtime,
        policy,
        PROMPTS,
        budget,
        ks=[2, 4],
        num_seeds=2,
        similarity=similarity,
        costs=COSTS,
    )
    chosen = result.chosen
    assert chosen.overall()["max_divergence"] <= budget.max_divergence  # type: ignore[operator]
    assert not budget.violations(chosen)
    for s in result.report.settings:  # everything faster than the choice breaks the budget
        if s.modelled_tokens_per_cost > chosen.modelled_tokens_per_cost:
            assert budget.violations(s), s.label
    assert 0 < result.within_budget < len(result.report.settings)

    tuned = result.policy
    assert tuned.acceptance is not None
    assert tuned.acceptance.max_divergence == budget.max_divergence
    assert tuned.drafter.adaptive is False
    assert tuned.drafter.num_speculative_tokens == chosen.policy.drafter.num_speculative_tokens
    text = result.to_yaml()
    assert text.startswith("# Tuned by `specagent tune` from policy 'notes'")
    assert parse_policy(yaml.safe_load(text)) == tuned

    again = tune(
        runtime,
        policy,
        PROMPTS,
        budget,
        ks=[2, 4],
        num_seeds=2,
        similarity=similarity,
        costs=COSTS,
    )
    assert again.policy == tuned  # deterministic given the seed


def test_tune_errors(runtime, similarity) -> None:
    with pytest.raises(PolicyError, match="tune needs a relaxed policy; 'notes' is lossless"):
        tune(runtime, _policy(mode="lossless"), PROMPTS, Budget(max_divergence=0.1))
    with pytest.raises(EvaluationError, match="needs max_divergence and/or min_similarity"):
        Budget()
    with pytest.raises(EvaluationError, match="k values must be between 1 and 32"):
        search_space(_policy(), [0, 4])
    with pytest.raises(EvaluationError, match="no setting of lenience stays within the budget"):
        tune(
            runtime,
            _policy(),
            PROMPTS[:1],
            Budget(max_divergence=1e-6),
            ks=[4],
            num_seeds=2,
            similarity=similarity,
            costs=COSTS,
        )


def test_lossless_twin_keeps_everything_but_acceptance() -> None:
    relaxed = _policy()
    twin = lossless_twin(relaxed)
    assert twin.mode == "lossless"
    assert twin.acceptance is None
    assert (twin.drafter, twin.sampling) == (relaxed.drafter, relaxed.sampling)


def test_cli_errors_name_the_input(tmp_path: Path, capsys) -> None:
    policies = str(ROOT / "policies")
    missing = str(tmp_path / "missing.jsonl")
    assert (
        main(
            [
                "tune",
                "--policy",
                "legal-drafting",
                "--policies",
                policies,
                "--max-divergence",
                "0.1",
            ]
        )
        == 2
    )
    assert "'legal-drafting' is lossless" in capsys.readouterr().err
    assert (
        main(["eval", "--policy", "internal-summary", "--policies", policies, "--prompts", missing])
        == 2
    )
    assert "missing.jsonl': file not found" in capsys.readouterr().err
    assert main(["tune", "--policy", "internal-summary", "--policies", policies]) == 2
    assert "needs max_divergence and/or min_similarity" in capsys.readouterr().err
