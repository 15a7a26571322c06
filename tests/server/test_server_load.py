"""Bounded load on a live localhost server: 64 concurrent streaming clients, each response
complete and equal to the same call alone (greedy); then the same with clients that hang up
at random; the server idle afterwards. Every loop here is bounded in count and time."""

from __future__ import annotations

import random
import time

import anyio
import httpx
import openai
import pytest
from live_server import KEYS, Live, key_file, live, sync_client  # fixtures by name

CLIENTS = 64
WORDS = ["order", "refund", "parcel", "invoice", "meeting", "summary", "code", "weather"]


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{WORDS[i % 8]} {i} {WORDS[(i * 3) % 8]}"}]


def budget(i: int) -> int:
    return 8 + i % 17


def alone(live: Live) -> list[str]:
    api = sync_client(live.base_url, KEYS["full"])
    return [
        api.chat.completions.create(
            model="tiny", messages=prompt(i), max_tokens=budget(i), temperature=0
        )
        .choices[0]
        .message.content
        for i in range(CLIENTS)
    ]


async def stream_all(live: Live, hang_up: set[int]) -> dict[int, str | None]:
    """Every client streams at once; those in ``hang_up`` close their stream after the first
    content chunk. Returns each finished client's text (None for those that hung up)."""
    api = openai.AsyncOpenAI(
        base_url=live.base_url,
        api_key=KEYS["full"],
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=CLIENTS + 8), timeout=60
        ),
    )
    texts: dict[int, str | None] = {}

    async def one(i: int) -> None:
        stream = await api.chat.completions.create(
            model="tiny",
            messages=prompt(i),
            max_tokens=budget(i),
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        finished = False
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finished = finished or chunk.choices[0].finish_reason is not None
            if i in hang_up and any(parts):
                await stream.close()
                texts[i] = None
                return
        assert finished, f"client {i}: the stream ended without a finish reason"
        assert chunk.usage is not None  # the usage chunk came last
        texts[i] = "".join(parts)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            for i in range(CLIENTS):
                group.start_soon(one, i)
    await api.close()
    return texts


def wait_idle(live: Live) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        activity = live.runtime.activity()
        if not activity["running"] and not activity["queued"]:
            break
        time.sleep(0.05)
    assert live.runtime.activity()["running"] == 0
    assert live.runtime.activity()["queued"] == 0
    assert live.app.state.limits.in_flight("full") == 0


# A client that hangs up leaves the openai client's own SSE iterator (an httpx async generator)
# for the garbage collector; that is the client library's, not the server's.
@pytest.mark.slow  # 64 streams, then each alone
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_64_concurrent_streams_equal_each_call_alone_then_random_hang_ups(live: Live) -> None:
    expected = alone(live)
    texts = anyio.run(stream_all, live, set())
    assert len(texts) == CLIENTS
    mismatched = [i for i in range(CLIENTS) if texts[i] != expected[i]]
    assert not mismatched, f"{len(mismatched)} responses differ from the call alone"
    wait_idle(live)

    hang_up = set(random.Random(7).sample(range(CLIENTS), CLIENTS // 3))
    texts = anyio.run(stream_all, live, hang_up)
    for i in range(CLIENTS):
        if i in hang_up:
            assert texts[i] is None
        else:
            assert texts[i] == expected[i], f"client {i} differs after others hung up"
    wait_idle(live)
    # and the server still answers as before
    assert alone(live)[:4] == expected[:4]
