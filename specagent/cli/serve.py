"""``specagent serve``: the OpenAI-compatible server over one runtime, or replicas on Ray
Serve behind one ingress; and ``specagent audit``, which reads the store the server writes."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from ..errors import SpecAgentError
from .arguments import engine_options, policy_set, target_and_draft
from .audit_view import print_audit

__all__ = ["audit_command", "serve_command"]

log = logging.getLogger("specagent.server")


def serve_command(args: argparse.Namespace) -> int:
    if args.ray:
        return _serve_on_ray(args)
    try:
        from ..runtime import RuntimeOptions
        from ..server import KeyStore, ServerOptions, serve
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SpecAgentError(
            f'the server needs the server extra: pip install "specagent[server]" ({exc})'
        ) from exc
    keys = KeyStore.load(args.api_keys, open=args.no_auth)  # fails closed before loading models
    tls = _tls(args)
    audit = _audit_store(args)
    target, draft = target_and_draft(args)
    serve(
        target,
        draft=draft,
        policies=policy_set(args.policies),
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
            store_responses=args.store_responses,
            responses_retention_s=args.response_retention,
        ),
        ssl=tls,
        drain_seconds=args.drain_seconds,
        runtime_options=RuntimeOptions(max_queue=args.max_queue),
        dtype=args.dtype,
        engine_options=engine_options(args),
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
    mode = Path(key).stat().st_mode
    if mode & 0o077:
        log.warning(
            "the TLS private key %s is readable by others (mode %o): chmod 600 it",
            key,
            mode & 0o777,
        )
    return str(cert), str(key)


def _audit_store(args: argparse.Namespace) -> Any:
    """The server's audit store (``--audit``, its default path, or none with ``--no-audit``),
    opened before the models load: a store that cannot be opened stops the start."""
    if args.no_audit:
        if args.audit_required:
            raise SpecAgentError("--audit-required needs an audit store; drop --no-audit")
        return None
    try:
        from ..audit import row_bound
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SpecAgentError(
            f'the audit store needs SQLAlchemy: pip install "specagent[server]" ({exc})'
        ) from exc
    max_rows = row_bound(args.audit_max_rows)
    return _open_store(
        _audit_url(args), retention_days=args.audit_retention_days, max_rows=max_rows
    )


def _open_store(url: str, **options: Any) -> Any:
    """``AuditStore(url, **options)``, or ``SpecAgentError`` saying why not: neither the URL's
    password nor the driver's echo of it reaches the terminal."""
    from ..audit import AuditStore, masked, masked_url

    try:
        return AuditStore(url, **options)
    except Exception as exc:
        message = f"cannot open the audit store {masked_url(url)}: {masked(str(exc), url)}"
        raise SpecAgentError(message) from None


def _audit_url(args: argparse.Namespace) -> str:
    """``--audit``, or the default store's URL (``specagent.audit.default_audit_url``)."""
    from ..audit import default_audit_url

    return str(args.audit or default_audit_url())


def audit_command(args: argparse.Namespace) -> int:
    from sqlalchemy.engine import make_url

    from ..audit import default_audit_url, parse_since, policy_summaries, read_calls

    try:
        since = parse_since(args.since)
    except ValueError as exc:
        raise SpecAgentError(str(exc)) from None
    url = args.db or default_audit_url()
    if url.startswith("sqlite"):
        path = make_url(url).database
        if not path or path == ":memory:" or not Path(path).expanduser().is_file():
            raise SpecAgentError(f"no audit store at {url} (the server writes it; see --db)")
    store = _open_store(url, max_rows=None)  # reading deletes nothing: no bound, no retention
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
    target, draft = target_and_draft(args)
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
        "audit_max_rows": args.audit_max_rows,
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
