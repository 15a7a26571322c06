"""The thread that schedules the models: continuous batching of every active call.

Calls are advanced one decoding step at a time, round-robin, so a long call does not hold short
ones back: each round, the pending forwards of all active calls (draft steps and verifications)
run as one batched forward per model (``ModelRunner.forward_batch``); each call then takes its
logits and runs on to its next forward (``decoding.engine.advance``), emitting events into its
sink on the way. A cancelled call is dropped (with its KV caches) before the next round.

Between rounds the worker runs one timing of the background cost measurement (if any is left),
so measuring never blocks the calls for longer than one forward, and no call's forward runs
while a timing does (it would skew both).

Rounds run where the target's engine computes (``EngineModel.compute``): on this thread, or,
for llama.cpp, on the one thread that runs every llama.cpp forward of the process (one OpenMP
team: ``engines.llama_cpp.compute_thread``); this thread then only schedules. They run back to
back there until a call arrives, the runtime stops or another job waits for that place.

A reproducible call (``Policy.reproducible``) waits until that measurement is done (its draft
lengths come from the measured costs, which must not change under it) and its forwards run
alone, never padded into a batch with other calls.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..decoding.engine import ForwardRequest, advance
from ..decoding.loop import DecodeSteps
from ..errors import GenerationError, RuntimeClosedError, RuntimeOverloadedError, SpecAgentError
from .portal import current_async_library

if TYPE_CHECKING:
    from ._admission import CallPlan

__all__ = ["AsyncSink", "Job", "Worker"]

log = logging.getLogger("specagent.runtime")

_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()
"""Workers whose thread may still run, stopped at interpreter exit (``_stop_at_exit``)."""

EXIT_JOIN_S = 30.0
"""How long the exit hook waits for a worker to finish the forward it is in."""


@atexit.register
def _stop_at_exit() -> None:
    """Stop every live worker before the interpreter finalizes. A daemon thread still inside a
    forward (a call, or the cost measurement running in the background) is otherwise unwound
    mid-frame at finalization, which a C++ terminate handler (Ray's, when Ray is imported)
    turns into an abort of a process whose work was done."""
    workers = list(_LIVE)
    for worker in workers:
        worker.stop(drain=False)
    for worker in workers:
        worker.thread.join(EXIT_JOIN_S)


class AsyncSink:
    """Where the worker puts a call's events for a caller on an anyio event loop (asyncio or
    trio): ``put`` never blocks the worker and wakes the caller's loop thread-safely.

    ``eager`` (a stream): every event wakes the caller. Otherwise only the call's last event
    (``done`` or ``error``) does, the rest wait in the queue: a caller who waits for the whole
    result then costs the stepping thread nothing per step, neither the wake-up (a system
    call on the thread that runs the forwards) nor the caller's loop running beside the next
    forward on a machine whose cores the forward uses (measured: 2-4% of a llama.cpp step on
    2 cores). ``first_token_at`` is when the first token was put, however late it is read."""

    def __init__(self, eager: bool = True) -> None:
        self._items: collections.deque[tuple[str, Any]] = collections.deque()
        self._event = anyio.Event()
        self._wake = loop_waker()
        self.eager = eager
        self.first_token_at: float | None = None

    def put(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if self.first_token_at is None and kind != "error" and payload.token_ids:
            self.first_token_at = time.perf_counter()
        self._items.append(item)
        if self.eager or kind != "tokens":
            self._wake(self._set)

    def _set(self) -> None:
        self._event.set()

    async def get(self) -> tuple[str, Any]:
        while not self._items:
            await self._event.wait()
            self._event = anyio.Event()
        return self._items.popleft()


def loop_waker() -> Callable[[Callable[[], None]], None]:
    """A function that schedules a callback on the current event loop from any thread."""
    if current_async_library() == "trio":
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
class Job:
    plan: CallPlan
    """The call as admission decided it."""
    sink: AsyncSink
    cancelled: threading.Event = field(default_factory=threading.Event)
    alone: bool = False
    """Its forwards run alone, never batched, nor beside background measurements (a
    reproducible call's: other calls' rows would change its rounding)."""
    steps: DecodeSteps | None = None
    pending: ForwardRequest | None = None
    """The forward (draft or target) this call waits for, batched with the other calls'."""
    reserved: int = 0
    """KV positions this call holds of the runtime's budget while it runs (``Worker``)."""


