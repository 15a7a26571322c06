"""langchain-openai's ``ChatOpenAI`` pointed at a live specagent server: invoke, stream,
bind_tools and with_structured_output, as an app in another process would use it; and the
same over the Responses API (``use_responses_api=True``)."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from live_server import KEYS, Live, key_file, live, spelled_reply  # fixtures by name
from pydantic import BaseModel, Field


class Forecast(BaseModel):
    """A weather forecast."""

    city: str = Field(max_length=10)
    rain: bool


@tool
def get_weather(city: str) -> str:
    """Weather in a city."""
    return f"rain in {city}"


def chat(live: Live, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        model="tiny", base_url=live.base_url, api_key=KEYS["full"], max_retries=0, **kwargs
    )


def test_invoke_and_stream_agree(live: Live) -> None:
    model = chat(live, temperature=0, max_tokens=12, stream_usage=True)
    message = model.invoke("Hello world")
    assert isinstance(message, AIMessage)
    assert message.content
    assert message.usage_metadata["output_tokens"] > 0
    streamed = list(model.stream("Hello world"))
    assert "".join(str(c.content) for c in streamed) == message.content
    total = streamed[0]
    for piece in streamed[1:]:
        total = total + piece
    assert total.usage_metadata["output_tokens"] == message.usage_metadata["output_tokens"]


def test_bind_tools_and_a_tool_loop(live: Live) -> None:
    model = chat(live, temperature=1.0, max_tokens=80, seed=2)
    called = model.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert called.tool_calls[0]["name"] == "get_weather"
    assert isinstance(called.tool_calls[0]["args"]["city"], str)
    result = get_weather.invoke(called.tool_calls[0])
    assert isinstance(result, ToolMessage)
    answer = chat(live, max_tokens=8).invoke([HumanMessage("Weather in Oslo?"), called, result])
    assert answer.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output(live: Live, method: str) -> None:
    model = chat(live, temperature=0, max_tokens=400)  # greedy: the same output every run
    if method == "json_mode":  # any object: a random model may write a long one
        free = chat(live, temperature=0, max_tokens=3000)
        parsed = free.with_structured_output(None, method=method).invoke("Forecast for Oslo")
        assert isinstance(parsed, dict)
        return
    forecast = model.with_structured_output(Forecast, method=method).invoke("Forecast for Oslo")
    assert isinstance(forecast, Forecast)


def test_a_denied_policy_reaches_langchain_as_an_error(live: Live) -> None:
    import openai

    customer = ChatOpenAI(
        model="tiny:internal-summary",
        base_url=live.base_url,
        api_key=KEYS["customer"],
        max_retries=0,
        max_tokens=4,
    )
    with pytest.raises(openai.NotFoundError):  # as if it did not exist: no names learned
        customer.invoke("Hello")


def test_a_prediction_through_chat_openai(live: Live) -> None:
    """``ChatOpenAI``'s per-call ``prediction`` reaches the server: the same answer, and the
    prediction's accepted tokens in the token usage it reports."""
    prompt = spelled_reply(live, 16)
    model = chat(live, temperature=0, max_tokens=16)
    message = model.invoke(prompt)
    again = model.invoke(prompt, prediction={"type": "content", "content": str(message.content)})
    assert again.content == message.content
    details = again.response_metadata["token_usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0


def test_chat_openai_on_the_responses_api_invokes_streams_and_calls_tools(live: Live) -> None:
    model = chat(live, temperature=0, max_tokens=12, use_responses_api=True)
    message = model.invoke("Hello world")
    assert message.text
    assert message.usage_metadata["output_tokens"] == 12
    streamed = list(model.stream("Hello world"))
    assert "".join(chunk.text for chunk in streamed) == message.text
    # A reproducible policy: the seed alone decides the sampled call, whatever ran before.
    tools = ChatOpenAI(
        model="tiny:legal-drafting",
        base_url=live.base_url,
        api_key=KEYS["full"],
        max_retries=0,
        temperature=1.0,
        max_tokens=200,
        extra_body={"seed": 2},
        use_responses_api=True,
    )
    for stream in (False, True):
        bound = tools.bind_tools([get_weather], tool_choice="get_weather")
        if stream:
            total = None
            for piece in bound.stream("Weather in Oslo?"):
                total = piece if total is None else total + piece
            called = total
        else:
            called = bound.invoke("Weather in Oslo?")
        assert called.tool_calls[0]["name"] == "get_weather"
        assert isinstance(called.tool_calls[0]["args"]["city"], str)
