"""``specagent bench --workload edits``: its tasks tell an applied edit from the untouched text,
and the bench runs every method (with and without the prediction) on a tiny runtime, checks
lossless outputs against plain greedy, times each task's floor and writes its result."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import make_model, perturbed_copy

from specagent import SpecRuntime
from specagent.cli.parser import build_parser
from specagent.measuring.edit_bench import edit_policies, run_edit_bench, save_edit_bench
from specagent.measuring.edit_tasks import edit_tasks, extract_text, rewrite_task


def test_every_task_tells_its_edit_from_the_untouched_text() -> None:
    tasks = [*edit_tasks(), rewrite_task()]
    kinds = {t.kind for t in tasks}
    assert {"rename", "add_parameter", "change_literal", "fix_bug", "reorder"} <= kinds
    assert {"change_date", "add_sentence", "update_config", "rewrite"} <= kinds
    for task in tasks:
        assert task.applied(f"Here it is:\n```{task.language}\n{task.expected}\n```"), task.id
        assert not task.applied(f"```{task.language}\n{task.text}\n```"), task.id
        assert task.similarity(f"```\n{task.expected}\n```") == 1.0
        assert len(task.text.splitlines()) >= 10
    code = [t for t in tasks if t.language == "python"]
    assert any(len(t.text.splitlines()) >= 100 for t in code)  # a whole file among them
    assert rewrite_task().prediction == rewrite_task().expected
    assert all(t.prediction == t.text for t in tasks if t.kind != "rewrite")
    assert extract_text("no fence at all") == "no fence at all"


def test_the_bench_runs_every_method_on_a_tiny_runtime(tokenizer, tmp_path: Path) -> None:
    # The byte-level test tokenizer spells a task's text in ~2,000 tokens: a 4k window.
    target = make_model(len(tokenizer), layers=2, seed=5, max_positions=4096)
    runtime = SpecRuntime(
        target=target,
        draft=perturbed_copy(target, scale=0.05, seed=6),
        tokenizer=tokenizer,
        policies=edit_policies(True),
        device="cpu",
    )
    try:
        result = run_edit_bench(
            runtime,
            max_new_tokens=8,
            tasks=["config-yaml-reorder", "rewrite-json-as-yaml"],
            methods=["specagent_lossless-auto", "specagent_lossless-auto+prediction"],
            log=lambda _: None,
        )
    finally:
        runtime.close()
    assert set(result.tasks) == {"config-yaml-reorder", "rewrite-json-as-yaml"}
    for rows in result.tasks.values():
        assert set(rows) == {
            "plain",
            "specagent_lossless-auto",
            "specagent_lossless-auto+prediction",
        }
        for name, row in rows.items():
            assert row.tokens > 0
            assert isinstance(row.applied, bool)
            if name != "plain":
                assert row.equal_to_plain, name  # float32: lossless is plain, token for token
    summary = result.summary
    assert summary["divergences"]["specagent_lossless-auto"]["other"] == 0
    assert set(summary["speedup_vs_best_baseline"]) == {
        "specagent_lossless-auto",
        "specagent_lossless-auto+prediction",
    }
    # Each task's floor: one prefill over its prompt and plain's output, reported beside the
    # methods as the least any lossless method needs, and the ceiling it sets on the baselines.
    assert set(result.floors) == set(result.tasks)
    assert all(seconds > 0 for seconds in result.floors.values())
    floor = summary["floor"]
    assert set(floor["share_of_floor"]) == set(next(iter(result.tasks.values())))
    assert set(floor["ceiling_vs_best_baseline"]["per_task"]) == set(result.tasks)
    assert set(floor["ceiling_vs"]) == {"plain"}
    path = save_edit_bench(result, tmp_path, "edits")
    saved = json.loads(path.read_text())
    assert saved["floors"] == result.floors
    assert saved["machine"]["cpu"]
    assert saved["kinds"]["rewrite-json-as-yaml"] == "rewrite"


def test_the_cli_takes_the_edits_workload() -> None:
    args = build_parser().parse_args(
        ["bench", "--target", "x", "--workload", "edits", "--tasks", "rename-dedent"]
    )
    assert args.workload == "edits"
    assert args.tasks == ["rename-dedent"]
    assert args.chart is False
