"""A call is decided once on its way down: its policy routed and its tenant parsed exactly once,
its drafter block never again (the runtime decided each policy's when it was built), whether it
comes through the HTTP server, ``ChatSpecAgent`` or the SDK; everything below (worker, decoder,
span, audit row) reads the call's plan. And every sampling field reaches the sampler."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from live_server import KEYS, Live, key_file, live, sync_client  # fixtures by name

from specagent import tenants
from specagent.policy import PolicySet
from specagent.runtime import _admission

DECISIONS = {
    "drafter_blocks": _admission.drafter_blocks,
    "drafter_for": _admission.drafter_for,
    "tenant_of": tenants.tenant_of,
}
ONCE = {"route": 1, "tenant_of": 1}
"""Per call: its policy routed once and its tenant parsed once; its drafter block is looked up
in the table the runtime decided when it was built (``drafter_blocks``), never decided again."""


def _counting(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts of each decision, wherever a module of the package holds it (a new caller that
    imports one by name is counted too), and of the policy routing."""
    counts: Counter[str] = Counter()

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)

        return wrapper

    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith(("specagent", "langchain_specagent")):
            continue
        for name, real in DECISIONS.items():
            if getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, counted(name, real))
    monkeypatch.setattr(PolicySet, "_matched", counted("route", PolicySet._matched))
    return counts


MESSAGES = [{"role": "user", "content": "Summarise the meeting."}]


def test_a_served_call_is_decided_once(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    client = sync_client(live.base_url, KEYS["full"])
    counts = _counting(monkeypatch)
    client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        user="alice",
        metadata={"specagent_tags": "summary"},
    )
    assert counts == ONCE


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # LangChain's async API is asyncio's
async def test_an_sdk_call_and_a_langchain_call_are_decided_once(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    from langchain_specagent import ChatSpecAgent

    counts = _counting(monkeypatch)
    await live.runtime.generate(MESSAGES, tags=["summary"], tenant="bob", max_new_tokens=2)
    assert counts == ONCE
    counts.clear()
    chat = ChatSpecAgent(runtime=live.runtime, policy="customer-reply", tenant="bob", max_tokens=2)
    await chat.ainvoke("Where is my order?", config={"tags": ["summary"]})
    assert counts == ONCE


def test_top_k_from_each_front_door_reaches_the_sampler(live: Live) -> None:
    """``top_k: 1`` at temperature 1 samples from one token: the greedy reply, whatever the
    seed (without it, a seeded sample of the tiny model's flat distribution is not)."""
    from langchain_specagent import ChatSpecAgent

    client = sync_client(live.base_url, KEYS["full"])

    def served(**sampling: Any) -> str | None:
        reply = client.chat.completions.create(
            model="tiny:customer-reply", messages=MESSAGES, max_tokens=6, **sampling
        )
        return reply.choices[0].message.content

    greedy = served(temperature=0.0)
    assert all(served(temperature=1.0, seed=s, extra_body={"top_k": 1}) == greedy for s in (1, 2))
    assert any(served(temperature=1.0, seed=s) != greedy for s in (1, 2, 3))
    chat = ChatSpecAgent(runtime=live.runtime, policy="customer-reply", max_tokens=6)
    plain = chat.invoke(MESSAGES[0]["content"], temperature=0.0).content
    narrowed = chat.model_copy(update={"temperature": 1.0, "top_k": 1, "seed": 7})
    assert narrowed.invoke(MESSAGES[0]["content"]).content == plain
