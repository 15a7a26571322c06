"""Continuous batching: concurrent calls share batched verification forwards, and nothing about a
call's output depends on who else was running; plus a soak of a few hundred mixed calls."""

from __future__ import annotations

import gc
import random
import weakref

import anyio
import pytest
import torch

from policies import make_policy
from specagent import (
    GenerationError,
    InvalidRequestError,
    PolicyNotFoundError,
    RuntimeOptions,
    SpecRuntime,
)

pytestmark = pytest.mark.anyio


def _fixed(kind: str, k: int) -> dict:
    return {"kind": kind, "num_speculative_tokens": k, "adaptive": False}


MIXED = [
    make_policy("exact", _fixed("draft_model", 4)),
    make_policy("lookup", _fixed("prompt_lookup", 6)),
    make_policy(
        "relaxed",
        _fixed("draft_model", 3),
        mode="relaxed",
        acceptance={"rule": "typical", "epsilon": 0.2},
    ),
    make_policy(
        "lenient",
        _fixed("draft_model", 2),
        mode="relaxed",
        acceptance={"rule": "lenience", "lenience": 0.4},
    ),
    make_policy("plain"),
]


@pytest.fixture
def runtime(target, draft, tokenizer):
    rt = SpecRuntime(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        policies=MIXED,
        device="cpu",
        options=RuntimeOptions(prefix_cache_tokens=0),
    )
    yield rt
    rt.close()


def _spy_batches(rt: SpecRuntime) -> list[int]:
    """Record the size of every batched verification (the real forward still runs). Spies and
    planted faults here wrap the runtime's own runners and decode (``rt._decoder``): no public
    hook counts a round's forwards, keeps its caches or makes one fail."""
    sizes: list[int] = []
    real = rt._decoder.target_runner.forward_batch

    def forward_batch(requests, keep=None):
        sizes.append(len(requests))
        return real(requests, keep)

    rt._decoder.target_runner.forward_batch = forward_batch  # type: ignore[method-assign]
    return sizes


def _random_calls(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        prompt = [rng.randrange(7, 320) for _ in range(rng.randrange(1, 40))]
        calls.append(
            {
                "prompt": prompt,
                "policy": MIXED[i % len(MIXED)].name,
                "max_new_tokens": rng.randrange(4, 24),
                "seed": i,
                # greedy and sampled calls in the same batches
                "temperature": 0.0 if i % 3 else 0.9,
            }
        )
    return calls


async def _all_at_once(rt: SpecRuntime, calls: list[dict]) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in calls]

    async def one(i: int) -> None:
        call = dict(calls[i])
        results[i] = (await rt.generate(call.pop("prompt"), **call)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return results


async def test_batched_results_equal_each_call_run_alone(runtime) -> None:
    """Random prompts of ragged lengths, five policies (rules, k, drafters, no drafting) and
    greedy and seeded sampled calls mixed in one batch: every result equals the call alone."""
    calls = _random_calls(20, seed=3)
    alone = []
    for call in calls:
        call = dict(call)
        alone.append((await runtime.generate(call.pop("prompt"), **call)).token_ids)
    sizes = _spy_batches(runtime)
    together = await _all_at_once(runtime, calls)
    assert max(sizes) >= 10  # the calls really shared forwards
    assert together == alone


async def test_calls_join_and_leave_between_steps(runtime) -> None:
    """A long call keeps running while short ones join its batch and finish first: some of its
    steps are verified together with them, the others alone."""
    sizes = _spy_batches(runtime)
    finished: list[str] = []
    results = {}

    async def call(name: str, tokens: int, delay: float) -> None:
        await anyio.sleep(delay)
        results[name] = await runtime.generate("abc " * 3, policy="exact", max_new_tokens=tokens)
        finished.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "long", 200, 0.0)
        for i in range(4):
            tg.start_soon(call, f"short-{i}", 5, 0.02 * (i + 1))
    assert finished[-1] == "long"
    long = results["long"]
    long_steps = long.usage.output_tokens / long.stats.mean_acceptance_length
    assert sizes  # the short calls shared steps with the long one
    assert len(sizes) < long_steps  # and it went on alone after they left