class Worker:
    """Runs the calls submitted to it until stopped (see the module docstring).

    ``decode`` makes a call's decoding coroutine (on the worker thread); ``background`` is a
    generator of work to do a slice at a time between rounds (the cost measurement)."""

    def __init__(
        self,
        decode: Callable[[Any], DecodeSteps],
        *,
        max_active: int,
        max_queue: int,
        batching: bool,
        background: Generator[None, None, None] | None = None,
        kv_budget: int | None = None,
        need: Callable[[Any], int] | None = None,
        compute: Callable[[Callable[[], None]], None] | None = None,
        compute_wanted: Callable[[], bool] | None = None,
    ) -> None:
        self.decode = decode
        self.max_active = max_active
        self.kv_budget = kv_budget
        """KV positions the running calls may hold together (an engine whose calls share one
        pool of cells: llama.cpp); None: no bound here."""
        self.need = need or (lambda plan: 0)
        """The KV positions a call may come to hold (its prompt, its budget of new tokens and
        its longest draft)."""
        self.reserved = 0
        self.compute = compute or (lambda work: work())
        """Where rounds of steps run (the engine's ``compute``: inline, or the thread that
        runs every llama.cpp forward of the process), back to back while nothing else is to
        be done between them (``_rounds``)."""
        self.compute_wanted = compute_wanted or (lambda: False)
        """Whether other work waits where the rounds run: the worker hands the place back
        after the round it is in."""
        self.max_queue = max_queue
        self.batching = batching
        self.background = background
        self.idle = threading.Event()
        """Set while the background work is done (or there was none)."""
        if background is None:
            self.idle.set()
        self.inbox: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self.waiting: list[Job] = []
        """Reproducible calls taken from the inbox while the costs are still being measured."""
        self.cond = threading.Condition()
        self.stopping = False
        self.drain = True
        self.thread = threading.Thread(target=self._run, name="specagent-worker", daemon=True)
        self.thread.start()
        _LIVE.add(self)

    def activity(self) -> dict[str, Any]:
        """Calls ``running`` and ``queued``, whether the background work is done
        (``measured``) and whether the worker is ``closing``."""
        with self.cond:
            running, queued = len(self.active), len(self.inbox)
        return {
            "running": running,
            "queued": queued,
            "measured": self.idle.is_set(),
            "closing": self.stopping,
        }

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.stopping:
                raise RuntimeClosedError("the runtime is shutting down; the call was not started")
            # Calls cancelled while they waited hold no place in the queue.
            if any(j.cancelled.is_set() for j in self.inbox):
                self.inbox = collections.deque(j for j in self.inbox if not j.cancelled.is_set())
            # Calls in the inbox that a free decoding slot will take next are not waiting.
            free_slots = max(0, self.max_active - len(self.active) - len(self.waiting))
            if len(self.inbox) >= self.max_queue + free_slots:
                msg = (
                    f"runtime overloaded: {len(self.active)} calls running and {len(self.inbox)} "
                    f"waiting (max_queue={self.max_queue}); retry later"
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
                    while (
                        not self.inbox
                        and not self.active
                        and not self.waiting
                        and not self.stopping
                        and self.background is None
                    ):
                        self.cond.wait()
                    if self.stopping and not self.drain:
                        self._fail_all(RuntimeClosedError("the runtime was closed"))
                        break
                    if self.stopping and not self.inbox and not self.active and not self.waiting:
                        break
                    starting: list[Job] = []
                    if self.background is None:
                        starting, self.waiting = self.waiting, []
                    while (
                        self.inbox
                        and len(self.active) + len(self.waiting) + len(starting) < self.max_active
                        and self._fits(self.inbox[0], bool(starting))
                    ):
                        job = self.inbox.popleft()
                        job.reserved = self.need(job.plan)
                        self.reserved += job.reserved
                        starting.append(job)
                self.compute(functools.partial(self._rounds, starting))
        except BaseException as exc:  # a bug in the worker itself: fail everyone, say why
            self._fail_all(GenerationError(f"the runtime worker stopped: {exc!r}"))
            raise
        finally:
            if self.background is not None:
                self.background.close()  # unfinished: a later worker measures the rest
                self.background = None

    def _rounds(self, starting: list[Job]) -> None:
        """Rounds back to back while calls run and nothing waits: no call in the inbox, no
        stop, no other work where they run. One hand-off to ``compute`` per burst, not per
        step (with llama.cpp each costs waking two threads while ggml's spin)."""
        self._round(starting)
        while not self.compute_wanted():
            with self.cond:
                if not self.active or self.inbox or self.waiting or self.stopping:
                    return
            self._round([])

    def _round(self, starting: list[Job]) -> None:
        """Start the calls taken from the inbox, step every active call once, then a slice
        of the background work."""
        for job in starting:
            if self.background is not None and job.alone:
                self.waiting.append(job)
            else:
                self._start(job)
        self._step_all()
        self._background_slice()

    def _fits(self, job: Job, starting: bool) -> bool:
        """Whether the call at the head of the queue may start: the KV it may come to hold
        fits the budget beside the running calls' (so no call ever runs out of cells because
        of another), or nothing else runs (a call may always run alone). A call that does not
        fit waits at the head of the queue until running calls end."""
        if self.kv_budget is None or job.cancelled.is_set():
            return True
        if not (self.active or self.waiting or starting):
            return True
        return self.reserved + self.need(job.plan) <= self.kv_budget

    def _background_slice(self) -> None:
        if self.background is None:
            return
        try:
            next(self.background)
        except StopIteration:
            self.background = None
            self.idle.set()
        except Exception:  # measuring is an optimisation: calls go on with the prior costs
            log.exception("measuring step costs failed; planning with the prior costs")
            self.background = None
            self.idle.set()

    def _fail_all(self, exc: SpecAgentError) -> None:
        with self.cond:
            jobs = [*self.active, *self.waiting, *self.inbox]
            self.active.clear()
            self.waiting.clear()
            self.inbox.clear()
        for job in jobs:
            job.steps = None
            job.sink.put(("error", exc))

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._release(job)
            return
        try:
            job.steps = self.decode(job.plan)
        except BaseException as exc:  # one call's failure is that call's alone
            self._release(job)
            job.sink.put(("error", as_generation_error(exc)))
            return
        self.active.append(job)
        self._resume(job, None)  # prefill and first draft, up to the first verification

    def _step_all(self) -> None:
        """One round: every pending forward, one batched forward per model."""
        groups: dict[Any, list[Job]] = {}
        for job in list(self.active):
            if job.cancelled.is_set():
                self._finish(job)
            elif job.pending is not None:
                # A reproducible call's forwards form a group of their own.
                group = id(job) if job.alone else id(job.pending.runner)
                groups.setdefault(group, []).append(job)
        for jobs in groups.values():
            # A token tree's forward has a mask of its own: it runs alone.
            trees = [job for job in jobs if job.pending is not None and job.pending.tree]
            jobs = [job for job in jobs if job not in trees]
            requests = [job.pending for job in jobs if job.pending is not None]
            logits: list[torch.Tensor] | None = None
            if self.batching and len(requests) > 1:
                try:
                    vocabs = [r.vocab for r in requests]
                    extra = {"vocabs": vocabs} if any(v is not None for v in vocabs) else {}
                    logits = requests[0].runner.forward_batch(
                        [(r.tokens, r.cache) for r in requests], [r.keep for r in requests], **extra
                    )
                except Exception as exc:  # find the culprit: retry the calls one by one
                    release_device_memory(exc)
            for i, job in enumerate([*jobs, *trees]):
                request, job.pending = job.pending, None
                assert request is not None
                try:
                    reply = logits[i] if logits is not None and i < len(jobs) else request.run()
                except BaseException as exc:  # fails this call, not the worker
                    self._fail(job, exc)
                    continue
                self._resume(job, reply)

    def _resume(self, job: Job, reply: torch.Tensor | None) -> None:
        """Run the call until its next forward request (kept as ``pending``) or its end,
        delivering the events on the way."""
        assert job.steps is not None
        try:
            while True:
                item = advance(job.steps, reply, inline=False)
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
        except BaseException as exc:  # a drafter's or a grammar's, say
            self._fail(job, exc)

    def _fail(self, job: Job, exc: BaseException) -> None:
        self._finish(job)
        release_device_memory(exc)
        job.sink.put(("error", as_generation_error(exc)))

    def _release(self, job: Job) -> None:
        self.reserved -= job.reserved
        job.reserved = 0

    def _finish(self, job: Job) -> None:
        self._release(job)
        job.pending = None
        if job.steps is not None:
            job.steps.close()
            job.steps = None
        with contextlib.suppress(ValueError):
            self.active.remove(job)


def as_generation_error(exc: BaseException) -> SpecAgentError:
    if isinstance(exc, SpecAgentError):
        return exc
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        error = GenerationError(f"out of device memory while decoding this call: {exc}")
    else:
        error = GenerationError(f"decoding failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def release_device_memory(exc: BaseException) -> None:
    if isinstance(exc, torch.cuda.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()
