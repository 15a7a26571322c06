"""What several commands' arguments share: the default model, the dtypes, and the option
groups for a model pair, an engine, compiled steps and an evaluation."""

from __future__ import annotations

import argparse
from typing import Any

from ..engines import ENGINES

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "PAIR_CHOICES",
    "POLICIES_HELP",
]

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
"""The model ``run``, ``demo`` and ``bench`` use when none is named: small enough for a CPU
(about 1 GB to fetch once), instruction-tuned well enough that its answers read well."""

PAIR_CHOICES = ["qwen2.5-coder"]
DTYPES = ["auto", "float32", "bfloat16", "float16"]
DEFAULT_AUDIT_HELP = "sqlite:///$XDG_DATA_HOME/specagent/audit.sqlite (~/.local/share)"
POLICIES_HELP = (
    "a directory of policy YAML files that adds to the shipped policies and replaces any of "
    "the same name (default: the shipped policies only)"
)


def command(
    sub: argparse._SubParsersAction, name: str, summary: str, description: str
) -> argparse.ArgumentParser:
    """A sub-command whose one-line ``summary`` shows in ``specagent --help`` and whose
    ``description`` opens its own ``--help``."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    return parser


def model_options(parser: argparse.ArgumentParser, policies: bool = True) -> None:
    parser.add_argument(
        "--target", default=DEFAULT_MODEL, help="catalog name, local path or hub id"
    )
    parser.add_argument("--draft", help="draft model (same tokenizer): name, path or hub id")
    parser.add_argument(
        "--pair", choices=PAIR_CHOICES, help="a named target/draft pair (overrides both)"
    )
    if policies:
        parser.add_argument("--policies", default=None, help=POLICIES_HELP)
    engine_option(parser)


def engine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        default="auto",
        choices=list(ENGINES),
        help="what runs the forwards: auto takes llama.cpp for a GGUF model (a .gguf file or "
        "a catalog name) on a CPU when llama-cpp-python is installed, transformers otherwise",
    )


def eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", help="JSONL prompt set (default: the one shipped)")
    parser.add_argument("--limit", type=int, help="use only the first N prompts")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per prompt at temperature > 0")
    parser.add_argument("--seed", type=int, default=0, help="first seed")


def compile_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile-steps",
        default="auto",
        choices=["auto", "on", "off"],
        help="few-token forwards compiled over the KV slots where measured faster: auto "
        "measures on CUDA and elsewhere reuses this machine's earlier decision; on measures "
        "here (minutes on a small CPU, once per machine); off keeps eager steps",
    )


def policy_set(directory: str | None) -> Any:
    """The shipped policies, plus (and overridden by) those of ``directory``."""
    from ..policy import load_policies, shipped_policies

    shipped = shipped_policies()
    return load_policies(directory, extends=shipped) if directory else shipped


def target_and_draft(args: argparse.Namespace) -> tuple[str, str | None]:
    from ..catalog import PAIRS

    return PAIRS[args.pair] if args.pair else (args.target, args.draft)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's options the command line sets: ``--compile-steps`` as the transformers
    engine's ``compile_steps`` (auto: not set, so that llama.cpp, which takes no such option,
    runs too)."""
    compile_steps = {"on": True, "off": False}.get(args.compile_steps)
    return {} if compile_steps is None else {"compile_steps": compile_steps}
