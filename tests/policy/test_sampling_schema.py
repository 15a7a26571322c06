"""One sampling schema: every front door's sampling fields are the policy's (same bounds), each
one reaches the call, and a value out of bounds is refused alike everywhere."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
from pydantic import BaseModel, ValidationError

from specagent.call import Call
from specagent.calls import CallSpec
from specagent.policy.sampling import MAX_TOP_LOGPROBS, SamplingConfig
from specagent.server.wire import ChatCompletionRequest

# Each front door's name for the policy's field (the wire and LangChain say max_tokens).
FRONT_DOOR_NAMES = {"max_new_tokens": "max_tokens"}
NOT_AT_FRONT_DOORS = {"stop"}  # a list of strings there, merged with the model's own
MESSAGES = [{"role": "user", "content": "x"}]
SAMPLING = [name for name in SamplingConfig.model_fields if name not in NOT_AT_FRONT_DOORS]


def _chat_model() -> type[BaseModel]:
    from langchain_specagent import ChatSpecAgent

    return ChatSpecAgent


PROBES = [-(2**63) - 1, -1, 0, 1e-9, 0.5, 1, 2, 2.5, 5, 1_000_000, 1_000_001, 2**64]


def _accepts(build: Callable[..., object], name: str, value: object) -> bool:
    try:
        build(**{name: value})
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("front_door", ["wire", "langchain"])
def test_each_front_door_accepts_what_a_policy_accepts(front_door: str) -> None:
    """Each sampling field takes the same values at every front door as in a policy (probed
    at and past each bound), and defaults to None there: the policy's own value."""
    if front_door == "wire":
        model: type[BaseModel] = ChatCompletionRequest
        build = functools.partial(ChatCompletionRequest, model="m", messages=MESSAGES)
    else:
        model = _chat_model()
        build = functools.partial(model, target="m")
    for name in SAMPLING:
        theirs = FRONT_DOOR_NAMES.get(name, name)
        assert model.model_fields[theirs].default is None, name
        for value in PROBES:
            policy_takes = _accepts(SamplingConfig, name, value)
            assert _accepts(build, theirs, value) == policy_takes, (name, value)


def test_the_call_holds_every_sampling_field() -> None:
    fields = {f.name for f in dataclasses.fields(Call)}
    assert set(SamplingConfig.model_fields) <= fields


def test_a_temperature_out_of_bounds_is_refused_by_every_front_door() -> None:
    with pytest.raises(ValidationError, match="temperature"):
        SamplingConfig(temperature=2.5)
    with pytest.raises(ValidationError, match="temperature"):
        ChatCompletionRequest(model="m", messages=MESSAGES, temperature=3)
    with pytest.raises(ValidationError, match="temperature"):
        _chat_model()(target="m", temperature=2.5)
    with pytest.raises(ValidationError, match="top_k"):
        ChatCompletionRequest(model="m", messages=MESSAGES, top_k=-1)


def test_top_k_reaches_the_call_from_each_front_door() -> None:
    spec = CallSpec.build([{"role": "user", "content": "x"}], top_k=5)
    assert spec.call.top_k == 5
    request = ChatCompletionRequest(model="m", messages=MESSAGES, top_k=5)
    assert request.top_k == 5


@pytest.mark.parametrize("front_door", ["wire", "langchain"])
def test_top_logprobs_is_bounded_alike_at_each_front_door(front_door: str) -> None:
    """``top_logprobs`` (not a policy's: a call asks for log-probabilities or not) takes 0 to
    ``MAX_TOP_LOGPROBS`` at every front door, as admission does."""
    if front_door == "wire":
        build = functools.partial(
            ChatCompletionRequest, model="m", messages=MESSAGES, logprobs=True
        )
    else:
        build = functools.partial(_chat_model(), target="m", logprobs=True)
    for value in (-1, 0, 1, MAX_TOP_LOGPROBS, MAX_TOP_LOGPROBS + 1):
        assert _accepts(build, "top_logprobs", value) == (0 <= value <= MAX_TOP_LOGPROBS), value
