"""The ``specagent`` command line: demo, doctor, run, serve, bench, eval, tune, policies,
models, keys."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..decoding.registry import RULES
from ..errors import SpecAgentError
from ..machine import machine_kind
from .audit_view import print_audit
from .parser import build_parser

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
        return _audit(args)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor(as_json=args.json)
    if args.command == "run":
        return _run(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "keys":
        from ..server.keys import hash_key

        print(hash_key(args.key))
        return 0
    if args.command == "bench":
        return _bench(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "tune":
        return _tune(args)
    from .demo import run_demo

    return run_demo(pair=args.pair, policies=_policy_set(args.policies), engine=args.engine)


def _policy_set(directory: str | None) -> Any:
    """The shipped policies, plus (and overridden by) those of ``directory``."""
    from ..policy import load_policies, shipped_policies

    shipped = shipped_policies()
    return load_policies(directory, extends=shipped) if directory else shipped


def _target_and_draft(args: argparse.Namespace) -> tuple[str, str | None]:
    from ..catalog import PAIRS

    return PAIRS[args.pair] if args.pair else (args.target, args.draft)


def _run(args: argparse.Namespace) -> int:
    from ..runtime import SpecRuntime

    target, draft = _target_and_draft(args)
    runtime = SpecRuntime.from_pretrained(
        target, draft=draft, policies=_policy_set(args.policies), engine=args.engine
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


def _compile_steps(args: argparse.Namespace) -> bool | None:
    """``--compile-steps`` as ``SpecRuntime``'s ``compile_steps`` (auto: None)."""
    return {"on": True, "off": False}.get(args.compile_steps)


def _serve(args: argparse.Namespace) -> int:
    if args.ray:
        return _serve_on_ray(args)
    try:
        from ..server import KeyStore, ServerOptions, serve
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SpecAgentError(
            f'the server needs the server extra: pip install "specagent[server]" ({exc})'
        ) from exc
    keys = KeyStore.load(args.api_keys, open=args.no_auth)  # fails closed before loading models
    tls = _tls(args)
    audit = _audit_store(args)
    target, draft = _target_and_draft(args)
    serve(
        target,
        draft=draft,
        policies=_policy_set(args.policies),
        host=args.host,
        port=args.port,
        keys=keys,
        options=ServerOptions(
            max_body_bytes=args.max_body_bytes,
            default_policy=args.default_policy,
            max_tokens=args.max_tokens,
            timeout_s=args.timeout,
            max_concurrent=args.max_concurrent,
            metrics_public=args.metrics_public,
            reports_dir=args.reports,
            dashboard=args.dashboard,
            audit=audit,
            audit_required=args.audit_required,
        ),
        ssl=tls,
        drain_seconds=args.drain_seconds,
        dtype=args.dtype,
        max_queue=args.max_queue,
        compile_steps=_compile_steps(args),
        engine=args.engine,
    )
    return 0


def _tls(args: argparse.Namespace) -> tuple[str, str] | None:
    """``--ssl-certfile`` and ``--ssl-keyfile``, both or neither, readable."""
    cert, key = args.ssl_certfile, args.ssl_keyfile
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise SpecAgentError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    for path in (cert, key):
        if not Path(path).is_file():
            raise SpecAgentError(f"no such file: {path}")
    return str(cert), str(key)


def _audit_store(args: argparse.Namespace) -> Any:
    """The server's audit store (``--audit``, its default path, or none with ``--no-audit``),
    opened before the models load: a store that cannot be opened stops the start."""
    if args.no_audit:
        if args.audit_required:
            raise SpecAgentError("--audit-required needs an audit store; drop --no-audit")
        return None
    try:
        from ..audit import AuditStore
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SpecAgentError(
            f'the audit store needs SQLAlchemy: pip install "specagent[server]" ({exc})'
        ) from exc
    url = _audit_url(args)
    try:
        return AuditStore(url, retention_days=args.audit_retention_days)
    except Exception as exc:
        raise SpecAgentError(f"cannot open the audit store {url}: {exc}") from exc


def _audit_url(args: argparse.Namespace) -> str:
    """``--audit``, or the default store's URL (``specagent.audit.default_audit_url``)."""
    from ..audit import default_audit_url

    return str(args.audit or default_audit_url())


def _audit(args: argparse.Namespace) -> int:
    from ..audit import AuditStore, default_audit_url, parse_since, policy_summaries, read_calls

    try:
        since = parse_since(args.since)
    except ValueError as exc:
        raise SpecAgentError(str(exc)) from None
    store = AuditStore(args.db or default_audit_url())
    try:
        filters = {"since": since, "policy": args.policy, "key": args.key}
        rows = read_calls(store.engine, limit=args.limit, **filters)
        summaries = policy_summaries(store.engine, **filters)
    finally:
        store.close()
    print_audit(rows, summaries, args.format)
    return 0


