"""The ``specagent`` command line: demo, doctor, run, serve, bench, eval, tune, policies,
models, keys."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import SpecAgentError
from .arguments import engine_options, policy_set, target_and_draft
from .measure import bench_command, eval_command, tune_command
from .parser import build_parser
from .serve import audit_command, serve_command

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _show_progress()
    try:
        return int(_dispatch(args) or 0)
    except SpecAgentError as exc:
        print(f"specagent: error: {exc}", file=sys.stderr)
        return 2


def _show_progress() -> None:
    """Long work the library does once per machine (timing dtypes, measuring step costs) says
    so through the ``specagent`` logger; on the command line it goes to stderr."""
    logger = logging.getLogger("specagent")
    if logger.handlers or logging.getLogger().handlers:
        return  # the caller (a test, an embedding program) configured logging itself
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("specagent: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _dispatch(args: argparse.Namespace) -> int | None:
    if args.command == "policies":
        from ..policy import load_policies, shipped_policies

        policies = load_policies(args.directory) if args.directory else shipped_policies()
        for policy in policies.defined():
            print(
                f"{policy.name:20s} {policy.mode:9s} {policy.drafter.kind:14s} "
                f"{policy.description[:60]}"
            )
        return 0
    if args.command == "models":
        from ..catalog import CATALOG, PAIRS, cache_dir, gguf_path, resolve_gguf, resolve_model

        if args.action == "list":
            for model in CATALOG.values():
                kept = [
                    label
                    for label, present in (
                        ("gguf", gguf_path(model.name).is_file()),
                        ("transformers", (cache_dir() / "models" / model.name).is_dir()),
                    )
                    if present
                ]
                print(f"{model.name:30s} {'+'.join(kept):17s} {model.note}")
            for pair, (target, draft) in PAIRS.items():
                print(f"pair {pair}: target {target}, draft {draft}")
            return 0
        if args.action == "info":
            return _model_info(args)
        if args.name not in CATALOG:
            known = ", ".join(sorted(CATALOG))
            raise SpecAgentError(f"{args.name!r} is not a catalog model (known: {known})")
        print(resolve_gguf(args.name) if args.gguf else resolve_model(args.name))
        return 0
    if args.command == "audit":
        return audit_command(args)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor(as_json=args.json)
    if args.command == "run":
        return _run(args)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "keys":
        from ..server.keys import hash_key

        print(hash_key(args.key))
        return 0
    if args.command == "bench":
        return bench_command(args)
    if args.command == "eval":
        return eval_command(args)
    if args.command == "tune":
        return tune_command(args)
    from .demo import run_demo

    return run_demo(pair=args.pair, policies=policy_set(args.policies), engine=args.engine)


def _run(args: argparse.Namespace) -> int:
    from ..runtime import SpecRuntime

    target, draft = target_and_draft(args)
    runtime = SpecRuntime.from_pretrained(
        target, draft=draft, policies=policy_set(args.policies), engine=args.engine
    )
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

    runtime = SpecRuntime.from_pretrained(
        args.name,
        draft=args.draft,
        dtype=args.dtype,
        engine_options=engine_options(args),
        engine=args.engine,
    )
    described = {
        "machine": machine_info(),
        "engine": runtime.engine_choice,
        "precision": runtime.precision,
        "compiled_steps": runtime.compiled_steps,
    }
    print(json.dumps(described, indent=1))
    from ..engines import describe

    for line in describe(runtime.engine_choice):
        print(line)
    for role, choice in runtime.precision.items():
        print(f"{role}: {choice['dtype']} ({choice['reason']})")
    for role, step in runtime.compiled_steps.items():
        print(f"{role} steps: {'compiled' if step['compiled'] else 'eager'} ({step['reason']})")
    runtime.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
