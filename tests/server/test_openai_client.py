"""The server against the official ``openai`` client, on a live localhost server: chat, stream,
tools, structured output, every error status, models, readiness, metrics, disconnects."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from live_server import KEYS, Live, key_file, live, spelled_reply, sync_client  # fixtures by name

MESSAGES = [{"role": "user", "content": "Hello world"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
FORECAST = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
}


def client(live: Live, key: str = "full") -> openai.OpenAI:
    return sync_client(live.base_url, KEYS[key])


def test_chat_completion_equals_the_runtime_alone_and_reports_speculation(live: Live) -> None:
    reply = client(live).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, seed=1
    )
    alone = live.runtime.generate_sync(
        MESSAGES, max_new_tokens=12, temperature=0, seed=1, tenant="other"
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == alone.text
    assert choice.finish_reason == alone.finish_reason
    assert reply.usage.prompt_tokens == alone.usage.input_tokens
    assert reply.usage.completion_tokens == alone.usage.output_tokens
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    stats = reply.model_extra["speculative_decoding_stats"]
    assert stats["policy"] == "default"
    assert stats["mode"] == "lossless"
    for field in (
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "mean_acceptance_length",
    ):
        assert field in stats
    assert stats["divergence"] is None


def test_stream_with_usage_gives_the_same_text(live: Live) -> None:
    options = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    whole = client(live).chat.completions.create(**options).choices[0].message.content
    chunks = list(
        client(live).chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    assert chunks[-1].choices == []  # the usage-only chunk closes the stream
    assert chunks[-1].usage.completion_tokens > 0
    assert "speculative_decoding_stats" in finishing[0].model_extra


def test_policy_by_metadata_header_and_model_name(live: Live) -> None:
    api = client(live)
    base = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    by_metadata = api.chat.completions.create(
        model="tiny", metadata={"specagent_policy": "internal-summary"}, **base
    )
    by_header = api.chat.completions.create(
        model="tiny", extra_headers={"X-Specagent-Policy": "internal-summary"}, **base
    )
    by_name = api.chat.completions.create(model="tiny:internal-summary", **base)
    by_tags = api.chat.completions.create(
        model="tiny", metadata={"specagent_tags": "summary,internal"}, **base
    )
    for reply in (by_metadata, by_header, by_name, by_tags):
        stats = reply.model_extra["speculative_decoding_stats"]
        assert stats["policy"] == "internal-summary"
        assert stats["mode"] == "relaxed"
        assert stats["divergence"] is not None  # a relaxed call reports what it cost


def test_tool_calls_required_and_named(live: Live) -> None:
    api = client(live)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=80,
            temperature=1.0,
            seed=3,
        )
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        assert message.tool_calls[0].function.name == "get_weather"
        arguments = json.loads(message.tool_calls[0].function.arguments)
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        # the call and its result go back in, as an agent would send them
        follow = api.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": "Weather in Oslo?"},
                message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "rain"},
            ],
            max_tokens=6,
        )
        assert follow.choices[0].message.content


def test_streamed_tool_call(live: Live) -> None:
    chunks = list(
        client(live).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    json.loads(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_structured_output_json_schema_and_json_object(live: Live) -> None:
    api = client(live)
    reply = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True},
        },
        max_tokens=120,
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), FORECAST)
    as_object = api.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=200
    )
    if as_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(as_object.choices[0].message.content), dict)
    # cut by the budget: the partial output with finish_reason "length", as OpenAI answers
    cut = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"schema": FORECAST}},
        max_tokens=2,
    )
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 2


def test_keys_fail_closed(live: Live) -> None:
    anonymous = sync_client(live.base_url, "wrong-key")
    with pytest.raises(openai.AuthenticationError) as bad:
        anonymous.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert bad.value.status_code == 401
    assert bad.value.body["code"] == "invalid_api_key"
    missing = httpx.post(f"{live.base_url}/chat/completions", json={"model": "tiny"})
    assert missing.status_code == 401
    assert "missing API key" in missing.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


def test_a_key_may_use_only_its_policies(live: Live) -> None:
    customer = client(live, "customer")
    ok = customer.chat.completions.create(
        model="tiny:customer-reply", messages=MESSAGES, max_tokens=2
    )
    assert ok.model_extra["speculative_decoding_stats"]["policy"] == "customer-reply"
    for relaxed in (
        {"model": "tiny:internal-summary"},
        {"model": "tiny", "metadata": {"specagent_tags": "summary,internal"}},
    ):
        # The answer for a policy it may not use is the answer for one that does not exist:
        # a restricted key learns no policy names beyond its own.
        with pytest.raises(openai.NotFoundError) as denied:
            customer.chat.completions.create(messages=MESSAGES, max_tokens=2, **relaxed)
        assert "is available to this key; it may use: ['customer-reply', 'default']" in (
            denied.value.message
        )
        with pytest.raises(openai.NotFoundError) as unknown:
            customer.chat.completions.create(
                model="tiny:no-such-policy", messages=MESSAGES, max_tokens=2
            )
        assert unknown.value.status_code == denied.value.status_code
        assert unknown.value.body.keys() == denied.value.body.keys()
    listed = {m.id for m in customer.models.list()}
    assert listed == {"tiny", "tiny:customer-reply", "tiny:default"}
    everything = {m.id for m in client(live).models.list()}
    assert {"tiny:legal-drafting", "tiny:internal-summary"} <= everything


def test_unknown_policy_and_model_are_404(live: Live) -> None:
    api = client(live)
    with pytest.raises(openai.NotFoundError) as unknown:
        api.chat.completions.create(model="tiny:no-such-policy", messages=MESSAGES, max_tokens=2)
    assert "customer-reply" in unknown.value.message  # the known policies are listed
    with pytest.raises(openai.NotFoundError) as restricted:
        client(live, "customer").chat.completions.create(
            model="tiny:no-such-policy", messages=MESSAGES, max_tokens=2
        )
    assert "customer-reply" in restricted.value.message  # the key's own policies only
    assert "internal-summary" not in restricted.value.message
    with pytest.raises(openai.NotFoundError) as model:
        api.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert model.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tool_choice": "get_time"}, None),
        ({"response_format": {"type": "yaml"}}, None),
        # Log-probabilities: at most 20 alternatives, and only with logprobs asked for.
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        # Malformed shapes, each once a 500 with a traceback.
        ({"tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools",
        ),
        ({"stop": [f"stop{i}" for i in range(17)]}, None),
        ({"stop": ["y" * 257]}, None),
        # OpenAI's fields this server cannot honour: refused by name, never ignored.
        ({"logit_bias": {"50": 100}}, "logit_bias"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        # Predicted outputs of a shape OpenAI does not define, or longer than any answer.
        ({"prediction": {"type": "text", "content": "x"}}, "prediction"),
        ({"prediction": {"type": "content", "content": 5}}, "prediction"),
        ({"prediction": {"type": "content", "content": [{"type": "image"}]}}, "prediction"),
        ({"prediction": "just text"}, "prediction"),
        ({"prediction": {"type": "content", "content": "x" * 70_000}}, "prediction"),
        # The sub-tenant names the call in audit rows, spans and logs: printable only.
        ({"user": "\u0000"}, "user"),
        ({"user": "a\u001b[31mb"}, "user"),
    ],
)
def test_bad_fields_are_422_naming_the_field(live: Live, fields: dict, param: str | None) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **fields}
    with pytest.raises(openai.UnprocessableEntityError) as bad:
        client(live).chat.completions.create(**body)
    error = bad.value.body
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"].startswith(param), error
    else:
        words = ("tool_choice", "response_format", "seed", "stop")
        assert any(word in error["message"] for word in words), error


def test_a_seed_out_of_range_is_422_not_500(live: Live) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "seed": 2**70}
    response = httpx.post(
        f"{live.base_url}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEYS['full']}"},
    )
    assert response.status_code == 422, response.text
    assert "seed" in response.json()["error"]["message"]


def test_body_too_large_is_413(live: Live) -> None:
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    response = httpx.post(
        f"{live.base_url}/chat/completions",
        json=huge,
        headers={"Authorization": f"Bearer {KEYS['full']}"},
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"


def test_rate_limit_is_429_with_retry_after(live: Live) -> None:
    limited = client(live, "limited")
    for _ in range(2):
        limited.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as refused:
        limited.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert int(refused.value.response.headers["Retry-After"]) >= 1
    assert "2 requests per minute" in refused.value.message
    client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)


def test_draining_is_503_and_not_ready(live: Live) -> None:
    served = live.app.state.served
    served.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as refused:
            client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
        assert refused.value.status_code == 503
        assert httpx.get(f"{live.url}/ready").status_code == 503
    finally:
        served.draining = False
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    live.runtime.wait_measured(60)
    ready = httpx.get(f"{live.url}/ready")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "draining": False}  # no queue figures without a key
    full = httpx.get(f"{live.url}/ready", headers={"Authorization": f"Bearer {KEYS['full']}"})
    assert full.json()["measured"] is True


def test_metrics_are_prometheus_text_of_the_runtime_instruments(live: Live) -> None:
    client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    text = httpx.get(f"{live.url}/metrics", headers=_bearer("full")).text
    assert "# TYPE gen_ai_client_operation_duration" in text
    assert 'specagent_policy="default"' in text


def test_metrics_need_a_key_that_may_use_every_policy(live: Live) -> None:
    """The metrics name the model and every policy: no key gets 401, a key limited to some
    policies 403 (``--metrics-public`` opens them for a private scraper)."""
    assert httpx.get(f"{live.url}/metrics").status_code == 401
    denied = httpx.get(f"{live.url}/metrics", headers=_bearer("customer"))
    assert denied.status_code == 403
    assert "policy" not in denied.text.replace("every policy", "")


def _bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def test_max_tokens_over_the_key_cap_is_422(live: Live) -> None:
    """The server caps what a call may ask for (4096 by default); a key may set its own."""
    body = {"model": "tiny", "messages": MESSAGES}
    over = httpx.post(
        f"{live.base_url}/chat/completions",
        json={**body, "max_tokens": 9},
        headers=_bearer("capped"),
    )
    assert over.status_code == 422
    assert over.json()["error"]["param"] == "max_tokens"
    fits = httpx.post(
        f"{live.base_url}/chat/completions",
        json={**body, "max_tokens": 8},
        headers=_bearer("capped"),
    )
    assert fits.status_code == 200
    huge = httpx.post(
        f"{live.base_url}/chat/completions",
        json={**body, "max_tokens": 100_000},
        headers=_bearer("full"),
    )
    assert huge.status_code == 422


def test_a_call_that_asks_for_no_budget_stays_within_the_key_cap(live: Live) -> None:
    """Leaving max_tokens out runs the policy's default (256) cut to the key's cap (8)."""
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 1.0}
    for seed in range(4):
        answer = httpx.post(
            f"{live.base_url}/chat/completions",
            json={**body, "seed": seed},
            headers=_bearer("capped"),
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] <= 8
    # ... and without the cap the same call runs past it (the test can tell).
    longest = max(
        httpx.post(
            f"{live.base_url}/chat/completions",
            json={**body, "seed": seed},
            headers=_bearer("full"),
        ).json()["usage"]["completion_tokens"]
        for seed in range(4)
    )
    assert longest > 8


def test_a_body_that_is_not_json_is_415(live: Live) -> None:
    """A web page may POST text/plain anywhere without a preflight; never application/json."""
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
    refused = httpx.post(
        f"{live.base_url}/chat/completions",
        content=body,
        headers={**_bearer("full"), "Content-Type": "text/plain"},
    )
    assert refused.status_code == 415
    assert refused.json()["error"]["code"] == "unsupported_media_type"


def test_a_key_holds_at_most_its_share_of_reproducible_calls(live: Live) -> None:
    """Each reproducible call runs alone (and on llama.cpp in a context of its own): a key
    past its bound of them in flight gets 429, and its ordinary calls still run."""
    import concurrent.futures

    body = {"model": "tiny:legal-drafting", "messages": MESSAGES, "max_tokens": 300}

    def post(extra: dict) -> int:
        return httpx.post(
            f"{live.base_url}/chat/completions",
            json={**body, **extra},
            headers=_bearer("full"),
            timeout=120,
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(post, [{}] * 6))
    assert statuses.count(429) >= 1, statuses
    assert statuses.count(200) >= 2, statuses
    assert post({"model": "tiny", "max_tokens": 2}) == 200


def test_a_call_past_its_deadline_is_504_and_leaves_nothing_running(live: Live) -> None:
    saved = live.runtime.eos_token_ids
    live.runtime.eos_token_ids = []  # nothing ends the call but its deadline (the key's 0.5 s)
    try:
        started = time.monotonic()
        response = httpx.post(
            f"{live.base_url}/chat/completions",
            json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4000},
            headers=_bearer("hasty"),
            timeout=30,
        )
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "deadline_exceeded"
        assert time.monotonic() - started < 5
        _until_nothing_runs(live)
        assert live.app.state.limits.in_flight("hasty") == 0
    finally:
        live.runtime.eos_token_ids = saved


def _until_nothing_runs(live: Live) -> None:
    deadline = time.monotonic() + 10
    while live.runtime.activity()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.runtime.activity()["running"] == 0


def test_a_non_streaming_call_stops_when_its_client_goes_away(live: Live) -> None:
    """A client that gives up on a non-streaming call (its own timeout) leaves no work
    behind: the call is cancelled in the runtime and the key's slot given back."""
    saved = live.runtime.eos_token_ids
    live.runtime.eos_token_ids = []
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{live.base_url}/chat/completions",
                json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4000},
                headers=_bearer("full"),
                timeout=0.5,
            )
        _until_nothing_runs(live)
        assert live.app.state.limits.in_flight("full") == 0
    finally:
        live.runtime.eos_token_ids = saved


