"""Scale-out on Ray Serve: the same OpenAI-compatible app in front of N runtime replicas.

::

    ingress (1 replica: keys, limits, policies, the wire format; specagent.server.app)
       |  RemoteBackend: the call's policy -> its replica group
       v
    spec-default  [SpecReplica x N]     a SpecRuntime each, on its own CPU or GPU slot
    spec-<group>  [SpecReplica x M]     policies pinned to their own replicas (isolation)

Routing keeps a conversation on the replica that served it before (``PrefixAffinityRouter``:
rendezvous hashing of the conversation's first messages, so the replica's prefix cache and
history hold its prefix), falling back to the least loaded replica when that one is full.
``serve run specagent.server.ray_app:app_builder target=... replicas=2`` or
``specagent serve --ray`` deploys it; ``write_config`` writes a Serve config file for a cluster.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import yaml
from ray import exceptions as ray_exceptions
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ..backend import Backend
from ..call import Call
from ..errors import GenerationError, SpecAgentError
from ..policy import PolicySet, load_policies, shipped_policies
from ..results import StreamChunk
from .app import ServerOptions, create_app
from .keys import KeyStore

log = logging.getLogger(__name__)

__all__ = [
    "PrefixAffinityRouter",
    "RemoteBackend",
    "SpecReplica",
    "app_builder",
    "build_app",
    "conversation_key",
    "rank_replicas",
    "write_config",
]

DEFAULT_GROUP = "default"


def conversation_key(prompt: Any) -> str:
    """What identifies a conversation across its turns: its first two messages (the system
    prompt and the opening question), or the prompt's first 256 characters or ids."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
        head: Any = [(m.get("role"), m.get("content")) for m in prompt[:2]]
    elif isinstance(prompt, str):
        head = prompt[:256]
    else:
        head = list(prompt or ())[:256]
    return hashlib.sha256(json.dumps(head, default=str).encode()).hexdigest()