def _spy_caches(rt: SpecRuntime) -> tuple[list[int], list[weakref.ref]]:
    """Count every forward (single or batched, target and draft) and keep a weak reference to
    every KV cache a forward used: a cache still alive after a call ended is a leak."""
    forwards: list[int] = [0]
    caches: list[weakref.ref] = []
    seen: set[int] = set()

    def note(cache) -> None:
        forwards[0] += 1
        if id(cache) not in seen:
            seen.add(id(cache))
            caches.append(weakref.ref(cache))

    runners = [rt._decoder.target_runner, rt._decoder.draft_runner]
    for runner in runners:
        real_forward, real_batch = runner.forward, runner.forward_batch

        def forward(input_ids, cache, keep=None, tree=None, vocab=None, _real=real_forward):
            note(cache)
            return _real(input_ids, cache, keep, tree, vocab)

        def forward_batch(requests, keep=None, _real=real_batch):
            for _, cache in requests:
                note(cache)
            return _real(requests, keep)

        runner.forward, runner.forward_batch = forward, forward_batch  # type: ignore[method-assign]
    return forwards, caches


async def _until_idle(worker) -> None:
    for _ in range(500):  # the worker drops cancelled calls before their next step
        if not worker.active and not worker.inbox:
            return
        await anyio.sleep(0.01)


async def test_cancelled_calls_are_cut_short_and_free_their_slot_and_caches(runtime) -> None:
    """Six 400-token calls cancelled once each has streamed its first chunk: none finishes,
    each stops within a step of the cancellation (no more forwards than one step of every call
    after it, none once it settles), leaves no slot or queue entry, and every KV cache it used
    is freed (no reference survives). Nothing here depends on how fast the machine is."""
    worker = runtime._ensure_worker()
    # The step-cost measurement runs forwards of its own between rounds: let it finish first.
    await anyio.to_thread.run_sync(worker.idle.wait, 120)
    forwards, caches = _spy_caches(runtime)
    started = [anyio.Event() for _ in range(6)]
    finished: list[bool] = [False] * 6

    async def one(i: int) -> None:
        async for chunk in runtime.stream("x y z", policy="exact", max_new_tokens=400):
            started[i].set()
            finished[i] = chunk.result is not None

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(one, i)
        for event in started:
            await event.wait()
        tg.cancel_scope.cancel()
    at_cancel = forwards[0]
    assert not any(finished)  # cut short, not finished
    await _until_idle(worker)
    assert worker.active == []
    assert not worker.inbox
    settled = forwards[0]
    await anyio.sleep(0.2)
    assert forwards[0] == settled  # no step ran after the calls were dropped
    # At most the round in flight finished: one step of each call (4 draft forwards and a
    # verification, each counted per call).
    assert settled - at_cancel <= 6 * (4 + 1)
    gc.collect()
    assert caches
    assert [ref for ref in caches if ref() is not None] == []
    result = await runtime.generate("still serving", policy="exact", max_new_tokens=5)
    assert result.usage.output_tokens > 0


