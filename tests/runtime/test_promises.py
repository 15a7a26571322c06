"""What a policy promises holds on every engine, through the public runtime:

- ``reproducible``: the same call gives the same tokens alone, among other tenants' calls (on
  llama.cpp they fill and punch holes in the shared KV pool) and in a later runtime;
- tenant isolation: one tenant's prompts and outputs never seed another's forwards (kept
  prefixes) nor its drafts (history);
- lossless greedy output equals the engine's own plain greedy output.

Losslessness in distribution is checked by the chi-square suites on every engine
(``tests/decoding/test_lossless_distribution.py``, ``test_shipped_distributions.py``)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from conftest import PinnedCosts
from engine_pairs import ENGINES
from tiny_gguf import make_qwen2, write_gguf

from policies import make_policy
from specagent import Policy, RuntimeOptions, SpecRuntime

CLAUSE = [{"role": "user", "content": "Draft a clause about late delivery of the goods."}]
OTHERS = [
    [{"role": "user", "content": f"Question {i}: where is order {i}? " * 3}] for i in range(6)
]


def _policies() -> list[Policy]:
    return [
        make_policy(
            "clause",
            {"kind": "auto", "num_speculative_tokens": 8, "history": "call"},
            reproducible=True,
            sampling={"temperature": 1.0, "max_new_tokens": 40, "seed": 11},
        ),
        make_policy(
            "tenant-lookup",
            {"kind": "auto", "num_speculative_tokens": 8, "history": "tenant"},
            sampling={"temperature": 0.0, "max_new_tokens": 24},
        ),
        make_policy("plain", sampling={"temperature": 0.0, "max_new_tokens": 24}),
    ]


@pytest.fixture(params=[p for p in ENGINES if p.values[0] != "fake"])
def models(request, target, draft, tokenizer, tmp_path_factory) -> tuple[Any, Any]:
    """A target and a draft on the engine (the fake engine has no tokenizer to chat with)."""
    if request.param == "transformers":
        return target, draft
    from specagent.engines.llama_cpp import LlamaCppModel

    folder = tmp_path_factory.mktemp("promises")
    loaded = []
    for name, layers, seed in (("target", 2, 3), ("draft", 1, 4)):
        path = write_gguf(
            make_qwen2(len(tokenizer), layers=layers, seed=seed), tokenizer, folder / f"{name}.gguf"
        )
        loaded.append(LlamaCppModel(path, context_tokens=4096, max_sequences=48, threads=1))
    return loaded[0], loaded[1]


def _runtime(models, tokenizer) -> SpecRuntime:
    target, draft = models
    return SpecRuntime(
        target,
        draft,
        tokenizer=tokenizer,
        policies=_policies(),
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )


async def _among_others(rt: SpecRuntime) -> list[int]:
    """The clause among six other tenants' calls; two more rounds of others to leave holes in
    a shared pool before it (their calls end, their kept prefixes stay)."""
    results: dict[int, list[int]] = {}

    async def one(i: int, messages: list[dict[str, str]], policy: str) -> None:
        out = await rt.generate(messages, policy=policy, tenant=f"t{i % 3}")
        results[i] = out.token_ids

    for round_ in range(2):
        async with anyio.create_task_group() as tg:
            for i, messages in enumerate(OTHERS):
                tg.start_soon(one, 100 * (round_ + 1) + i, messages, "tenant-lookup")
    async with anyio.create_task_group() as tg:
        for i, messages in enumerate([*OTHERS[:3], CLAUSE, *OTHERS[3:]]):
            tg.start_soon(one, i, messages, "clause" if i == 3 else "tenant-lookup")
    return results[3]


def _logits_of(rt: SpecRuntime, policy: str) -> list[list[torch.Tensor]]:
    """Every logits tensor each call under ``policy`` is sent, one list per call (through the
    runtime's own decode, ``rt._decoder``: no public hook shows a call's logits)."""
    calls: list[list[torch.Tensor]] = []
    decode = rt._decoder.decode

    def recorded(request, device):  # type: ignore[no-untyped-def]
        steps = decode(request, device)
        if request.policy.name != policy:
            return steps
        calls.append([])
        return _recording(steps, calls[-1])

    rt._decoder.decode = recorded  # type: ignore[method-assign]
    return calls


def _recording(steps, seen: list[torch.Tensor]):  # type: ignore[no-untyped-def]
    reply = None
    try:
        while True:
            item = steps.send(reply)
            reply = yield item
            if isinstance(reply, torch.Tensor):
                seen.append(reply.detach().clone())
    except StopIteration as done:
        return done.value


def test_a_reproducible_call_gives_the_same_logits_under_any_load(models, tokenizer) -> None:
    """Bit for bit: a near-tie anywhere in the call would otherwise change its tokens."""
    first = _runtime(models, tokenizer)
    logits = _logits_of(first, "clause")
    try:
        alone = first.generate_sync(CLAUSE, policy="clause")
        loaded = anyio.run(_among_others, first)
        again = first.generate_sync(CLAUSE, policy="clause").token_ids
    finally:
        first.close()
    later = _runtime(models, tokenizer)
    later_logits = _logits_of(later, "clause")
    try:
        in_a_later_runtime = anyio.run(_among_others, later)
    finally:
        later.close()
    assert len(alone.token_ids) > 20
    assert alone.stats.num_draft_tokens > 0
    assert alone.token_ids == loaded == again == in_a_later_runtime
    logits = [*logits, *later_logits]
    assert len(logits) == 4
    for other in logits[1:]:
        assert len(other) == len(logits[0])
        for a, b in zip(logits[0], other, strict=True):
            assert torch.equal(a, b)


def test_a_tenant_never_reads_another_tenants_prefix_or_history(models, tokenizer) -> None:
    """A tenant's call after another tenant's calls on the same text drafts, hits and
    forwards exactly as in a fresh runtime: nothing the other tenant left reaches it."""
    text = [{"role": "user", "content": "Repeat after me: the parcel ships on Friday. " * 4}]
    rt = _runtime(models, tokenizer)
    try:
        # Both runtimes plan with the same (pinned) costs, not with the prior meanwhile.
        assert rt.wait_measured(timeout=60)
        first = rt.generate_sync(text, policy="tenant-lookup", tenant="acme")
        same = rt.generate_sync(text, policy="tenant-lookup", tenant="acme")
        other = rt.generate_sync(text, policy="tenant-lookup", tenant="globex")
        plain = rt.generate_sync(text, policy="plain")
    finally:
        rt.close()
    fresh_rt = _runtime(models, tokenizer)
    try:
        assert fresh_rt.wait_measured(timeout=60)
        fresh = fresh_rt.generate_sync(text, policy="tenant-lookup", tenant="globex")
    finally:
        fresh_rt.close()
    assert same.usage.cached_input_tokens > 0  # the tenant's own kept prefix
    assert same.stats.num_accepted_tokens > first.stats.num_accepted_tokens  # its history
    assert other.usage.cached_input_tokens == 0
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_by_source"):
        assert getattr(other.stats, field) == getattr(fresh.stats, field), field
    # Lossless greedy: every call's tokens are the engine's own plain greedy tokens.
    assert first.token_ids == same.token_ids == other.token_ids == plain.token_ids
