"""Admission is fair across principals and bounded by each call's deadline: one principal's pile
of expensive prompts holds one admission thread, never the others' calls; a caller leaves at
its deadline or when cancelled, and its admission then never runs; a prompt whose text alone
cannot fit the context window is refused before its template renders. (Planted admissions
that block until released: nothing here depends on how fast the machine is.)"""

from __future__ import annotations

import threading

import anyio
import pytest

from specagent import CallTimeoutError, ContextLengthError, SpecRuntime
from specagent.runtime._gate import AdmissionGate

pytestmark = pytest.mark.anyio


class Blocking:
    """Admissions that wait until released, recording who ran."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ran: list[str] = []
        self.started = threading.Semaphore(0)

    def work(self, name: str):  # type: ignore[no-untyped-def]
        def run(tokenizer: object) -> str:
            self.ran.append(name)
            self.started.release()
            self.release.wait(30)
            return name

        return run


def quick(name: str):  # type: ignore[no-untyped-def]
    return lambda tokenizer: name


async def test_one_principals_flood_holds_one_thread_and_others_get_through() -> None:
    gate = AdmissionGate(tokenizer=None, workers=2)
    flood = Blocking()
    results: list[str] = []
    async with anyio.create_task_group() as tg:
        for i in range(6):

            async def hostile(i: int = i) -> None:
                results.append(await gate.admit("hostile", flood.work(f"h{i}"), None))

            tg.start_soon(hostile)
        await anyio.to_thread.run_sync(flood.started.acquire)
        # One of the six runs; the others wait in their principal's queue, not on a thread.
        assert await gate.admit("victim", quick("v"), 5) == "v"
        assert len(flood.ran) == 1
        flood.release.set()
    assert sorted(results) == [f"h{i}" for i in range(6)]


async def test_principals_take_turns() -> None:
    gate = AdmissionGate(tokenizer=None, workers=1)
    blocker = Blocking()
    order: list[str] = []
    async with anyio.create_task_group() as tg:

        async def first() -> None:
            await gate.admit("x", blocker.work("x0"), None)

        tg.start_soon(first)
        await anyio.to_thread.run_sync(blocker.started.acquire)
        for name in ("a1", "a2", "a3", "b1", "c1"):

            async def queued(name: str = name) -> None:
                await gate.admit(name[0], lambda tokenizer, name=name: order.append(name), None)

            tg.start_soon(queued)
            await anyio.sleep(0.01)  # queued in this order
        blocker.release.set()
    assert order == ["a1", "b1", "c1", "a2", "a3"]  # a's flood waits behind b and c


async def test_a_caller_leaves_at_its_deadline_and_its_admission_never_runs() -> None:
    gate = AdmissionGate(tokenizer=None, workers=2)
    busy = Blocking()
    async with anyio.create_task_group() as tg:
        for principal in ("p", "q"):  # both threads busy
            tg.start_soon(gate.admit, principal, busy.work(principal), None)
        await anyio.to_thread.run_sync(busy.started.acquire)
        await anyio.to_thread.run_sync(busy.started.acquire)
        with pytest.raises(CallTimeoutError, match=r"deadline of 0\.2 s"):
            await gate.admit("late", busy.work("late"), 0.2)
        with anyio.move_on_after(0.2):  # cancelled (its client went away)
            await gate.admit("gone", busy.work("gone"), None)
        busy.release.set()
    assert sorted(busy.ran) == ["p", "q"]  # neither "late" nor "gone" ran


async def test_an_error_in_an_admission_reaches_its_caller_and_frees_the_turn() -> None:
    gate = AdmissionGate(tokenizer=None, workers=1)

    def broken(tokenizer: object) -> str:
        raise ValueError("bad prompt")

    with pytest.raises(ValueError, match="bad prompt"):
        await gate.admit("a", broken, None)
    assert await gate.admit("a", quick("next"), None) == "next"


async def test_admission_threads_get_tokenizers_of_their_own(tokenizer) -> None:
    gate = AdmissionGate(tokenizer=tokenizer, workers=2)
    seen: list[object] = []
    hold = threading.Event()
    arrived = threading.Semaphore(0)

    def record(tok: object) -> None:
        seen.append(tok)
        arrived.release()
        hold.wait(30)

    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.admit, "a", record, None)
        tg.start_soon(gate.admit, "b", record, None)
        await anyio.to_thread.run_sync(arrived.acquire)
        await anyio.to_thread.run_sync(arrived.acquire)
        hold.set()
    assert len({id(t) for t in seen}) == 2
    assert tokenizer in seen
    other = next(t for t in seen if t is not tokenizer)
    assert other.encode("Hello world") == tokenizer.encode("Hello world")


async def test_a_prompt_too_long_for_the_window_is_refused_before_its_template(
    target, tokenizer, monkeypatch
) -> None:
    rt = SpecRuntime(target, tokenizer=tokenizer, device="cpu")
    try:
        window = rt.context_window
        assert window is not None
        rendered: list[int] = []
        real = type(tokenizer).apply_chat_template

        def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            rendered.append(1)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(type(tokenizer), "apply_chat_template", spy)
        huge = [{"role": "user", "content": "hello world " * 2_000_000}]  # ~24 MB
        with pytest.raises(ContextLengthError, match="text alone holds more than"):
            await rt.generate(huge, max_new_tokens=1)
        assert rendered == []
        fits = await rt.generate([{"role": "user", "content": "hello world"}], max_new_tokens=1)
        assert fits.usage.output_tokens == 1
        assert rendered == [1]
    finally:
        rt.close()
