"""One thread for every llama.cpp computation of the process.

llama-cpp-python builds ggml's CPU backend with OpenMP, and an OpenMP thread team belongs to the
thread that starts a parallel region: every thread that calls ``llama_decode`` keeps a team of
its own. Once libgomp manages more threads than there are CPUs it stops spinning between
regions (its "throttled" wait), and every token step then pays for waking its threads: on a
2-core Zen 4, with the runtime's worker decoding and one other thread having decoded once, a
1.5B model's single-token step went from 34 to 48 ms and stayed there (and setting
``OMP_WAIT_POLICY=passive`` alone gives the same 48-50 ms). Two runtimes on one model, a
runtime beside llama-cpp-python's ``Llama`` or a benchmark timing both would each leave a team.

So every forward runs on one process-wide thread (``run``): one team, whichever runtime,
worker or caller asks. Each round of a llama.cpp runtime's worker runs here too
(``LlamaCppModel.compute``): torch's wheel ships the libgomp that ggml then shares, so the torch
operations on the logits would keep a team on the worker otherwise. A worker runs its rounds
back to back in one job while no other job waits (``wanted``): a hand-off per round (waking the
worker's thread, then this one, while ggml's threads spin) cost about 1.5% of a 1.5B model's
step on 2 cores. Forwards of different models no longer overlap, which on a CPU they only did
by splitting the same cores."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["run", "waiting", "wanted"]

T = TypeVar("T")

_LOCK = threading.Lock()
_JOBS: queue.SimpleQueue[tuple[Callable[..., Any], tuple[object, ...], Future[Any]]] | None = None
_OWNER_PID = 0
_THREAD = threading.local()


def _serve(
    jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[object, ...], Future[Any]]],
) -> None:
    _THREAD.is_compute = True
    while True:
        fn, args, done = jobs.get()
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller, who raises it
            done.set_exception(exc)
        # Hold nothing of a finished job while waiting for the next: its arguments (a call's
        # sequence) are freed when their owner drops them.
        del fn, args, done


def _jobs() -> queue.SimpleQueue[tuple[Callable[..., Any], tuple[object, ...], Future[Any]]]:
    global _JOBS, _OWNER_PID
    with _LOCK:
        if _JOBS is None or os.getpid() != _OWNER_PID:  # a forked child starts its own
            _JOBS = queue.SimpleQueue()
            _OWNER_PID = os.getpid()
            # A daemon: it never holds the interpreter's exit, and takes work until then.
            threading.Thread(target=_serve, args=(_JOBS,), name="llama.cpp", daemon=True).start()
        return _JOBS


def run(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the llama.cpp thread (directly where already on it), its result or its
    exception returned to the caller."""
    if getattr(_THREAD, "is_compute", False):
        return fn(*args)
    done: Future[T] = Future()
    _jobs().put((fn, args, done))
    return done.result()


def waiting() -> int:
    """How many jobs wait for the llama.cpp thread (not counting the one it runs)."""
    jobs = _JOBS
    return 0 if jobs is None else jobs.qsize()


def wanted() -> bool:
    """Whether a job waits for the llama.cpp thread (a job running there hands it back
    between two rounds then)."""
    return waiting() > 0