def test_a_client_that_disconnects_cancels_its_call(live: Live) -> None:
    """The call is cut short in the runtime (its span ends unfinished, far below its budget)
    and its key's slot is given back: no work continues for a client that left."""
    saved = live.runtime.eos_token_ids
    live.runtime.eos_token_ids = []  # nothing ends the call early but the client
    live.spans.clear()
    try:
        with httpx.stream(
            "POST",
            f"{live.base_url}/chat/completions",
            json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4000, "stream": True},
            headers={"Authorization": f"Bearer {KEYS['full']}"},
        ) as response:
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines, strict=False) if line]
        assert len(received) >= 3
        deadline = time.monotonic() + 10
        while live.runtime.activity()["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live.runtime.activity()["running"] == 0
        spans = [s for s in live.spans.get_finished_spans() if s.name.startswith("chat")]
        assert spans, "the call's span was not ended"
        assert spans[-1].attributes.get("error.type") is not None  # ended unfinished
        assert live.app.state.limits.in_flight("full") == 0
    finally:
        live.runtime.eos_token_ids = saved


def test_a_failing_call_answers_500_without_internal_text(live: Live) -> None:
    """The exception's text (here a path) stays in the server's log, under an id the error
    body gives; streamed or not. (Planted by wrapping the engine's decode: no public hook
    makes a call fail inside.)"""
    engine = live.runtime._decoder
    real = engine.decode

    def decode(request, device):
        raise RuntimeError("cannot open /srv/secret/weights.bin")

    engine.decode = decode
    try:
        with pytest.raises(openai.InternalServerError) as failed:
            client(live).with_options(max_retries=0).chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=4
            )
        message = failed.value.body["message"]
        assert "error id" in message
        assert "secret" not in message
        assert "RuntimeError" not in message
    finally:
        engine.decode = real