def rank_replicas(key: str, replicas: Sequence[str]) -> list[str]:
    """Replica ids by rendezvous (highest random weight) hashing of ``key``: the first is the
    conversation's home; a replica that joins or leaves moves only the conversations whose
    home it is."""

    def weight(replica: str) -> int:
        return int.from_bytes(hashlib.sha256(f"{key}:{replica}".encode()).digest()[:8], "big")

    return sorted(replicas, key=weight, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Ranks replicas for a call: first the one its conversation hashes to (highest random
    weight, so adding or losing a replica moves only the conversations that lived there), then
    the others. Ray Serve takes the first rank with a free slot, and within a rank the replica
    with the shortest queue."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None or len(candidate_replicas) < 2 or not pending_request.args:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        call: Call = pending_request.args[0]  # SpecReplica.stream's: the Call
        ranked = rank_replicas(conversation_key(call.prompt), list(by_id))
        return [[by_id[ranked[0]]], [by_id[i] for i in ranked[1:]]]


@serve.deployment
class SpecReplica:
    """One runtime on one slot. ``stream`` yields the runtime's ``StreamChunk``s; a caller
    that stops reading cancels the call here."""

    def __init__(
        self,
        target: str,
        draft: str | None,
        policies: PolicySet,
        threads: int | None,
        runtime_options: dict[str, Any],
        ingress_token: str,
    ) -> None:
        import torch

        from ..runtime import SpecRuntime

        if threads:
            torch.set_num_threads(threads)
        self._token = ingress_token
        self.runtime = SpecRuntime.from_pretrained(
            target, draft=draft, policies=policies, **runtime_options
        ).start()

    async def stream(
        self, call: Call, *, streaming: bool = True, ingress_token: str = ""
    ) -> AsyncGenerator[StreamChunk, None]:
        """A call from the ingress, which checked its key, limits and tenant: any other Ray
        client (without the token the application was built with) is refused."""
        if not hmac.compare_digest(ingress_token.encode(), self._token.encode()):
            raise PermissionError("a specagent replica takes calls from its ingress only")
        async for chunk in self.runtime.run(call, streaming=streaming):
            yield chunk

    def activity(self) -> dict[str, Any]:
        return self.runtime.activity()

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.close(drain=False)


REPLICA_LOST: tuple[type[BaseException], ...] = (
    ray_exceptions.RayActorError,
    ray_exceptions.ActorUnavailableError,
    ray_exceptions.WorkerCrashedError,
    ray_exceptions.NodeDiedError,
)
"""What Ray raises where a replica died or could not be reached: the only failures another
replica may answer instead (a call is retried there only before its first token)."""


def _cause(exc: BaseException) -> BaseException:
    """The exception a replica raised, out of Ray's wrappers (``RayTaskError`` and its
    subclasses made per cause keep the original as ``cause``)."""
    seen = 0
    while seen < 8:
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            return exc
        exc, seen = cause, seen + 1
    return exc


class RemoteBackend(Backend):
    """A ``Backend`` whose calls run on ``SpecReplica`` groups through Ray Serve handles.

    The ingress resolves each call's policy (so that the key check, the group and the replica
    agree) and sends it to the group that policy is pinned to. A replica that dies before the
    first token surfaces as ``GenerationError`` (the call layer retries it on another replica);
    after the first token, as an error event in the stream. The replicas belong to Ray Serve:
    closing this closes nothing."""

    def __init__(
        self,
        model_name: str,
        policies: PolicySet,
        handles: Mapping[str, Any],
        groups: Mapping[str, Sequence[str]] | None = None,
        ingress_token: str = "",
    ) -> None:
        self.model_name = model_name
        self.policies = policies
        self._token = ingress_token
        self._handles = dict(handles)
        self._group_of = {p: g for g, names in (groups or {}).items() for p in names}

    def group_of(self, policy: str) -> str:
        return self._group_of.get(policy, DEFAULT_GROUP)

    async def run(self, call: Call, *, streaming: bool = True) -> AsyncGenerator[StreamChunk, None]:
        # PolicyNotFoundError for an unknown name, as the runtime would raise it
        policy = self.policies.resolve(call.policy, call.tags, call.default_policy).name
        handle = self._handles[self.group_of(policy)]
        pinned = dataclasses.replace(call, policy=policy)
        response = handle.options(stream=True).stream.remote(
            pinned, streaming=streaming, ingress_token=self._token
        )
        finished = False
        try:
            async for chunk in response:
                finished = chunk.result is not None
                yield chunk
        except Exception as exc:
            cause = _cause(exc)
            if isinstance(cause, SpecAgentError):
                # The replica's own error, without Ray's wrapping (its traceback, paths, pid,
                # address and actor id are the operator's business, never the client's).
                raise cause from None
            if isinstance(exc, REPLICA_LOST) or isinstance(cause, REPLICA_LOST):
                log.error("replica failed: %r", exc)  # died or unreachable: worth another one
                raise GenerationError("the replica serving this call failed") from None
            # The replica ran the call and it failed there, on its input (a ValueError: 422)
            # or on a fault of its own (500): another replica would fail the same way, so the
            # call is not retried; the error's text stays in the log (as_api_error).
            raise cause from None
        finally:
            if not finished:
                response.cancel()

    async def report_activity(self) -> dict[str, Any]:
        """What ``/ready`` reports: one replica of every group asked (running and queued
        summed, measured only when all are); a group that does not answer is not ready."""
        total: dict[str, Any] = {"running": 0, "queued": 0, "measured": True, "closing": False}
        for group, handle in self._handles.items():
            try:
                one = await handle.activity.remote()
            except Exception as exc:  # unreachable or dead: not ready, and say which group
                log.warning("replica group %s did not report its activity: %r", group, exc)
                return {**total, "measured": False, "unreachable": group}
            total["running"] += int(one.get("running", 0))
            total["queued"] += int(one.get("queued", 0))
            total["measured"] = total["measured"] and bool(one.get("measured", False))
            total["closing"] = total["closing"] or bool(one.get("closing", False))
        return total


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})  # light: no model
@serve.ingress()
class Ingress:
    """The OpenAI-compatible app (``create_app``) over a ``RemoteBackend``."""

    def __init__(
        self,
        model_name: str,
        policies: PolicySet,
        groups: dict[str, list[str]],
        key_file: str | None,
        no_auth: bool,
        options: ServerOptions,
        ingress_token: str,
        audit: Mapping[str, Any] | None = None,
        **handles: Any,
    ) -> None:
        self.backend = RemoteBackend(model_name, policies, handles, groups, ingress_token)
        self.keys = KeyStore.load(key_file, open=no_auth)
        if audit and audit.get("url"):
            # The ingress records every call (its replicas record none): one store per ingress.
            from ..audit import AuditStore, row_bound

            store = AuditStore(
                str(audit["url"]),
                retention_days=audit.get("retention_days"),
                max_rows=row_bound(audit.get("max_rows")),
            )
            options = dataclasses.replace(
                options, audit=store, audit_required=bool(audit.get("required"))
            )
        self.options = options

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.backend, self.keys, self.options)


