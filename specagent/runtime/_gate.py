"""Turns at admission, fair across principals, each within its call's deadline.

Admitting a call renders its chat template, tokenizes its prompt and compiles its grammar:
seconds for a megabyte of text. With one admission at a time for everyone, one principal's
pile of huge prompts held every other call back however short its deadline. Here:

- admissions run on a few threads of the gate's own (``workers``), each with a tokenizer of its
  own (a fast tokenizer's state is not safe to share between threads), so one principal's
  expensive prompt occupies one of them, never all;
- a principal has at most one admission running; its other calls wait in its own queue, and
  free threads take the queues in turn (round robin), so a principal's flood delays itself;
- a caller waits asynchronously and leaves at its deadline (or when cancelled: its client went
  away), whether its turn came or not; an admission that had started finishes on its thread
  and its result is dropped.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import anyio

from ..errors import CallTimeoutError
from ._worker import loop_waker

__all__ = ["AdmissionGate"]

T = TypeVar("T")


class _Turn(Generic[T]):
    """One call's place in its principal's queue, and what its admission gave."""

    def __init__(self, principal: Hashable, work: Callable[[Any], T]) -> None:
        self.principal = principal
        self.work = work
        self.left = False
        """The caller stopped waiting (deadline, cancellation): skip it, drop its result."""
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None
        self._event = anyio.Event()
        self._wake = loop_waker()

    def finish(self) -> None:
        """Called on a gate thread: wakes the caller's event loop."""
        self.done = True
        self._wake(self._event.set)

    async def wait(self) -> None:
        await self._event.wait()


_COPY = object()


class AdmissionGate:
    """Runs admissions (``admit``) fairly across principals on ``workers`` threads; the first
    uses ``tokenizer`` itself, the others copies made when first needed."""

    def __init__(self, tokenizer: Any, workers: int = 2) -> None:
        self.workers = workers
        self._first = tokenizer
        self._tokenizers: list[Any] = [tokenizer]
        """Tokenizers not in use now (a copy is made when all are)."""
        self._lock = threading.Lock()
        self._queues: collections.OrderedDict[Hashable, collections.deque[_Turn[Any]]] = (
            collections.OrderedDict()
        )
        self._busy: set[Hashable] = set()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="specagent-admission")

    async def admit(
        self, principal: Hashable, work: Callable[[Any], T], timeout: float | None
    ) -> T:
        """``work(tokenizer)``'s result, run in ``principal``'s turn; ``CallTimeoutError``
        when ``timeout`` seconds pass first (waiting for the turn included)."""
        turn: _Turn[T] = _Turn(principal, work)
        with self._lock:
            self._queues.setdefault(principal, collections.deque()).append(turn)
            self._dispatch()
        try:
            with anyio.fail_after(timeout if timeout is not None else float("inf")):
                await turn.wait()
        except TimeoutError:
            raise CallTimeoutError(
                f"the call passed its deadline of {timeout} s while its prompt was being admitted"
            ) from None
        finally:
            if not turn.done:
                with self._lock:
                    turn.left = True  # still queued: skipped; already running: dropped
        if turn.error is not None:
            raise turn.error
        return turn.result  # type: ignore[return-value]

    def _dispatch(self) -> None:
        """Start queued turns while threads are free: the principals in turn, one running
        admission each (call with the lock held)."""
        while len(self._busy) < self.workers:
            turn = self._next()
            if turn is None:
                return
            self._busy.add(turn.principal)
            tokenizer = self._tokenizer()
            self._pool.submit(self._run, turn, tokenizer)

    def _next(self) -> _Turn[Any] | None:
        for principal in list(self._queues):
            if principal in self._busy:
                continue
            queue = self._queues[principal]
            while queue and queue[0].left:
                queue.popleft()
            if not queue:
                del self._queues[principal]
                continue
            turn = queue.popleft()
            # This principal goes to the back: the others' queues come first.
            self._queues.move_to_end(principal)
            if not queue:
                del self._queues[principal]
            return turn
        return None

    def _tokenizer(self) -> Any:
        """A tokenizer not in use, or ``_COPY``: the admission's thread makes one (a copy of a
        large vocabulary takes a moment, never under the lock the event loop takes)."""
        return self._tokenizers.pop() if self._tokenizers else _COPY

    def _run(self, turn: _Turn[Any], tokenizer: Any) -> None:
        try:
            if tokenizer is _COPY:
                tokenizer = copy.deepcopy(self._first) if self._first is not None else None
            if not turn.left:
                turn.result = turn.work(tokenizer)
        except BaseException as exc:  # handed to the caller
            turn.error = exc
        finally:
            with self._lock:
                if tokenizer is not _COPY:  # a copy that failed is not kept
                    self._tokenizers.append(tokenizer)
                self._busy.discard(turn.principal)
                self._dispatch()
            turn.finish()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
