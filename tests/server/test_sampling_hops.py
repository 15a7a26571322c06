"""How far a sampling field travels: a request's ``temperature`` reaches the sampler through at
most ``MAX_HOPS`` holders from either front door. A holder is a type whose instances carry the
value as a ``temperature`` attribute (the wire's request, ``Call``, ``SamplingParams``) or a
function parameter it is passed in by name; each is a place where the field is declared again,
so a newcomer who changes its meaning has that many places to change. Measured by profiling
every call of the package while one request runs (threads included), so a new hop added
anywhere on the way is counted."""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import make_model
from live_server import KEYS, key_file, serving, sync_client  # fixtures by name

from specagent import RuntimeOptions, SpecRuntime, shipped_policies
from specagent.server import KeyStore, create_app

MAX_HOPS = 8
MARK = 0.4375
"""An exactly representable temperature no default or bound equals."""
PACKAGES = ("/specagent/", "/langchain_specagent/")


class Hops:
    """The holders ``MARK`` was seen in, in the order first seen."""

    def __init__(self) -> None:
        self.seen: dict[str, None] = {}
        self.sampled = False

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.endswith(".py"):
            return
        if not any(part in frame.f_code.co_filename for part in PACKAGES):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        for name in names:
            value = frame.f_locals.get(name)
            if type(value) is float and value == MARK and name == "temperature":
                self.seen.setdefault(f"{code.co_qualname}({name}=)")
            elif _carries(value):
                self.seen.setdefault(type(value).__qualname__)
                self.sampled |= code.co_name == "logits_to_probs"  # the sampler reads it

    @property
    def count(self) -> int:
        return len(self.seen)


def _carries(value: Any) -> bool:
    if value is None or isinstance(value, int | float | str | bytes | dict | list | tuple):
        return False
    try:
        return type(getattr(value, "temperature", None)) is float and value.temperature == MARK
    except Exception:
        return False


@contextlib.contextmanager
def _profiled() -> Iterator[Hops]:
    hops = Hops()
    sys.setprofile(hops.profile)
    threading.setprofile(hops.profile)
    try:
        yield hops
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)


@pytest.fixture
def runtime(tokenizer) -> Iterator[SpecRuntime]:
    rt = SpecRuntime(
        make_model(len(tokenizer), seed=3),
        tokenizer=tokenizer,
        policies=shipped_policies(),
        model_name="tiny",
        options=RuntimeOptions(probe_store=None),
    )
    yield rt
    rt.close()


MESSAGES = [{"role": "user", "content": "Summarise the meeting."}]


def test_a_served_temperature_reaches_the_sampler_in_few_hops(runtime, key_file) -> None:
    with _profiled() as hops:
        app = create_app(runtime, KeyStore.load(key_file, env=""))
        with serving(app) as url:
            client = sync_client(f"{url}/v1", KEYS["full"])
            client.chat.completions.create(
                model="tiny:customer-reply", messages=MESSAGES, max_tokens=2, temperature=MARK
            )
    assert hops.sampled, list(hops.seen)
    assert hops.count <= MAX_HOPS, list(hops.seen)


def test_a_langchain_temperature_reaches_the_sampler_in_few_hops(runtime) -> None:
    from langchain_specagent import ChatSpecAgent

    with _profiled() as hops:
        chat = ChatSpecAgent(runtime=runtime, policy="customer-reply", max_tokens=2)
        chat.invoke(MESSAGES[0]["content"], temperature=MARK)
    assert hops.sampled, list(hops.seen)
    assert hops.count <= MAX_HOPS, list(hops.seen)
