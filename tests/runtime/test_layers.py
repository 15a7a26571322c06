"""The seams between the layers: the drafter registry (a new drafter is its builder plus one
registry entry), cost measurement in the worker's background, the OpenAI-shaped call layer, and
the backend protocol that front doors depend on."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest
import torch

from policies import make_policy
from specagent import Backend, InvalidRequestError, Policy, SpecRuntime
from specagent.call import Call
from specagent.calls import CallSpec, constraint_for, run_call, tool_choice_name
from specagent.decoding import registry
from specagent.decoding.drafters import PromptLookupDrafter
from specagent.decoding.drafters.prompt_lookup import NgramFields
from specagent.decoding.schedule import FixedSchedule
from specagent.grammar import Constraint
from specagent.results import StreamChunk
from specagent.runtime.memory import costs as costs_module

ADAPTIVE = make_policy("adaptive", {"kind": "draft_model", "num_speculative_tokens": 6})
LOOKUP = make_policy(
    "lookup",
    {"kind": "prompt_lookup", "num_speculative_tokens": 3, "adaptive": False},
    match={"tags": ["extract"]},
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look an order up",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "enum": ["A-1", "B-2"]}},
                "required": ["order_id"],
            },
        },
    }
]


# --------------------------------------------------------------------------- registry


class _CountingLookup(PromptLookupDrafter):
    """A drafter defined outside the package: prompt lookup that counts its proposals."""

    name = "counting_lookup"
    proposals = 0

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        type(self).proposals += 1
        return super().propose(*args, **kwargs)


class _CountingConfig(NgramFields):
    """Its policy block: the n-grams, and nothing of another kind."""

    kind: Literal["counting_lookup"] = "counting_lookup"


def _build_counting(config: _CountingConfig, parts: registry.DraftingParts) -> Any:
    return _CountingLookup(config.max_ngram, config.min_ngram), FixedSchedule(
        config.num_speculative_tokens
    )


def test_a_new_drafter_is_its_block_and_builder_plus_one_registry_entry(
    target, tokenizer, monkeypatch
) -> None:
    monkeypatch.setitem(
        registry.DRAFTERS,  # type: ignore[arg-type]
        "counting_lookup",
        registry.DrafterKind(_CountingConfig, _build_counting),
    )
    with pytest.raises(ValueError, match=r"drafter\.adaptive"):  # not a setting of this kind
        make_policy("counting", {"kind": "counting_lookup", "adaptive": False})
    policy = Policy(
        name="counting",
        description="a registered drafter",
        mode="lossless",
        drafter={"kind": "counting_lookup", "num_speculative_tokens": 3},
    )
    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[policy], device="cpu")
    plain = runtime.with_policies(
        [Policy(name="plain", description="no drafting", mode="lossless", drafter={"kind": "none"})]
    )
    prompt = "Hello world, hello world, hello"
    result = runtime.generate_sync(prompt, policy="counting", max_new_tokens=12)
    assert _CountingLookup.proposals > 0
    assert result.stats.drafter == "counting_lookup"
    assert result.token_ids == plain.generate_sync(prompt, max_new_tokens=12).token_ids
    runtime.close()
    plain.close()


def test_an_unregistered_drafter_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown drafter 'tree'.*prompt_lookup"):
        Policy.model_validate(
            {"name": "x", "description": "d", "mode": "lossless", "drafter": {"kind": "tree"}}
        )
    with pytest.raises(ValueError, match="unknown drafter 'draft_model'"):
        Policy.model_validate(
            {
                "name": "x",
                "description": "d",
                "mode": "lossless",
                "drafter": {"kind": "draft_model", "fallback": "draft_model"},
            }
        )


def test_relaxed_rules_and_their_tuning_grids_come_from_the_registry() -> None:
    from specagent.measuring.tuning import GRIDS

    assert set(GRIDS) == set(registry.RULES)
    for name, kind in registry.RULES.items():
        block = kind.config(rule=name)
        assert block.build() is not None
        assert set(kind.grid) <= set(type(block).model_fields)


# --------------------------------------------------------------------------- background costs


def test_costs_are_measured_in_the_background_while_calls_proceed(target, draft, tokenizer) -> None:
    runtime = SpecRuntime(target, draft, tokenizer, [ADAPTIVE], "cpu")
    assert not runtime.activity()["measured"]
    prior = runtime.planning_costs("adaptive")
    assert 0 < prior.draft_step <= 1.0  # the draft's share of the target's weight bytes
    assert not prior.verify  # nothing measured yet
    result = runtime.generate_sync("The quick brown fox", max_new_tokens=8)
    assert result.usage.output_tokens >= 1
    assert runtime.wait_measured(timeout=120)
    assert runtime.activity()["measured"]
    measured = runtime.step_costs("adaptive")
    assert runtime.planning_costs("adaptive") == measured
    assert measured.verify[0] == 1.0
    assert len(measured.verify) == 7
    assert len(measured.draft) == 7
    runtime.close()


def test_a_failing_measurement_leaves_calls_on_the_prior(
    target, draft, tokenizer, monkeypatch, caplog
) -> None:
    def broken(*args: object, **kwargs: object) -> Any:
        raise RuntimeError("timer broke")
        yield  # pragma: no cover

    monkeypatch.setattr(costs_module, "measure_steps", broken)
    runtime = SpecRuntime(target, draft, tokenizer, [ADAPTIVE], "cpu")
    with caplog.at_level(logging.ERROR, logger="specagent.runtime"):
        assert runtime.wait_measured(timeout=60)
        result = runtime.generate_sync("Hello world", max_new_tokens=6)
    assert result.usage.output_tokens >= 1
    assert "measuring step costs failed" in caplog.text
    assert not runtime.planning_costs("adaptive").verify  # still the prior
    runtime.close()


# --------------------------------------------------------------------------- the call layer


def test_tool_choice_spellings_and_errors() -> None:
    names = ["lookup_order"]
    assert tool_choice_name(None, names) is None
    assert tool_choice_name("auto", names) == "auto"
    assert tool_choice_name(True, names) == "any"
    assert tool_choice_name("required", names) == "any"
    assert tool_choice_name({"type": "function", "function": {"name": "lookup_order"}}, names) == (
        "lookup_order"
    )
    with pytest.raises(InvalidRequestError, match="'cancel_order' is not one of the bound tools"):
        tool_choice_name("cancel_order", names)
    with pytest.raises(InvalidRequestError, match="response_format type must be"):
        constraint_for(None, None, {"type": "xml"})
    assert constraint_for(TOOLS, "auto", None) is None
    assert constraint_for(TOOLS, "any", None) is not None


def test_call_spec_policy_precedence(target, draft, tokenizer) -> None:
    runtime = SpecRuntime(target, draft, tokenizer, [ADAPTIVE, LOOKUP], "cpu")
    messages = [{"role": "user", "content": "hi"}]

    def policy(**kwargs: Any) -> str:
        call = CallSpec.build(messages, **kwargs).call
        return runtime.policies.resolve(call.policy, call.tags, call.default_policy).name

    assert policy(policy="lookup", default_policy="adaptive") == "lookup"  # named wins
    assert policy(tags=["extract"], default_policy="adaptive") == "lookup"  # tags route
    assert policy(tags=["other"], default_policy="adaptive") == "adaptive"  # else the default
    assert policy(tags=["other"]) == runtime.policies.default.name  # else the runtime's
    assert CallSpec.build(messages, tags=["extract"]).call.policy is None  # chosen at admission
    spec = CallSpec.build(messages, tools=TOOLS, tool_choice="none", stop="END", seed=3)
    assert spec.call.tools is None
    assert spec.call.constraint is None
    assert spec.call.stop == ("END",)
    assert spec.call.seed == 3
    runtime.close()


@pytest.mark.anyio
async def test_run_call_forces_and_parses_a_tool_call(target, tokenizer) -> None:
    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[LOOKUP], device="cpu")
    call = CallSpec.build(
        [{"role": "user", "content": "Where is order A-1?"}],
        tools=TOOLS,
        tool_choice="lookup_order",
        max_tokens=120,
        policy="lookup",
    )
    chunks = [chunk async for chunk in run_call(runtime, call)]
    assert all(not c.text for c in chunks[:-1])  # a forced call is held back whole
    last = chunks[-1]
    assert last.finish_reason == "tool_calls"
    assert [c.name for c in last.tool_calls] == ["lookup_order"]
    assert isinstance(last.tool_calls[0].arguments["order_id"], str)
    await runtime.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("parallel", [None, False])
async def test_parallel_tool_calls_false_keeps_the_first_call(target, tokenizer, parallel) -> None:
    """A reply that makes two calls (here the grammar makes the tiny model write them) keeps
    both, or with ``parallel_tool_calls=False`` its first."""
    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[LOOKUP], device="cpu")
    one = '{"name": "lookup_order", "arguments": {"order_id": "%s"}}'
    written = "[" + one % "A-1" + ", " + one % "B-2" + "]"
    spec = CallSpec.build(
        [{"role": "user", "content": "Where are orders A-1 and B-2?"}],
        tools=TOOLS,
        max_tokens=200,
        policy="lookup",
        parallel_tool_calls=parallel,
    )
    forced = Constraint.lark("start: " + json.dumps(written))
    spec = dataclasses.replace(spec, call=dataclasses.replace(spec.call, constraint=forced))
    chunks = [chunk async for chunk in run_call(runtime, spec)]
    last = chunks[-1]
    orders = [c.arguments["order_id"] for c in last.tool_calls]
    assert orders == (["A-1", "B-2"] if parallel is None else ["A-1"])
    assert last.finish_reason == "tool_calls"
    await runtime.aclose()


# --------------------------------------------------------------------------- the backend seam


class _Relay(Backend):
    """Another backend in front of a runtime (as a remote replica would be): it satisfies the
    protocol without being a ``SpecRuntime`` and counts the calls it relays."""

    def __init__(self, runtime: SpecRuntime) -> None:
        self.inner = runtime
        self.model_name = "relay"
        self.policies = runtime.policies
        self.calls = 0

    async def run(self, call: Call, *, streaming: bool = True) -> AsyncIterator[StreamChunk]:
        self.calls += 1
        async for chunk in self.inner.run(call, streaming=streaming):
            yield chunk

    async def aclose(self, drain: bool = True) -> None:
        await self.inner.aclose(drain)

    def close(self, drain: bool = True) -> None:
        self.inner.close(drain)


def test_front_doors_take_any_backend(target, tokenizer) -> None:
    from langchain_specagent import ChatSpecAgent

    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[LOOKUP], device="cpu")
    relay = _Relay(runtime)
    assert isinstance(runtime, Backend)
    assert isinstance(relay, Backend)
    model = ChatSpecAgent(runtime=relay, policy="lookup", max_tokens=6)
    message = model.invoke("Hello")
    assert relay.calls == 1
    assert message.response_metadata["specagent"]["policy"] == "lookup"
    with pytest.raises(ValueError, match="runtime must be a SpecRuntime"):
        ChatSpecAgent(runtime=torch.nn.Linear(1, 1))
    runtime.close()


def test_a_call_reads_a_lone_string_as_one_tag_or_stop() -> None:
    call = Call("hi", tags="extract", stop="END")
    assert call.tags == ("extract",)
    assert call.stop == ("END",)
    assert Call("hi", tags=["a", "b"], stop=["x"]).tags == ("a", "b")
    assert Call("hi").stop is None  # the policy's stop strings