def test_predicted_outputs_draft_and_leave_the_answer_as_it_is(live: Live) -> None:
    """OpenAI's ``prediction``: the answer is the same with it (lossless), and usage reports
    how many of its tokens were accepted and rejected, as OpenAI's does."""
    options = {
        "model": "tiny",
        "messages": [{"role": "user", "content": spelled_reply(live, 24)}],
        "max_tokens": 24,
        "temperature": 0,
        "metadata": {"specagent_policy": "legal-drafting"},
    }
    alone = client(live).chat.completions.create(**options)
    text = alone.choices[0].message.content
    predicted = client(live).chat.completions.create(
        **options, prediction={"type": "content", "content": text}
    )
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details is not None
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    stats = predicted.model_extra["speculative_decoding_stats"]
    assert stats["accepted_by_source"]["prediction"] == details.accepted_prediction_tokens
    # Parts, as the client also sends them; and a wrong prediction changes nothing either.
    parts = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]
    wrong = "lorem ipsum " * 20
    for prediction in (
        {"type": "content", "content": parts},
        {"type": "content", "content": wrong},
    ):
        again = client(live).chat.completions.create(**options, prediction=prediction)
        assert again.choices[0].message.content == text
    streamed = client(live).chat.completions.create(
        **options,
        prediction={"type": "content", "content": text},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
