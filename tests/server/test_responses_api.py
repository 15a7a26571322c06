"""OpenAI's Responses API on the live server, through the ``openai`` client's own
``responses`` resource and types: plain, streamed (every event parsed by the client's types, in
OpenAI's order), function tools, JSON schema output, log-probabilities, chaining by
``previous_response_id``, retrieval and deletion; a Responses call and a chat call asking the
same give the same tokens; another key can neither read, chain nor delete a key's responses;
unsupported fields are refused by name; the audit row names the endpoint."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from live_server import KEYS, Live, key_file, live, serving, sync_client  # fixtures by name
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseErrorEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseTextDeltaEvent,
)

from specagent.audit import AuditStore, read_calls
from specagent.server import KeyStore, ServerOptions, create_app

INSTRUCTIONS = "You are terse."
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORECAST = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}


def client(live: Live, key: str = "full") -> openai.OpenAI:
    return sync_client(live.base_url, KEYS[key])


def post(live: Live, body: dict, key: str = "full") -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[key]}"}
    return httpx.post(f"{live.base_url}/responses", json=body, headers=headers, timeout=60)


def test_a_plain_response(live: Live) -> None:
    response = client(live).responses.create(
        model="tiny", input="Hello there", max_output_tokens=6, temperature=0
    )
    assert isinstance(response, Response)
    assert response.id.startswith("resp_")
    assert response.status == "incomplete"  # the tiny model never stops by itself this soon
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.output_tokens == 6
    assert response.usage.total_tokens == response.usage.input_tokens + 6
    [message] = response.output
    assert isinstance(message, ResponseOutputMessage)
    assert response.output_text == message.content[0].text
    stats = response.model_extra["speculative_decoding_stats"]
    assert stats["policy"] == "default"
    assert response.store is True


def test_a_responses_call_and_a_chat_call_give_the_same_tokens(live: Live) -> None:
    """Same messages, policy and seed: the same tokens, with the same log-probabilities
    (sampled under a reproducible policy, so the seed alone decides them)."""
    asked = {"temperature": 1.0, "top_p": 0.9}
    chat = client(live).chat.completions.create(
        model="tiny:legal-drafting",
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "Tell me a story"},
        ],
        max_tokens=12,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        **asked,
    )
    response = client(live).responses.create(
        model="tiny:legal-drafting",
        instructions=INSTRUCTIONS,
        input=[{"role": "user", "content": "Tell me a story"}],
        max_output_tokens=12,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        extra_body={"seed": 7},
        **asked,
    )
    assert response.output_text == chat.choices[0].message.content
    chat_logprobs = chat.choices[0].logprobs.content
    response_logprobs = response.output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in response_logprobs] == [
        (e.token, e.logprob) for e in chat_logprobs
    ]
    assert [len(e.top_logprobs) for e in response_logprobs] == [2] * 12
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stream_is_openais_events_in_order(live: Live) -> None:
    asked = {"model": "tiny", "input": "Hello there", "max_output_tokens": 10, "temperature": 0}
    whole = client(live).responses.create(**asked)
    events = list(
        client(live).responses.create(
            **asked, stream=True, include=["message.output_text.logprobs"]
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == whole.output_text
    assert sum(len(d.logprobs) for d in deltas) == 10
    last = events[-1].response
    assert last.output_text == whole.output_text
    assert last.id == events[0].response.id
    assert last.usage.output_tokens == 10
    # The stream's response is stored as it was sent.
    assert client(live).responses.retrieve(last.id).output_text == whole.output_text


def test_a_function_tool_call_whole_streamed_and_answered(live: Live) -> None:
    asked = {
        "model": "tiny",
        "input": "Weather in Oslo?",
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 80,
        "temperature": 0,
    }
    response = client(live).responses.create(**asked)
    calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert calls[0].call_id
    events = list(client(live).responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(calls[0].arguments)
    assert isinstance(events[-1], ResponseCompletedEvent)
    # The tool's result, chained to the call that asked for it.
    answer = client(live).responses.create(
        model="tiny",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain"}],
        tools=[WEATHER_TOOL],
        max_output_tokens=6,
        temperature=0,
    )
    assert answer.output_text
    assert answer.previous_response_id == response.id
    # The same turn with the whole history sent as items, not chained: the same prompt.
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain"},
    ]
    unchained = client(live).responses.create(
        model="tiny", input=items, tools=[WEATHER_TOOL], max_output_tokens=6, temperature=0
    )
    assert unchained.usage.input_tokens == answer.usage.input_tokens
    assert unchained.output_text == answer.output_text


def test_json_schema_output(live: Live) -> None:
    response = client(live).responses.create(
        model="tiny",
        input="Forecast for Oslo",
        text={"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST}},
        max_output_tokens=400,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), FORECAST)
    assert response.text.format.type == "json_schema"


def test_chained_retrieved_and_deleted(live: Live) -> None:
    first = client(live).responses.create(
        model="tiny", instructions=INSTRUCTIONS, input="One", max_output_tokens=4, temperature=0
    )
    second = client(live).responses.create(
        model="tiny", previous_response_id=first.id, input="Two", max_output_tokens=4
    )
    # The conversation carried over (the first's input and output), its instructions not.
    alone = client(live).responses.create(model="tiny", input="Two", max_output_tokens=4)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    third = client(live).responses.create(
        model="tiny", previous_response_id=second.id, input="Three", max_output_tokens=4
    )
    assert third.usage.input_tokens > second.usage.input_tokens
    fetched = client(live).responses.retrieve(first.id)
    assert fetched.output_text == first.output_text
    assert fetched.usage == first.usage
    client(live).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client(live).responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client(live).responses.create(
            model="tiny", previous_response_id=first.id, input="Again", max_output_tokens=2
        )
    # A chain holds its whole conversation: deleting the first leaves the second's intact.
    fourth = client(live).responses.create(
        model="tiny", previous_response_id=second.id, input="Three", max_output_tokens=4
    )
    assert fourth.usage.input_tokens == third.usage.input_tokens
    unstored = client(live).responses.create(
        model="tiny", input="x", max_output_tokens=2, store=False
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client(live).responses.retrieve(unstored.id)


def test_another_key_cannot_read_chain_or_delete_a_response(live: Live) -> None:
    mine = client(live).responses.create(model="tiny", input="secret", max_output_tokens=3)
    never = "resp_" + "0" * 32
    answers = []
    for rid in (mine.id, never):
        with pytest.raises(openai.NotFoundError) as read:
            client(live, "customer").responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError) as chained:
            client(live, "customer").responses.create(
                model="tiny", previous_response_id=rid, input="more", max_output_tokens=2
            )
        with pytest.raises(openai.NotFoundError) as deleted:
            client(live, "customer").responses.delete(rid)
        answers.append(
            [e.value.body["message"].replace(rid, "<id>") for e in (read, chained, deleted)]
        )
    assert answers[0] == answers[1]  # another key's id reads exactly as one never made
    assert client(live).responses.retrieve(mine.id).output_text == mine.output_text
    with pytest.raises(openai.AuthenticationError):
        sync_client(live.base_url, "not-a-key-0123456789").responses.retrieve(mine.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"background": True}, "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "input_file", "file_id": "f"}]}, "input.0.type"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input.0.arguments",
        ),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": "x"}] * 2049}, "input"),
        ({"user": "a\x00b"}, "user"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_unsupported_fields_are_refused_by_name(live: Live, extra: dict, param: str) -> None:
    reply = post(live, {"model": "tiny", "input": "x", "max_output_tokens": 2, **extra})
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param)


def test_a_prompt_past_the_context_names_the_input(live: Live) -> None:
    reply = post(live, {"model": "tiny", "input": "word " * 6000, "max_output_tokens": 2})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "input"
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_hostile_bodies_are_refused_and_honest_calls_go_on(live: Live) -> None:
    headers = {"Authorization": f"Bearer {KEYS['full']}", "Content-Type": "application/json"}
    url = f"{live.base_url}/responses"
    for raw in (b"\xff\xfe{", b"{", b'{"model": "tiny"}', b"[]", b'{"model": 1, "input": "x"}'):
        assert httpx.post(url, content=raw, headers=headers, timeout=30).status_code == 422
    deep = {"model": "tiny", "input": [{"role": "tool", "content": "x"}]}
    assert post(live, deep).status_code == 422
    plain = {**headers, "Content-Type": "text/plain"}
    assert httpx.post(url, content=b"{}", headers=plain, timeout=30).status_code == 415
    assert post(live, {"model": "tiny", "input": "hi", "max_output_tokens": 2}).status_code == 200
    long_text = {"model": "tiny", "input": "word " * 500, "max_output_tokens": 2}
    assert post(live, long_text).status_code == 200  # a long string input is one message


def test_a_stream_that_fails_midway_ends_in_an_error_event(live: Live) -> None:
    events = list(
        client(live, "hasty").responses.create(
            model="tiny", input="Write a very long story", max_output_tokens=3000, stream=True
        )
    )
    assert events[0].type == "response.created"
    assert isinstance(events[-1], ResponseErrorEvent)
    assert events[-1].code == "deadline_exceeded"


def test_the_server_that_stores_nothing_says_so(runtime_app_without_store: str) -> None:
    url = runtime_app_without_store
    answers = []
    for extra in ({"store": True}, {"previous_response_id": "resp_1"}, {}):
        body = {"model": "tiny", "input": "x", "max_output_tokens": 2, **extra}
        headers = {"Authorization": f"Bearer {KEYS['full']}"}
        answers.append(httpx.post(f"{url}/v1/responses", json=body, headers=headers, timeout=60))
    assert [a.status_code for a in answers] == [400, 400, 200]
    assert answers[0].json()["error"]["param"] == "store"
    assert answers[1].json()["error"]["param"] == "previous_response_id"
    assert answers[2].json()["store"] is False


@pytest.fixture
def runtime_app_without_store(live: Live, key_file):
    options = ServerOptions(store_responses=False)
    with serving(create_app(live.runtime, KeyStore.load(key_file, env=""), options)) as url:
        yield url


def test_the_audit_row_names_the_endpoint(live: Live, key_file, tmp_path) -> None:
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.sqlite'}")
    app = create_app(live.runtime, KeyStore.load(key_file, env=""), ServerOptions(audit=store))
    headers = {"Authorization": f"Bearer {KEYS['full']}"}
    with serving(app) as url:
        body = {"model": "tiny", "input": "secret words", "max_output_tokens": 2}
        assert httpx.post(f"{url}/v1/responses", json=body, headers=headers).status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers).is_success
        refused = {**body, "background": True}
        assert httpx.post(f"{url}/v1/responses", json=refused, headers=headers).status_code == 422
        got = httpx.get(f"{url}/v1/responses/resp_x", headers=headers)
        assert got.status_code == 404
    assert store.flush()
    rows = read_calls(store.engine, limit=None)
    store.close()
    assert sorted((r["endpoint"], r["status"]) for r in rows) == [
        ("chat.completions", "200"),
        ("responses", "200"),
        ("responses", "422"),
    ]
    assert all("secret words" not in str(v) for r in rows for v in r.values())


def test_a_key_flooding_the_store_drops_only_its_own(live: Live, key_file) -> None:
    options = ServerOptions(responses_max_bytes_per_key=40_000)
    app = create_app(live.runtime, KeyStore.load(key_file, env=""), options)
    with serving(app) as url:
        theirs = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["customer"], max_retries=0)
        flood = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["full"], max_retries=0)
        with theirs, flood:
            kept = theirs.responses.create(model="tiny", input="mine", max_output_tokens=2)
            ids = [
                flood.responses.create(model="tiny", input="x" * 2000, max_output_tokens=2).id
                for _ in range(40)
            ]
            assert theirs.responses.retrieve(kept.id).id == kept.id
            assert flood.responses.retrieve(ids[-1]).id == ids[-1]
            with pytest.raises(openai.NotFoundError):
                flood.responses.retrieve(ids[0])  # its own oldest made room


def test_the_metrics_count_responses_calls_and_every_stored_id_as_one_route(live: Live) -> None:
    full = {"Authorization": f"Bearer {KEYS['full']}"}
    for n in range(30):  # a scan of ids: one series, not thirty
        assert httpx.get(f"{live.base_url}/responses/resp_{n}", headers=full).status_code == 404
    client(live).responses.create(model="tiny:customer-reply", input="x", max_output_tokens=2)
    text = httpx.get(f"{live.url}/metrics", headers=full, timeout=30).text
    counts = [
        line
        for line in text.splitlines()
        if line.startswith("http_server_request_duration_seconds_count{")
    ]
    stored = [
        line
        for line in counts
        if 'http_route="/v1/responses/{id}"' in line
        and 'http_request_method="GET"' in line
        and 'http_response_status_code="404"' in line
    ]
    assert len(stored) == 1
    assert float(stored[0].rsplit(" ", 1)[1]) >= 30
    assert not any("resp_" in line for line in counts)
    served = [line for line in counts if 'http_route="/v1/responses"' in line]
    assert any('specagent_policy="customer-reply"' in line for line in served)


def test_a_stored_responses_input_items_are_listed_back(live: Live) -> None:
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
    ]
    response = client(live).responses.create(
        model="tiny", input=items, tools=[WEATHER_TOOL], max_output_tokens=2
    )
    listed = client(live).responses.input_items.list(response.id)
    assert [item.type for item in listed.data] == [
        "message",
        "message",
        "function_call_output",
        "function_call",
        "message",
    ]  # newest first, as OpenAI lists them
    assert listed.data[0].content[0].text == "And tomorrow?"
    assert listed.data[1].role == "assistant"
    assert listed.data[2].output == "rain"
    assert listed.data[3].name == "get_weather"
    assert len({item.id for item in listed.data}) == 5
    page = client(live).responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.type for item in page.data] == ["message", "function_call"]
    assert page.has_more
    rest = client(live).responses.input_items.list(response.id, order="asc", after=page.data[-1].id)
    assert [item.type for item in rest.data] == ["function_call_output", "message", "message"]
    assert not rest.has_more
    # A plain string input is one user message; the earlier responses' items are not listed.
    chained = client(live).responses.create(
        model="tiny", previous_response_id=response.id, input="More", max_output_tokens=2
    )
    [only] = client(live).responses.input_items.list(chained.id).data
    assert (only.role, only.content[0].text) == ("user", "More")
    with pytest.raises(openai.NotFoundError):
        client(live, "customer").responses.input_items.list(response.id)
    headers = {"Authorization": f"Bearer {KEYS['full']}"}
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order")):
        url = f"{live.base_url}/responses/{response.id}/input_items?{query}"
        refused = httpx.get(url, headers=headers, timeout=30)
        assert refused.status_code == 422
        assert refused.json()["error"]["param"] == param
