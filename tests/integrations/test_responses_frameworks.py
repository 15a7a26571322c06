"""The Responses API as agent frameworks speak it, against a served real catalog model: the
``openai`` client's ``responses.create`` (plain, streamed, a function tool answered by chaining,
a JSON schema, a conversation chained by ``previous_response_id``), LangChain's
``ChatOpenAI(use_responses_api=True)`` running a ``create_agent`` tool loop, and the OpenAI
Agents SDK (``openai-agents``) running an agent with a function tool to its final output."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import openai
import pytest
from capable import NO_CAPABLE_MODEL, capable_runtime
from pydantic import BaseModel
from server.live_server import serving  # tests/ is on the path (conftest.py)

from specagent.engines.llama_cpp import available as llama_cpp_available
from specagent.server import KeyStore, ServerOptions, create_app, hash_key

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(NO_CAPABLE_MODEL, reason="SPECAGENT_TEST_MODEL=none"),
]

KEY = "responses-frameworks-key-0123456789"
SUPPORT = "You are a support agent. Use tools, then answer briefly."
QUESTION = "Where is my order A-10234?"
ORDER_TOOL = {
    "type": "function",
    "name": "order_status",
    "description": "Look up where a customer's order is.",
    "parameters": {
        "type": "object",
        "properties": {"order_id": {"type": "string"}},
        "required": ["order_id"],
        "additionalProperties": False,
    },
}


def order_status(order_id: str) -> str:
    """Look up where a customer's order is."""
    return f"Order {order_id}: shipped with NordPost, arrives Thursday."


def from_the_tool(text: str) -> bool:
    return "Thursday" in text or "NordPost" in text


class Weather(BaseModel):
    city: str
    raining: bool


class Served:
    def __init__(self, url: str, model: str) -> None:
        self.base_url, self.model = f"{url}/v1", model
        self.client = openai.OpenAI(base_url=self.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The real model on the engine a CPU user serves it with (llama.cpp where installed)."""
    runtime = capable_runtime("llama.cpp" if llama_cpp_available() else "transformers")
    key_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    key_file.write_text(f"keys:\n  - name: agents\n    sha256: {hash_key(KEY)}\n")
    app = create_app(runtime, KeyStore.load(key_file, env=""), ServerOptions())
    with serving(app) as url:
        served = Served(url, runtime.model_name)
        yield served
        served.client.close()


def test_plain_and_streamed(served: Served) -> None:
    asked = {
        "model": served.model,
        "instructions": "Answer with one word.",
        "input": "What is the capital of France?",
        "max_output_tokens": 16,
        "temperature": 0,
    }
    response = served.client.responses.create(**asked)
    assert response.status == "completed"
    assert "Paris" in response.output_text
    events = list(served.client.responses.create(**asked, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == response.output_text
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == response.output_text


def test_a_function_tool_answered_by_chaining(served: Served) -> None:
    asked = {"model": served.model, "instructions": SUPPORT, "tools": [ORDER_TOOL]}
    called = served.client.responses.create(
        **asked, input=QUESTION, tool_choice="required", max_output_tokens=120, temperature=0
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "order_status"
    assert json.loads(call.arguments) == {"order_id": "A-10234"}
    result = order_status(**json.loads(call.arguments))
    answer = served.client.responses.create(
        **asked,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        max_output_tokens=120,
        temperature=0,
    )
    assert from_the_tool(answer.output_text)


def test_a_json_schema_output(served: Served) -> None:
    response = served.client.responses.create(
        model=served.model,
        input="It is raining in Bergen today. Report it.",
        text={
            "format": {
                "type": "json_schema",
                "name": "weather",
                "schema": Weather.model_json_schema(),
                "strict": True,
            }
        },
        max_output_tokens=120,
        temperature=0,
    )
    assert Weather.model_validate_json(response.output_text) == Weather(city="Bergen", raining=True)


def test_a_conversation_chained_by_previous_response_id(served: Served) -> None:
    first = served.client.responses.create(
        model=served.model,
        input="My name is Astrid and I live in Tromsø. Say hello.",
        max_output_tokens=40,
        temperature=0,
    )
    second = served.client.responses.create(
        model=served.model,
        previous_response_id=first.id,
        input="What is my name? Answer with the name only.",
        max_output_tokens=16,
        temperature=0,
    )
    assert "Astrid" in second.output_text


def test_langchain_chat_openai_on_the_responses_api_runs_an_agent(served: Served) -> None:
    agents = pytest.importorskip("langchain.agents")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=served.model,
        base_url=served.base_url,
        api_key=KEY,
        use_responses_api=True,
        temperature=0,
        max_tokens=120,
        max_retries=0,
    )
    agent = agents.create_agent(llm, tools=[tool(order_status)], system_prompt=SUPPORT)
    out = agent.invoke(
        {"messages": [{"role": "user", "content": QUESTION}]}, {"recursion_limit": 8}
    )
    messages = out["messages"]
    calls = [c for m in messages for c in getattr(m, "tool_calls", None) or []]
    assert calls[0]["name"] == "order_status"
    assert calls[0]["args"] == {"order_id": "A-10234"}
    assert messages[-1].type == "ai"
    assert from_the_tool(messages[-1].text)


def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool(served: Served) -> None:
    sdk = pytest.importorskip("agents")
    sdk.set_tracing_disabled(True)  # its traces would go to OpenAI's servers

    async def run() -> object:
        async with openai.AsyncOpenAI(
            base_url=served.base_url, api_key=KEY, max_retries=0
        ) as client:
            agent = sdk.Agent(
                name="support",
                instructions=SUPPORT,
                model=sdk.OpenAIResponsesModel(model=served.model, openai_client=client),
                tools=[sdk.function_tool(order_status)],
                model_settings=sdk.ModelSettings(temperature=0, max_tokens=120),
            )
            return await sdk.Runner.run(agent, QUESTION, max_turns=4)

    result = asyncio.run(run())
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    assert calls
    assert json.loads(calls[0].raw_item.arguments) == {"order_id": "A-10234"}
    assert from_the_tool(result.final_output)
