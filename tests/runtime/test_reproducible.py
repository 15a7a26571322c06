"""Reproducible policies: the same call gives the same tokens whatever else the runtime is doing
(measuring its costs, batching other calls) and in a later runtime on the same machine."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from conftest import MemoryStore, PinnedCosts
from pydantic import ValidationError

from specagent import Policy, RuntimeOptions, SpecRuntime
from specagent.engines.transformers import ModelRunner
from specagent.policy import shipped_policies

PROMPT = [{"role": "user", "content": "Draft a clause about late delivery of the goods."}]
OTHERS = [[{"role": "user", "content": f"Question {i}: where is order {i}?"}] for i in range(6)]


def sampled(reproducible: bool) -> Policy:
    # Sampled at temperature 1 with an adaptive draft length: every draft length the costs
    # choose changes how many random numbers a step draws, so different costs (or a forward
    # that rounds differently) change the tokens.
    return Policy(
        name="clause",
        description="reproducible clause drafting",
        mode="lossless",
        reproducible=reproducible,
        drafter={
            "kind": "draft_model",
            "num_speculative_tokens": 8,
            "confidence_threshold": 0.0,
        },
        sampling={"temperature": 1.0, "max_new_tokens": 48, "seed": 11},
    )


def runtime(target, draft, tokenizer, reproducible: bool, store: Any) -> SpecRuntime:
    return SpecRuntime(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        policies=[sampled(reproducible)],
        device="cpu",
        options=RuntimeOptions(probe_store=store),
    )


async def with_others(rt: SpecRuntime) -> list[int]:
    """The call, batched among six others."""
    results: dict[int, list[int]] = {}

    async def one(i: int, messages: list[dict[str, str]]) -> None:
        out = await rt.generate(messages, policy="clause", tenant="t")
        results[i] = out.token_ids

    async with anyio.create_task_group() as tg:
        for i, messages in enumerate([*OTHERS[:3], PROMPT, *OTHERS[3:]]):
            tg.start_soon(one, i, messages)
    return results[3]


def started_measured(rt: SpecRuntime) -> list[bool]:
    """Records, for every call the runtime starts decoding, whether its costs were measured
    (through the runtime's own decode, ``rt._decoder``: no public hook says when a call's
    decoding starts)."""
    seen: list[bool] = []
    decode = rt._decoder.decode

    def recorded(request, device):  # type: ignore[no-untyped-def]
        seen.append(rt.activity()["measured"])
        return decode(request, device)

    rt._decoder.decode = recorded  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("reproducible", [True, False])
def test_a_reproducible_call_starts_once_the_costs_are_known(
    target, draft, tokenizer, reproducible
) -> None:
    rt = runtime(target, draft, tokenizer, reproducible, MemoryStore())
    seen = started_measured(rt)
    try:
        assert not rt.activity()["measured"]  # the call arrives before the costs are measured
        rt.generate_sync(PROMPT, policy="clause")
    finally:
        rt.close()
    # Not reproducible (the control): it starts at once and plans its first step with the prior.
    assert seen == [reproducible]


def test_same_tokens_while_measuring_among_other_calls_and_in_a_later_runtime(
    target, draft, tokenizer
) -> None:
    store = PinnedCosts()
    first = runtime(target, draft, tokenizer, True, store)
    try:
        during = first.generate_sync(PROMPT, policy="clause")
        after = first.generate_sync(PROMPT, policy="clause").token_ids
        batched = anyio.run(with_others, first)
    finally:
        first.close()
    later = runtime(target, draft, tokenizer, True, store)
    try:
        again = anyio.run(with_others, later)
    finally:
        later.close()
    assert len(during.token_ids) > 20
    assert during.stats.num_draft_tokens > during.stats.num_drafts  # some drafts of several
    assert during.token_ids == after == batched == again


def test_a_reproducible_call_runs_alone_and_from_its_own_prefill(
    target, draft, tokenizer, monkeypatch
) -> None:
    batched_rows: list[int] = []
    forward_batch = ModelRunner.forward_batch

    def counted(self, items, keep):  # type: ignore[no-untyped-def]
        batched_rows.append(len(items))
        return forward_batch(self, items, keep)

    monkeypatch.setattr(ModelRunner, "forward_batch", counted)
    for reproducible in (False, True):
        rt = runtime(target, draft, tokenizer, reproducible, PinnedCosts())
        try:
            anyio.run(with_others, rt)
            anyio.run(with_others, rt)
            assert rt.prefix_cache is not None
            kept = len(rt.prefix_cache)
        finally:
            rt.close()
        if reproducible:
            assert batched_rows == []  # seven at once, each forward alone
            assert kept == 0  # it neither reads nor leaves KV
        else:  # the control: the same calls batch, and leave their KV for later calls
            assert max(batched_rows, default=0) > 1
            assert kept > 0
            batched_rows.clear()


def test_reproducible_needs_the_calls_own_history() -> None:
    with pytest.raises(ValidationError, match=r"reproducible.*history: call"):
        Policy(
            name="p",
            description="d",
            mode="lossless",
            reproducible=True,
            drafter={"kind": "auto", "history": "tenant"},
        )


def test_the_shipped_legal_and_medical_policies_are_reproducible() -> None:
    policies = shipped_policies()
    assert policies["legal-drafting"].reproducible
    assert policies["medical-summary"].reproducible
    assert not policies["customer-reply"].reproducible
