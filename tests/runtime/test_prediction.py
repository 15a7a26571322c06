"""Predicted outputs through the runtime (``generate(..., prediction=...)``): the prediction
drafts for every kind that drafts, a lossless call's output is the same with or without it,
usage counts its accepted and rejected tokens, it never reaches the history another call drafts
from, and a bad one is refused by name while the runtime keeps serving."""

from __future__ import annotations

import pytest

from policies import make_policy
from specagent import InvalidRequestError, SpecRuntime

POLICIES = [
    make_policy("auto", {"kind": "auto", "num_speculative_tokens": 16, "history": "tenant"}),
    make_policy("lookup", {"kind": "prompt_lookup", "num_speculative_tokens": 8}),
    make_policy("drafted", {"kind": "draft_model", "num_speculative_tokens": 4}),
    make_policy("plain"),
]
PROMPT = [{"role": "user", "content": "Return the list of items again, unchanged."}]


@pytest.fixture(scope="module")
def runtime(target, draft, tokenizer):
    rt = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=POLICIES, device="cpu"
    )
    yield rt
    rt.close()


@pytest.mark.parametrize("policy", ["auto", "lookup", "drafted"])
def test_a_prediction_drafts_and_the_output_stays_the_same(runtime, policy) -> None:
    options = {"policy": policy, "max_new_tokens": 40, "temperature": 0.0}
    alone = runtime.generate_sync(PROMPT, **options)
    right = runtime.generate_sync(PROMPT, prediction=alone.token_ids, **options)
    wrong = runtime.generate_sync(PROMPT, prediction=[5, 6, 7, 8] * 10, **options)
    as_text = runtime.generate_sync(PROMPT, prediction=alone.text, **options)
    assert right.token_ids == wrong.token_ids == as_text.token_ids == alone.token_ids
    accepted = right.usage.accepted_prediction_tokens
    assert accepted == right.stats.accepted_by_source["prediction"]
    assert accepted >= len(alone.token_ids) // 2
    assert right.usage.rejected_prediction_tokens == len(alone.token_ids) - accepted
    assert right.stats.num_drafts < alone.stats.num_drafts + len(alone.token_ids) // 2
    assert wrong.usage.accepted_prediction_tokens <= 2
    assert wrong.usage.rejected_prediction_tokens >= 38
    # Without a prediction, usage says nothing about one.
    assert alone.usage.accepted_prediction_tokens == alone.usage.rejected_prediction_tokens == 0


def test_plain_decoding_ignores_a_prediction(runtime) -> None:
    options = {"policy": "plain", "max_new_tokens": 12}
    alone = runtime.generate_sync(PROMPT, **options)
    given = runtime.generate_sync(PROMPT, prediction=alone.token_ids, **options)
    assert given.token_ids == alone.token_ids
    assert given.stats.num_drafts == 0
    assert given.usage.accepted_prediction_tokens == 0
    assert given.usage.rejected_prediction_tokens == len(alone.token_ids)


def test_a_prediction_never_reaches_the_history(runtime, tokenizer) -> None:
    """The prediction drafts its own call only: the tenant's history keeps prompt and output,
    so nothing of a prediction the output did not take can draft for a later call."""
    secret = "ZEBRA-PASSPHRASE-4471 " * 6
    runtime.generate_sync(
        PROMPT, policy="auto", tenant="acme", max_new_tokens=16, prediction=secret
    )
    marker = tokenizer("ZEBRA-PASSPHRASE", add_special_tokens=False)["input_ids"]
    history = runtime.history
    assert history is not None
    assert history.stats()["documents"] > 0
    for index in history._indexes.values():  # every document it keeps
        for doc in index.docs.values():
            text = ",".join(map(str, doc))
            assert ",".join(map(str, marker)) not in text


@pytest.mark.parametrize(
    ("prediction", "match"),
    [
        ({"type": "content"}, "must be text or token ids"),
        (12345, "must be text or token ids"),
        ([1, 2, 10**9], "outside the vocabulary"),
        ("x" * 10_000, "characters; at most 512 tokens fit"),
        ([1] * 600, "600 tokens; at most 512 fit"),
    ],
)
def test_a_bad_prediction_is_refused_by_name(runtime, prediction, match) -> None:
    with pytest.raises(InvalidRequestError, match=f"prediction: .*{match}"):
        runtime.generate_sync(PROMPT, policy="auto", prediction=prediction, max_new_tokens=4)
    assert runtime.generate_sync(PROMPT, max_new_tokens=3).usage.output_tokens > 0
