"""LangChain 1.x agents (``langchain.agents.create_agent``) on a real small instruct model: the
tool loop ends in an answer that uses the tool's result, and ``response_format`` gives a parsed
object. Plus the repeated-call guard that makes the loop end on small models, on its own."""

from __future__ import annotations

import pytest
from capable import CAPABLE_ENGINES, NO_CAPABLE_MODEL, capable_runtime
from langchain_core.tools import tool
from pydantic import BaseModel

from langchain_specagent import ChatSpecAgent
from specagent.calls import repeats_answered_calls
from specagent.chat import ToolCall

agents = pytest.importorskip("langchain.agents")


def needs_model(test):
    """A test on the real model, on every engine: the full suite's, and never with
    SPECAGENT_TEST_MODEL=none."""
    skip = pytest.mark.skipif(NO_CAPABLE_MODEL, reason="SPECAGENT_TEST_MODEL=none")
    on_engines = pytest.mark.parametrize("engine", CAPABLE_ENGINES)
    return pytest.mark.real_model(skip(on_engines(test)))


@tool
def order_status(order_id: str) -> str:
    """Look up where a customer's order is."""
    return f"Order {order_id}: shipped with NordPost, arrives Thursday."


class Weather(BaseModel):
    city: str
    raining: bool


@needs_model
def test_agent_tool_loop_ends_in_an_answer_from_the_tool_result(engine) -> None:
    llm = ChatSpecAgent(runtime=capable_runtime(engine), max_tokens=120)
    agent = agents.create_agent(
        llm,
        tools=[order_status],
        system_prompt="You are a support agent. Use tools, then answer briefly.",
    )
    out = agent.invoke(
        {"messages": [{"role": "user", "content": "Where is my order A-10234?"}]},
        {"recursion_limit": 8},
    )
    messages = out["messages"]
    calls = [c for m in messages for c in getattr(m, "tool_calls", None) or []]
    assert calls[0]["name"] == "order_status"
    assert calls[0]["args"] == {"order_id": "A-10234"}
    final = messages[-1]
    assert final.type == "ai"
    assert not final.tool_calls
    assert "Thursday" in final.content or "NordPost" in final.content
    assert len(messages) <= 5  # user, call, result, answer (no loop of repeated calls)


@needs_model
def test_agent_response_format_gives_a_parsed_object(engine) -> None:
    llm = ChatSpecAgent(runtime=capable_runtime(engine), max_tokens=120)
    agent = agents.create_agent(llm, tools=[], response_format=Weather)
    out = agent.invoke(
        {"messages": [{"role": "user", "content": "It is raining in Bergen today. Report it."}]}
    )
    assert out["structured_response"] == Weather(city="Bergen", raining=True)


def test_a_repeat_of_an_answered_call_is_recognised() -> None:
    made = [
        {"role": "user", "content": "Where is A-1?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "track", "arguments": {"order": "A-1", "full": True}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "In Oslo."},
    ]
    same = ToolCall(name="track", arguments={"full": True, "order": "A-1"}, id="c2")
    other = ToolCall(name="track", arguments={"order": "A-2"}, id="c3")
    assert repeats_answered_calls(made, [same])
    assert not repeats_answered_calls(made, [other])
    assert not repeats_answered_calls(made, [same, other])
    assert not repeats_answered_calls(made[:2], [same])  # made but never answered
    assert not repeats_answered_calls(made, [])