def build_app(
    target: str,
    *,
    draft: str | None = None,
    policies: PolicySet | str | None = None,
    replicas: int = 2,
    groups: Mapping[str, Sequence[str]] | None = None,
    group_replicas: int = 1,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    autoscaling: Mapping[str, Any] | None = None,
    max_ongoing_requests: int = 64,
    key_file: str | None = None,
    no_auth: bool = False,
    model_name: str | None = None,
    options: ServerOptions | None = None,
    runtime_options: Mapping[str, Any] | None = None,
    audit: str | None = None,
    audit_required: bool = False,
    audit_retention_days: float | None = None,
    audit_max_rows: int | None = None,
) -> Any:
    """The Ray Serve application: an ingress and one replica group per policy group.

    ``groups`` pins policies to their own replica groups (``{"sensitive": ["legal-drafting",
    "medical-summary"]}``: those calls never share a replica, a cache or a history with the
    others). ``autoscaling`` is Ray Serve's ``autoscaling_config`` for every group (then
    ``replicas`` is ignored). Each replica holds ``cpus_per_replica`` CPUs (torch uses as many
    threads) and ``gpus_per_replica`` GPUs. ``audit`` (a database URL) is where the ingress
    records every call (``specagent.audit``)."""
    policy_set = _policy_set(policies)
    groups = {name: list(members) for name, members in (groups or {}).items()}
    unknown = sorted({p for members in groups.values() for p in members} - set(policy_set.names()))
    if unknown:
        raise SpecAgentError(f"policy groups name unknown policies: {unknown}")
    if DEFAULT_GROUP in groups:
        raise SpecAgentError(f"{DEFAULT_GROUP!r} is the group of every unpinned policy")
    name = model_name or Path(target).name
    threads = max(1, int(cpus_per_replica)) if not gpus_per_replica else None
    router = RequestRouterConfig(
        request_router_class="specagent.server.ray_app:PrefixAffinityRouter"  # type: ignore[arg-type]
    )
    # A secret of this application only: replicas take calls from the ingress alone, so that
    # no other Ray client can skip the keys, limits and tenants the ingress enforces.
    token = secrets.token_hex(32)
    handles = {}
    for group, count in [(DEFAULT_GROUP, replicas), *((g, group_replicas) for g in groups)]:
        deployment = cast(Any, SpecReplica).options(
            name=f"spec-{group}",
            num_replicas="auto" if autoscaling else count,
            autoscaling_config=dict(autoscaling) if autoscaling else None,
            max_ongoing_requests=max_ongoing_requests,
            ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
            request_router_config=router,
        )
        handles[group] = deployment.bind(
            target,
            draft,
            policy_set,
            threads,
            {"model_name": name, **(runtime_options or {})},
            token,
        )
    audited = {
        "url": audit,
        "required": audit_required,
        "retention_days": audit_retention_days,
        "max_rows": audit_max_rows,
    }
    return cast(Any, Ingress).bind(
        name,
        policy_set,
        groups,
        key_file,
        no_auth,
        options or ServerOptions(),
        token,
        audited,
        **handles,
    )


def app_builder(args: dict[str, Any]) -> Any:
    """For ``serve run specagent.server.ray_app:app_builder target=... replicas=2`` and Serve
    config files: ``args`` are ``build_app``'s keywords (``groups`` as
    ``{"group": ["policy", ...]}``, numbers as numbers or strings)."""
    args = dict(args)
    target = args.pop("target")
    for key in ("replicas", "group_replicas", "max_ongoing_requests"):
        if key in args:
            args[key] = int(args[key])
    for key in ("cpus_per_replica", "gpus_per_replica"):
        if key in args:
            args[key] = float(args[key])
    if args.get("audit_max_rows") is not None:
        args["audit_max_rows"] = int(args["audit_max_rows"])
    if isinstance(args.get("groups"), str):
        args["groups"] = json.loads(args["groups"])
    if isinstance(args.get("no_auth"), str):
        args["no_auth"] = args["no_auth"].lower() in {"1", "true", "yes"}
    return build_app(target, **args)


def write_config(
    path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ssl: tuple[str, str] | None = None,
    **args: Any,
) -> Path:
    """A Ray Serve config file (``serve deploy path``) for ``app_builder`` with ``args``,
    listening on ``host`` (the loopback unless told otherwise: ``0.0.0.0`` exposes the
    server on every interface); ``ssl``: a certificate and its key, for HTTPS."""
    http: dict[str, Any] = {"host": host, "port": port}
    if ssl:
        http.update(ssl_certfile=ssl[0], ssl_keyfile=ssl[1])
    config = {
        "proxy_location": "EveryNode",
        "http_options": http,
        "applications": [
            {
                "name": "specagent",
                "route_prefix": "/",
                "import_path": "specagent.server.ray_app:app_builder",
                "args": args,
            }
        ],
    }
    out = Path(path)
    # Owner-only: it may hold a database URL with a password and the key file's path.
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        os.fchmod(file.fileno(), 0o600)  # an existing file keeps its mode otherwise
        file.write(yaml.safe_dump(config, sort_keys=False))
    return out


def _policy_set(policies: PolicySet | str | None) -> PolicySet:
    shipped = shipped_policies()
    if policies is None:
        return shipped
    if isinstance(policies, PolicySet):
        return policies
    return load_policies(policies, extends=shipped)
