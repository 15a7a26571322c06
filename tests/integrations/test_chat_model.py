"""ChatSpecAgent behaviour beyond the standard suites, on a tiny random model."""

from __future__ import annotations

import json
import threading
from typing import Literal

import jsonschema
import pytest
from conftest import make_model, perturbed_copy
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

from langchain_specagent import ChatSpecAgent
from langchain_specagent._translate import to_chat_message
from specagent import Policy, PolicyNotFoundError, SpecRuntime
from specagent.calls import ANSWER_AFTER_TOOLS, CallSpec


@pytest.fixture
def anyio_backend() -> str:
    """LangChain's async API is asyncio's (``ainvoke``/``abatch`` gather asyncio futures): its
    tests run on asyncio only; the runtime's own tests cover trio."""
    return "asyncio"


POLICIES = [
    Policy(
        name="exact",
        description="lossless",
        mode="lossless",
        drafter={"kind": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
        match={"tags": ["customer"]},
    ),
    Policy(
        name="notes",
        description="relaxed",
        mode="relaxed",
        drafter={"kind": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
        acceptance={"rule": "lenience", "lenience": 0.3},
        match={"tags": ["summary"]},
    ),
]


class Forecast(BaseModel):
    """A weather forecast."""

    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=9)
    sunny: bool


def get_time(zone: Literal["utc", "cet"]) -> str:
    """Current time in a time zone."""
    return "12:00"


def add(a: int, b: int) -> int:
    """Add two small integers."""
    return a + b


@pytest.fixture(scope="module")
def runtime(tokenizer):
    # The session's tiny target with a 2k context: response formats add their schema to the
    # prompt, which the byte-level test tokenizer spells out in many tokens.
    target = make_model(len(tokenizer), layers=4, seed=0, init=0.1, max_positions=2048)
    rt = SpecRuntime(
        target=target,
        draft=perturbed_copy(target, scale=0.05, seed=1),
        tokenizer=tokenizer,
        policies=POLICIES,
        device="cpu",
        model_name="tiny-llama",
    )
    yield rt
    rt.close()


@pytest.fixture
def chat(runtime) -> ChatSpecAgent:
    return ChatSpecAgent(runtime=runtime, policy="exact", max_tokens=20)


MESSAGES = [SystemMessage("Be brief."), HumanMessage("Where is my parcel?")]


def test_invoke_stream_batch_agree_with_the_runtime(chat, runtime) -> None:
    expected = runtime.generate_sync(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Where is my parcel?"},
        ],
        policy="exact",
        max_new_tokens=20,
    )
    message = chat.invoke(MESSAGES)
    assert message.content == expected.text
    streamed = "".join(str(c.content) for c in chat.stream(MESSAGES))
    assert streamed == expected.text
    assert [m.content for m in chat.batch([MESSAGES, MESSAGES])] == [expected.text] * 2


@pytest.mark.anyio
async def test_async_paths_agree(chat) -> None:
    sync = chat.invoke(MESSAGES).content
    assert (await chat.ainvoke(MESSAGES)).content == sync
    assert "".join([str(c.content) async for c in chat.astream(MESSAGES)]) == sync
    assert [m.content for m in await chat.abatch([MESSAGES] * 3)] == [sync] * 3


def test_invoke_from_worker_threads(chat) -> None:
    expected = chat.invoke(MESSAGES).content
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(chat.invoke(MESSAGES).content))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 4


def test_usage_and_response_metadata(chat) -> None:
    message = chat.invoke(MESSAGES)
    usage = message.usage_metadata
    assert usage is not None
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    assert 0 <= usage["input_token_details"]["cache_read"] < usage["input_tokens"]
    meta = message.response_metadata
    assert meta["model_name"] == "tiny-llama"
    assert meta["finish_reason"] in {"stop", "length"}
    assert meta["specagent"]["policy"] == "exact"
    assert meta["specagent"]["mode"] == "lossless"
    assert 0.0 <= meta["specagent"]["acceptance_rate"] <= 1.0
    chunks = list(chat.stream(MESSAGES))
    assert sum(1 for c in chunks if c.usage_metadata) == 1
    result = chat.generate([MESSAGES])
    assert result.llm_output["token_usage"]["completion_tokens"] == usage["output_tokens"]


