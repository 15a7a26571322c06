"""Log-probabilities through the front doors, as their clients read them: the ``openai``
client's ``choices[].logprobs`` (whole and streamed, parsed by its own types) and
``ChatSpecAgent``'s ``response_metadata["logprobs"]`` (as ``ChatOpenAI`` gives them), each the
runtime's own numbers for the same call."""

from __future__ import annotations

import pytest
from live_server import KEYS, Live, key_file, live, sync_client  # fixtures by name

MESSAGES = [{"role": "user", "content": "Summarise the meeting."}]
ASK = {"model": "tiny:customer-reply", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}


def _entries(logprobs) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in logprobs]


def _same(ours: list, theirs: list) -> None:
    """The same tokens with the same log-probabilities, within float32 rounding (a call whose
    prompt comes from the prefix cache computes it in other shapes)."""
    assert [(t, [a for a, _ in top]) for t, _, top in ours] == [
        (t, [a for a, _ in top]) for t, _, top in theirs
    ]
    flat = [v for _, v, top in ours for v in (v, *(b for _, b in top))]
    other = [v for _, v, top in theirs for v in (v, *(b for _, b in top))]
    assert flat == pytest.approx(other, abs=1e-4)


def test_served_logprobs_are_the_runtimes_whole_and_streamed(live: Live) -> None:
    api = sync_client(live.base_url, KEYS["full"])
    reply = api.chat.completions.create(**ASK, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    own = live.runtime.generate_sync(
        MESSAGES, policy="customer-reply", max_new_tokens=12, temperature=0.0, logprobs=2
    )
    assert own.logprobs is not None
    expected = [(e.text, e.logprob, [(t.text, t.logprob) for t in e.top]) for e in own.logprobs]
    _same(_entries(content), expected)
    # Each token's own bytes: joined, the answer's UTF-8 (a piece of a character included).
    assert [e.bytes for e in content] == [e.as_openai()["bytes"] for e in own.logprobs]
    joined = bytes(b for e in content for b in e.bytes)
    assert joined.decode("utf-8", errors="replace") == reply.choices[0].message.content

    chunks = list(api.chat.completions.create(**ASK, logprobs=True, top_logprobs=2, stream=True))
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or ()
    ]
    _same(_entries(streamed), expected)

    plain = api.chat.completions.create(**ASK)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == reply.choices[0].message.content


def test_logprobs_without_alternatives(live: Live) -> None:
    api = sync_client(live.base_url, KEYS["full"])
    reply = api.chat.completions.create(**ASK, logprobs=True)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(e.top_logprobs == [] and e.logprob <= 0.0 for e in content)


def test_chat_spec_agent_reports_logprobs_as_chat_openai_does(live: Live) -> None:
    from langchain_specagent import ChatSpecAgent

    chat = ChatSpecAgent(
        runtime=live.runtime, policy="customer-reply", max_tokens=12, temperature=0.0
    )
    message = chat.invoke(MESSAGES[0]["content"], logprobs=True, top_logprobs=2)
    content = message.response_metadata["logprobs"]["content"]
    assert len(content) == message.usage_metadata["output_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    merged = None
    for chunk in chat.model_copy(update={"logprobs": True, "top_logprobs": 2}).stream(
        MESSAGES[0]["content"]
    ):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None
    streamed = merged.response_metadata["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in content], abs=1e-4
    )
    assert "logprobs" not in chat.invoke(MESSAGES[0]["content"]).response_metadata
    with pytest.raises(ValueError, match="top_logprobs needs logprobs=True"):
        chat.invoke(MESSAGES[0]["content"], top_logprobs=2)