def _serve_on_ray(args: argparse.Namespace) -> int:
    try:
        from ..server import ray_app
    except ImportError as exc:  # pragma: no cover - depends on the install
        msg = f'--ray needs the ray extra: pip install "specagent[ray]" ({exc})'
        raise SpecAgentError(msg) from exc
    groups = {}
    for spec in args.group:
        name, sep, members = spec.partition("=")
        if not sep or not name or not members:
            raise SpecAgentError(f"--group takes NAME=POLICY,POLICY; got {spec!r}")
        groups[name] = [m.strip() for m in members.split(",") if m.strip()]
    target, draft = _target_and_draft(args)
    options = {
        "target": target,
        "draft": draft,
        "policies": args.policies,
        "replicas": args.replicas,
        "groups": groups,
        "cpus_per_replica": args.cpus_per_replica,
        "gpus_per_replica": args.gpus_per_replica,
        "key_file": str(args.api_keys) if args.api_keys else None,
        "no_auth": args.no_auth,
        "audit": None if args.no_audit else _audit_url(args),
        "audit_required": args.audit_required,
        "audit_retention_days": args.audit_retention_days,
    }
    tls = _tls(args)
    if args.write_config:
        path = ray_app.write_config(
            args.write_config, host=args.host, port=args.port, ssl=tls, **options
        )
        print(f"wrote {path}; deploy it with: serve deploy {path}")
        return 0
    import ray
    from ray import serve

    from ..server import KeyStore

    KeyStore.load(args.api_keys, open=args.no_auth)  # fail closed here, before Ray starts
    ray.init()  # joins the cluster at RAY_ADDRESS if there is one, else starts a local one
    http: dict[str, Any] = {"host": args.host, "port": args.port}
    if tls:
        http.update(ssl_certfile=tls[0], ssl_keyfile=tls[1])
    serve.start(http_options=http)
    serve.run(
        ray_app.app_builder({k: v for k, v in options.items() if v is not None}),
        name="specagent",
        route_prefix="/",
        blocking=True,
    )
    return 0


def _model_info(args: argparse.Namespace) -> int:
    from ..machine import machine_info
    from ..runtime import SpecRuntime

    runtime = SpecRuntime.from_pretrained(
        args.name,
        draft=args.draft,
        dtype=args.dtype,
        compile_steps=_compile_steps(args),
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


def _bench(args: argparse.Namespace) -> int:
    from ..bench import bench_policies, run_bench, save
    from ..llama_server import llama_server_methods
    from ..runtime import SpecRuntime

    target, draft = _target_and_draft(args)
    agent = args.workload == "agent"
    if agent:
        from ..agent_bench import agent_policies, run_agent_bench, save_agent_bench

    # Single prompts: no prefix reuse, every method pays its own prefill, as the baselines do
    # (benchmarks/runtime_load.py measures what reuse saves). Agent episodes run specagent both
    # ways: paying every prefill, and as an agent runs it (each turn from the last one's KV).
    runtime = SpecRuntime.from_pretrained(
        target,
        draft=draft,
        policies=(agent_policies if agent else bench_policies)(draft is not None),
        prefix_cache_tokens=65536 if agent else 0,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype or args.dtype,
        compile_steps=_compile_steps(args),
        engine=args.engine,
    )
    # Named by benchmark, engine and machine kind: a newer run of the same replaces it.
    stem = args.name or (
        f"bench-{args.workload}_{runtime.engine.replace('.', '-')}_"
        f"{args.pair or Path(target).name}_{machine_kind()}"
    )
    max_new_tokens = args.max_new_tokens or (32 if agent else 48)
    with llama_server_methods(runtime, max_new_tokens, args.llama_server) as servers:
        if runtime.engine == "llama.cpp" and not servers:
            print(
                "no llama-server binary found: its baselines are left out "
                "(--llama-server PATH, or `python benchmarks/llama_server.py build`)",
                file=sys.stderr,
            )
        if agent:
            outcome = run_agent_bench(
                runtime,
                max_new_tokens=max_new_tokens,
                repeats=args.repeats,
                methods=args.methods,
                target_name=Path(target).name,
                draft_name=Path(draft).name if draft else None,
                baselines=servers,
            )
        else:
            result = run_bench(
                runtime,
                max_new_tokens=max_new_tokens,
                target_name=Path(target).name,
                draft_name=Path(draft).name if draft else None,
                repeats=args.repeats,
                methods=args.methods,
                baselines=servers,
            )
    runtime.close()
    if agent:
        json_path, png_path = save_agent_bench(outcome, args.out, stem)
        print(json.dumps(outcome.summary, indent=1))
        print(f"wrote {json_path} and {png_path}")
        return 0
    json_path, png_path = save(result, args.out, stem)
    print(json.dumps(result.summary, indent=1))
    print(f"wrote {json_path} and {png_path}")
    return 0


def _load_named_policy(ref: str, directory: str | None) -> Any:
    from ..policy import load_policy

    if ref.endswith((".yaml", ".yml")) or Path(ref).is_file():
        return load_policy(ref)
    return _policy_set(directory)[ref]


def _eval_inputs(args: argparse.Namespace) -> tuple[Any, list[Any], str]:
    """The runtime (no policies of its own), the prompts and the prompt set's name."""
    from ..evaluation import default_prompt_set, load_prompt_set
    from ..runtime import SpecRuntime

    prompts = load_prompt_set(args.prompts)
    if args.limit is not None:
        prompts = prompts[: max(args.limit, 1)]
    target, draft = _target_and_draft(args)
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
    stem = args.name or f"eval_{Path(report.target).name}_{machine_kind()}"
    json_path, png_path = report.save(args.out, stem)
    page = json_path.with_suffix(".html")
    print(f"wrote {json_path}, {png_path} and {page} (`specagent serve --reports {args.out}`)")
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