def test_new_token_callbacks(chat) -> None:
    class Collect(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs) -> None:
            self.tokens.append(token)

    handler = Collect()
    message = chat.invoke(MESSAGES, config={"callbacks": [handler]})
    assert "".join(handler.tokens) == message.content
    assert len(handler.tokens) > 1


def test_policy_from_config_metadata_tags_and_default(chat) -> None:
    by_meta = chat.invoke(MESSAGES, config={"metadata": {"specagent_policy": "notes"}})
    assert by_meta.response_metadata["specagent"]["mode"] == "relaxed"
    by_tags = ChatSpecAgent(runtime=chat.runtime, max_tokens=5).invoke(
        MESSAGES, config={"tags": ["summary"]}
    )
    assert by_tags.response_metadata["specagent"]["policy"] == "notes"
    default = chat.invoke(MESSAGES)
    assert default.response_metadata["specagent"]["policy"] == "exact"
    with pytest.raises(PolicyNotFoundError, match="known policies"):
        chat.invoke(MESSAGES, config={"metadata": {"specagent_policy": "nope"}})


def test_required_tool_call_is_valid_even_from_a_random_model(chat) -> None:
    model = chat.bind_tools([add, get_time], tool_choice="any")
    for seed in range(3):
        message = model.invoke(MESSAGES, seed=seed, temperature=1.0, max_tokens=200)
        (call,) = message.tool_calls
        assert call["name"] in {"add", "get_time"}
        if call["name"] == "add":
            assert set(call["args"]) == {"a", "b"}
            assert all(isinstance(v, int) for v in call["args"].values())
        else:
            assert call["args"]["zone"] in {"utc", "cet"}
        assert message.response_metadata["finish_reason"] == "tool_calls"
    named = chat.bind_tools([add, get_time], tool_choice="get_time").invoke(
        MESSAGES, max_tokens=200
    )
    assert named.tool_calls[0]["name"] == "get_time"
    with pytest.raises(ValueError, match="not one of the bound tools"):
        chat.bind_tools([add], tool_choice="missing")
    # ChatOpenAI's parallel_tool_calls is taken, not refused as an unknown argument.
    single = chat.bind_tools([add, get_time], tool_choice="any", parallel_tool_calls=False)
    assert len(single.invoke(MESSAGES, seed=0, temperature=1.0, max_tokens=200).tool_calls) == 1


def test_tool_message_history_is_rendered(chat, runtime, tokenizer) -> None:
    history = [
        HumanMessage("What is 2 + 3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}]),
        ToolMessage("5", tool_call_id="call_1"),
    ]
    message = chat.bind_tools([add]).invoke(history)
    assert message.usage_metadata["input_tokens"] == len(
        tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": ""},
                {"role": "tool", "content": "5"},
            ],
            add_generation_prompt=True,
            tokenize=True,
        )["input_ids"]
    )


