"""``specagent serve``'s arguments: the server, its keys and limits, the audit store and
TLS, and replicas on Ray Serve."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import DEFAULT_AUDIT_HELP, DTYPES, command, compile_option, model_options

__all__ = ["add_serve"]


def add_serve(sub: argparse._SubParsersAction) -> None:
    serve = command(
        sub,
        "serve",
        "an OpenAI-compatible HTTP server with API keys, limits, policies and metrics",
        "Loads the model (and draft) once and serves POST /v1/chat/completions (JSON or "
        "server-sent events), GET /v1/models, /health, /ready and /metrics. A call chooses its "
        "policy with metadata.specagent_policy, the X-Specagent-Policy header or the model name "
        "'<model>:<policy>'. Every request needs an API key (Authorization: Bearer) from "
        "--api-keys or SPECAGENT_API_KEYS; SIGTERM drains the calls in flight.",
    )
    model_options(serve)
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
        "--no-response-store",
        dest="store_responses",
        action="store_false",
        help="keep no Responses API responses (store and previous_response_id are refused)",
    )
    serve.add_argument(
        "--response-retention",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="how long a stored Responses API response is kept, in memory",
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
    _serve_audit_and_tls(serve)
    _serve_on_ray(serve)


def _serve_audit_and_tls(serve: argparse.ArgumentParser) -> None:
    """Where calls are recorded, HTTPS, draining, the dtype and compiled steps."""
    serve.add_argument(
        "--audit",
        default=None,
        metavar="URL",
        help="the audit store every call's row goes to (who called which policy, when, with "
        "what result and quality; never the text): sqlite:///PATH or postgresql://... "
        f"(default: {DEFAULT_AUDIT_HELP})",
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
        type=_positive_days,
        default=None,
        metavar="DAYS",
        help="delete audit rows older than this, hourly (default: keep them)",
    )
    serve.add_argument(
        "--audit-max-rows",
        type=_rows,
        default=None,
        metavar="ROWS",
        help="the most rows an audit table keeps: past it, its oldest rows are deleted and "
        "counted (default: ten million; 0: no bound)",
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
    compile_option(serve)


def _serve_on_ray(serve: argparse.ArgumentParser) -> None:
    """Replicas on Ray Serve."""
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


def _positive_days(value: str) -> float:
    days = float(value)
    if not days > 0:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 days (leave it out to keep rows): {value}"
        )
    return days


def _rows(value: str) -> int:
    rows = int(value)
    if rows < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no bound) or more: {value}")
    return rows