async def test_an_error_in_a_batched_forward_is_retried_call_by_call(runtime) -> None:
    """A batched verification that raises (one call's input breaks it, say) is retried one call
    at a time: the culprit fails with a clear error, the others finish with the same tokens as
    alone."""
    calls = [
        {"prompt": f"call {i} " * 3, "policy": "exact", "max_new_tokens": 12, "seed": i}
        for i in range(4)
    ]
    alone = []
    for call in calls:
        call = dict(call)
        alone.append((await runtime.generate(call.pop("prompt"), **call)).token_ids)
    runner = runtime._decoder.target_runner
    real_forward, real_batch = runner.forward, runner.forward_batch
    poisoned: list = []
    batches: list[int] = []

    def forward_batch(requests, keep=None):
        batches.append(len(requests))
        if len(batches) == 2:  # the second batched round breaks on its first call's cache
            poisoned.append(requests[0][1])
            raise RuntimeError("batched forward failed (simulated)")
        return real_batch(requests, keep)

    def forward(input_ids, cache, keep=None, tree=None, vocab=None):
        if any(cache is p for p in poisoned):
            raise RuntimeError("this call's forward fails (simulated)")
        return real_forward(input_ids, cache, keep, tree, vocab)

    runner.forward, runner.forward_batch = forward, forward_batch  # type: ignore[method-assign]
    outcomes: list[object] = [None] * len(calls)

    async def one(i: int) -> None:
        call = dict(calls[i])
        try:
            outcomes[i] = (await runtime.generate(call.pop("prompt"), **call)).token_ids
        except GenerationError as exc:
            outcomes[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    assert max(batches) >= 2
    failed = [i for i, o in enumerate(outcomes) if isinstance(o, GenerationError)]
    assert len(failed) == 1
    assert "this call's forward fails" in str(outcomes[failed[0]].__cause__ or outcomes[failed[0]])
    for i, outcome in enumerate(outcomes):
        if i not in failed:
            assert outcome == alone[i]
    assert runtime._ensure_worker().active == []


@pytest.mark.slow
async def test_soak_mixed_calls_cancellations_and_bad_inputs(runtime, tokenizer) -> None:
    """300 calls in waves: valid ones (compared with their reference run alone), calls cancelled
    at random moments, and bad inputs. Every success is correct, every bad input gets its error,
    the worker ends idle, and live tensors do not grow from wave to wave."""
    rng = random.Random(7)
    references: dict[int, list[int]] = {}
    valid = _random_calls(12, seed=11)
    for i, call in enumerate(valid):
        call = dict(call)
        references[i] = (await runtime.generate(call.pop("prompt"), **call)).token_ids
    outcomes = {"ok": 0, "cancelled": 0, "refused": 0}

    async def one() -> None:
        kind = rng.random()
        if kind < 0.15:  # bad input: unknown policy, empty prompt, or a bad temperature
            bad = rng.choice(
                [
                    ({"prompt": "hi", "policy": "nope"}, PolicyNotFoundError),
                    ({"prompt": [], "policy": "exact"}, InvalidRequestError),
                    ({"prompt": "hi", "policy": "exact", "temperature": -1}, InvalidRequestError),
                ]
            )
            call, error = bad
            call = dict(call)
            with pytest.raises(error):
                await runtime.generate(call.pop("prompt"), **call)
            outcomes["refused"] += 1
            return
        index = rng.randrange(len(valid))
        call = dict(valid[index])
        if kind < 0.35:  # cancelled part-way
            with anyio.move_on_after(rng.uniform(0.0, 0.05)) as scope:
                await runtime.generate(call.pop("prompt"), **call)
            outcomes["cancelled" if scope.cancelled_caught else "ok"] += 1
            return
        result = await runtime.generate(call.pop("prompt"), **call)
        assert result.token_ids == references[index]
        outcomes["ok"] += 1

    def live_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))

    worker = runtime._ensure_worker()
    counts = []
    for _ in range(6):
        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(one)
        for _ in range(200):
            if not worker.active:
                break
            await anyio.sleep(0.01)
        assert worker.active == []
        counts.append(live_tensors())
    assert sum(outcomes.values()) == 300
    assert min(outcomes.values()) > 10
    assert counts[-1] <= counts[1] + 20, counts  # flat after the first wave's warm-up


class _Escaped(BaseException):
    """Not an Exception: what a buggy drafter or grammar callback might still raise."""


@pytest.mark.anyio
async def test_one_call_raising_anything_fails_that_call_only(runtime) -> None:
    """A step of one call that raises even a BaseException fails that call with a clear error;
    the worker survives, the calls batched with it finish with their own tokens, and later
    calls run. (The faulty step is planted by wrapping the engine's decode: no public hook
    injects one.)"""
    calls = _random_calls(4, seed=11)
    alone = [await _all_at_once(runtime, [call]) for call in calls]
    real = runtime._decoder.decode

    def decode(request, device):
        steps = real(request, device)
        if request.seed != 666:
            return steps

        def failing():
            yield next(steps)
            raise _Escaped("a planted failure")

        return failing()

    runtime._decoder.decode = decode
    faulty = {"prompt": [9, 10, 11], "policy": MIXED[0].name, "max_new_tokens": 20, "seed": 666}
    failures: list[BaseException] = []

    async def bad() -> None:
        try:
            await runtime.generate(faulty.pop("prompt"), **faulty)
        except GenerationError as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(bad)
        together = await _all_at_once(runtime, calls)
    assert len(failures) == 1
    assert "_Escaped" in str(failures[0])
    assert together == [a[0] for a in alone]
    assert (await _all_at_once(runtime, calls[:1]))[0] == alone[0][0]