def test_an_answer_to_a_tool_result_starts_as_prose(chat, runtime) -> None:
    history = [
        HumanMessage("What is 2 + 3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}]),
        ToolMessage('{"sum": 5}', tool_call_id="call_1"),
    ]
    guarded = CallSpec.build([to_chat_message(m) for m in history])
    assert guarded.call.constraint is ANSWER_AFTER_TOOLS
    assert CallSpec.build([to_chat_message(m) for m in history[:1]]).call.constraint is None
    offered = [convert_to_openai_tool(add)]
    assert (
        CallSpec.build([to_chat_message(m) for m in history], tools=offered).call.constraint is None
    )
    unguarded = CallSpec.build([to_chat_message(m) for m in history], answer_guard=False)
    assert unguarded.call.constraint is None
    # a random tiny model starts with anything; under the guard never with markup or blanks,
    # and an answer cut by max_tokens is prose cut short, not an error
    free = ChatSpecAgent(runtime=runtime, policy="exact", guard_answers=False)
    guarded_starts, free_starts = set(), set()
    for seed in range(12):
        options = {"seed": seed, "temperature": 1.0, "max_tokens": 3}
        guarded_starts.add(chat.invoke(history, **options).content[:1])
        free_starts.add(free.invoke(history, **options).content[:1])
    assert not guarded_starts & set("{[< \n\t")
    assert free_starts & set("{[< \n\t")  # what the guard keeps out does happen without it


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_is_valid_by_construction(chat, method) -> None:
    structured = chat.with_structured_output(Forecast, method=method)
    for seed in range(3):
        forecast = structured.invoke(MESSAGES, seed=seed, temperature=1.0, max_tokens=200)
        assert isinstance(forecast, Forecast)
    as_dict = chat.with_structured_output(Forecast.model_json_schema(), method=method)
    jsonschema.validate(as_dict.invoke(MESSAGES, max_tokens=200), Forecast.model_json_schema())


def test_structured_output_include_raw_and_json_mode(chat) -> None:
    bounded = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    json_mode = ChatSpecAgent(runtime=chat.runtime, max_tokens=200).bind(
        response_format={"type": "json_schema", "json_schema": {"schema": bounded}}
    )
    assert isinstance(json.loads(json_mode.invoke(MESSAGES).content)["ok"], bool)
    roomy = ChatSpecAgent(runtime=chat.runtime, policy="exact", max_tokens=200)
    raw = roomy.with_structured_output(Forecast, include_raw=True).invoke(MESSAGES)
    assert isinstance(raw["raw"], AIMessage)
    assert isinstance(raw["parsed"], Forecast)
    assert raw["parsing_error"] is None
    assert json.loads(raw["raw"].content) == raw["parsed"].model_dump()


def test_truncated_constrained_output_is_a_clear_error(chat) -> None:
    with pytest.raises(OutputParserException, match="did not complete within 3 tokens"):
        chat.with_structured_output(Forecast).invoke(MESSAGES, max_tokens=3)


def test_needs_a_runtime_or_a_target() -> None:
    with pytest.raises(ValueError, match="needs runtime"):
        ChatSpecAgent()


def test_the_model_tenant_wins_over_call_metadata(runtime) -> None:
    """Metadata can come from a client: it may not move a call into another tenant's history
    and prefixes, unless the model allows it. Calls with no tenant share no prefix KV."""
    messages = [HumanMessage(content="The same long question, asked again and again. " * 8)]

    def cached(chat: ChatSpecAgent, **config) -> int:
        reply = chat.invoke(messages, config=config)
        return reply.usage_metadata["input_token_details"]["cache_read"]

    anonymous = ChatSpecAgent(runtime=runtime, policy="exact", max_tokens=4)
    cached(anonymous)
    assert cached(anonymous) == 0
    fixed = ChatSpecAgent(runtime=runtime, policy="exact", max_tokens=4, tenant="acme")
    cached(fixed)
    assert cached(fixed) > 0
    with pytest.raises(ValueError, match="serves tenant 'acme'"):
        fixed.invoke(messages, config={"metadata": {"specagent_tenant": "globex"}})
    assert cached(fixed, metadata={"specagent_tenant": "acme"}) > 0
    routed = ChatSpecAgent(
        runtime=runtime, policy="exact", max_tokens=4, tenant="acme", allow_tenant_override=True
    )
    assert cached(routed, metadata={"specagent_tenant": "globex"}) == 0  # globex's own scope


def test_a_prediction_per_call_as_chat_openai_takes_it(chat, runtime) -> None:
    """``prediction`` per call (``ChatOpenAI``'s spelling): the answer is the same, the
    accepted and rejected prediction tokens come back in the token usage."""
    expected = chat.invoke(MESSAGES)
    prediction = {"type": "content", "content": expected.content}
    message = chat.invoke(MESSAGES, prediction=prediction)
    assert message.content == expected.content
    accepted = message.response_metadata["specagent"]["accepted_by_source"].get("prediction", 0)
    assert accepted > 0
    result = chat.generate([MESSAGES], prediction=prediction)
    usage = result.generations[0][0].generation_info["token_usage"]
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] == accepted
    with pytest.raises(ValueError, match="prediction: 'type' must be 'content'"):
        chat.invoke(MESSAGES, prediction={"type": "text", "content": "x"})
