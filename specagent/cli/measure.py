"""The measuring commands: ``specagent bench`` (specagent beside what a user would run
instead), ``eval`` (what relaxed policies cost against their lossless twins) and ``tune``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from ..decoding.registry import RULES
from ..machine import machine_kind
from .arguments import engine_options, policy_set, target_and_draft

__all__ = ["bench_command", "eval_command", "tune_command"]


def bench_command(args: argparse.Namespace) -> int:
    from ..engines.tools import engine_tools
    from ..runtime import SpecRuntime

    target, draft = target_and_draft(args)
    workload = WORKLOADS[args.workload]
    # The runtime's default options, prefix cache on, as a user runs it: each method reuses
    # what its last call's KV shares with the next prompt, as the baselines' processes do
    # (``measuring.baselines.start_round``). Agent episodes also run specagent paying every
    # prefill.
    runtime = SpecRuntime.from_pretrained(
        target,
        draft=draft,
        policies=workload.policies(draft is not None),
        dtype=args.dtype,
        draft_dtype=args.draft_dtype or args.dtype,
        engine_options=engine_options(args),
        engine=args.engine,
    )
    # Named by benchmark, engine and machine kind: a newer run of the same replaces it.
    stem = args.name or (
        f"bench-{args.workload}_{runtime.engine.replace('.', '-')}_"
        f"{args.pair or Path(target).name}_{machine_kind()}"
    )
    max_new_tokens = args.max_new_tokens or workload.max_new_tokens
    tools = engine_tools(runtime.engine)
    with tools.other_programs(runtime, max_new_tokens, args.llama_server) as others:
        written = workload.run(
            runtime,
            args,
            max_new_tokens=max_new_tokens,
            target_name=Path(target).name,
            draft_name=Path(draft).name if draft else None,
            baselines=others.methods,
            new_round=others.new_round,
            stem=stem,
        )
    runtime.close()
    print(f"wrote {' and '.join(str(p) for p in written)}")
    return 0


@dataclass(frozen=True)
class Workload:
    """One ``--workload``: its policies, its default token budget and how it runs and saves
    (returning the files written)."""

    policies: Callable[[bool], list[Any]]
    max_new_tokens: int
    run: Callable[..., list[Path]]


def _prompts(runtime: Any, args: argparse.Namespace, *, stem: str, **options: Any) -> list[Path]:
    from ..measuring.bench import run_bench, save

    result = run_bench(runtime, repeats=args.repeats, methods=args.methods, **options)
    print(json.dumps(result.summary, indent=1))
    return save(result, args.out, stem, chart=args.chart)


def _agent(runtime: Any, args: argparse.Namespace, *, stem: str, **options: Any) -> list[Path]:
    from ..measuring.agent_bench import run_agent_bench, save_agent_bench

    outcome = run_agent_bench(runtime, repeats=args.repeats, methods=args.methods, **options)
    print(json.dumps(outcome.summary, indent=1))
    return save_agent_bench(outcome, args.out, stem, chart=args.chart)


def _edits(runtime: Any, args: argparse.Namespace, *, stem: str, **options: Any) -> list[Path]:
    from ..measuring.edit_bench import run_edit_bench, save_edit_bench

    options.pop("draft_name")
    result = run_edit_bench(
        runtime, repeats=args.repeats, methods=args.methods, tasks=args.tasks, **options
    )
    print(json.dumps(result.summary, indent=1))
    return [save_edit_bench(result, args.out, stem)]


def _policies(module: str, name: str) -> Callable[[bool], list[Any]]:
    def policies(has_draft: bool) -> list[Any]:
        return getattr(import_module(f"..measuring.{module}", __package__), name)(has_draft)

    return policies


WORKLOADS = {
    "prompts": Workload(_policies("bench", "bench_policies"), 48, _prompts),
    "agent": Workload(_policies("agent_bench", "agent_policies"), 32, _agent),
    "edits": Workload(_policies("edit_bench", "edit_policies"), 1024, _edits),
}


def _load_named_policy(ref: str, directory: str | None) -> Any:
    from ..policy import load_policy

    if ref.endswith((".yaml", ".yml")) or Path(ref).is_file():
        return load_policy(ref)
    return policy_set(directory)[ref]


def _eval_inputs(args: argparse.Namespace) -> tuple[Any, list[Any], str]:
    """The runtime (no policies of its own), the prompts and the prompt set's name."""
    from ..measuring.evaluation import default_prompt_set, load_prompt_set
    from ..runtime import SpecRuntime

    prompts = load_prompt_set(args.prompts)
    if args.limit is not None:
        prompts = prompts[: max(args.limit, 1)]
    target, draft = target_and_draft(args)
    runtime = SpecRuntime.from_pretrained(target, draft=draft, engine=args.engine)
    return runtime, prompts, str(args.prompts or default_prompt_set().name)


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="prompt", file=sys.stderr)

    def step(label: str) -> None:
        bar.set_description(label[:48])
        bar.update(1)

    step.close = bar.close  # type: ignore[attr-defined]
    return step


def eval_command(args: argparse.Namespace) -> int:
    from ..measuring.evaluation import evaluate

    settings = []
    for ref in args.policy:
        policy = _load_named_policy(ref, args.policies)
        settings.append(policy)
        for rule in args.rule or ():
            guard = policy.acceptance.max_divergence if policy.acceptance else None
            acceptance = RULES[rule].config(rule=rule, max_divergence=guard)
            if policy.acceptance is None or acceptance != policy.acceptance:
                variant = {**policy.model_dump(), "mode": "relaxed"}
                variant["acceptance"] = acceptance.model_dump()
                settings.append(type(policy).model_validate(variant))
    runtime, prompts, source = _eval_inputs(args)
    progress = _progress(len(settings) * len(prompts))
    report = evaluate(
        runtime,
        settings,
        prompts,
        num_seeds=args.seeds,
        seed=args.seed,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        progress=progress,
    )
    progress.close()
    report.prompt_set = source
    print(report.table())
    stem = args.name or f"eval_{Path(report.target).name}_{machine_kind()}"
    json_path, png_path = report.save(args.out, stem)
    page = json_path.with_suffix(".html")
    print(f"wrote {json_path}, {png_path} and {page} (`specagent serve --reports {args.out}`)")
    runtime.close()
    return 0


def tune_command(args: argparse.Namespace) -> int:
    from ..errors import EvaluationError
    from ..measuring.tuning import Budget, search_space, tune

    policy = _load_named_policy(args.policy, args.policies)
    budget = Budget(max_divergence=args.max_divergence, min_similarity=args.min_similarity)
    try:
        ks = [int(v) for v in args.k.split(",")] if args.k else None
    except ValueError:
        raise EvaluationError(f"--k takes comma-separated integers, got {args.k!r}") from None
    candidates = search_space(policy, ks)  # refuses a lossless policy before loading models
    runtime, prompts, source = _eval_inputs(args)
    progress = _progress(len(candidates) * len(prompts))
    result = tune(
        runtime,
        policy,
        prompts,
        budget,
        ks=ks,
        seed=args.seed,
        num_seeds=args.seeds,
        progress=progress,
        prompt_set=source,
    )
    progress.close()
    print(result.report.table())
    out = args.out or Path("tuned") / f"{policy.name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result.to_yaml())
    if args.report:
        result.report.save(args.report, f"tune_{policy.name}")
    print(f"chose {result.chosen.label}; wrote {out}")
    runtime.close()
    return 0
