"""Each emitted token's log-probability, as a call asks for it (``logprobs=``), is read from the
verification forward that accepted the token: no extra forward, and the same numbers a plain
forward over the prompt and the output gives (its log-softmax at each position), whether the
token came from a plain step, a drafted chain, a token tree, a sampled or a relaxed call."""

from __future__ import annotations

import pytest
import torch
from conftest import PinnedCosts

from policies import make_policy
from specagent import GenerationResult, InvalidRequestError, RuntimeOptions, SpecRuntime

PLAIN = make_policy("plain")
DRAFTED = make_policy("drafted", {"kind": "draft_model", "num_speculative_tokens": 4})
TREES = make_policy(
    "trees", {"kind": "auto", "num_speculative_tokens": 8, "history": "tenant", "tree": True}
)
RELAXED = make_policy(
    "relaxed",
    {"kind": "draft_model", "num_speculative_tokens": 4},
    mode="relaxed",
    acceptance={"rule": "typical", "epsilon": 0.3, "delta": 0.09},
)
PROMPTS = [
    [{"role": "user", "content": "Summarise the meeting notes for the team."}],
    [{"role": "user", "content": "Look up order A-10234 and reply."}],
]
TOP = 3


@pytest.fixture(scope="module")
def runtime(target, draft, tokenizer):
    rt = SpecRuntime(
        target,
        draft,
        tokenizer,
        [PLAIN, DRAFTED, TREES, RELAXED],
        "cpu",
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    rt.wait_measured(timeout=120)
    yield rt
    rt.close()


def _plain_logprobs(target, result: GenerationResult) -> torch.Tensor:
    """Log-softmax of one plain forward over the prompt and the output, at each output token's
    position ``[n, V]``."""
    ids = result.prompt_token_ids + result.token_ids
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids])).logits[0].float()
    start = len(result.prompt_token_ids) - 1
    return torch.log_softmax(logits[start : start + len(result.token_ids)], dim=-1)


def _check(target, tokenizer, result: GenerationResult, top: int = TOP) -> None:
    assert result.logprobs is not None
    assert [each.token_id for each in result.logprobs] == result.token_ids
    reference = _plain_logprobs(target, result)
    for row, each in zip(reference, result.logprobs, strict=True):
        assert each.logprob == pytest.approx(float(row[each.token_id]), abs=1e-4)
        assert len(each.top) == top
        best = row.topk(top).values.tolist()
        assert [t.logprob for t in each.top] == pytest.approx(best, abs=1e-4)
        for alternative in each.top:
            assert alternative.logprob == pytest.approx(float(row[alternative.token_id]), abs=1e-4)
            assert not alternative.top
        assert each.text == tokenizer.decode([each.token_id], skip_special_tokens=True)


@pytest.mark.parametrize("policy", ["plain", "drafted", "relaxed"])
def test_greedy_logprobs_are_a_plain_forwards(runtime, target, tokenizer, policy: str) -> None:
    for messages in PROMPTS:
        result = runtime.generate_sync(messages, policy=policy, max_new_tokens=24, logprobs=TOP)
        _check(target, tokenizer, result)
        if policy != "plain":
            assert result.stats.num_accepted_tokens > 0  # drafted tokens among them


def test_sampled_and_tree_logprobs_are_a_plain_forwards(runtime, target, tokenizer) -> None:
    """Sampled calls (temperature 1: the log-probabilities stay the target's own, before
    temperature) seed the tenant's history; greedy calls then verify token trees."""
    for messages in PROMPTS:
        for seed in range(3):
            result = runtime.generate_sync(
                messages,
                policy="trees",
                tenant="acme",
                max_new_tokens=24,
                temperature=1.0,
                seed=seed,
                logprobs=0,
            )
            _check(target, tokenizer, result, top=0)
    trees = [
        runtime.generate_sync(m, policy="trees", tenant="acme", max_new_tokens=24, logprobs=TOP)
        for m in PROMPTS
    ]
    assert sum(r.stats.num_tree_steps for r in trees) > 0
    for result in trees:
        _check(target, tokenizer, result)


def test_streamed_logprobs_are_the_results_and_a_stop_cuts_them(runtime) -> None:
    whole = runtime.generate_sync(PROMPTS[0], policy="drafted", max_new_tokens=24, logprobs=1)
    chunks = list(runtime.stream_sync(PROMPTS[0], policy="drafted", max_new_tokens=24, logprobs=1))
    streamed = [each for chunk in chunks for each in chunk.logprobs or ()]
    assert streamed == whole.logprobs
    assert all(chunk.logprobs is not None for chunk in chunks if chunk.token_ids)
    at = next(i for i in range(len(whole.text) // 2, len(whole.text)) if whole.text[i].isalnum())
    stop = whole.text[at : at + 2]
    cut = runtime.generate_sync(
        PROMPTS[0], policy="drafted", max_new_tokens=24, logprobs=1, stop=[stop]
    )
    assert cut.finish_reason == "stop"
    assert len(cut.token_ids) < len(whole.token_ids)
    assert cut.logprobs == whole.logprobs[: len(cut.token_ids)]


def test_a_call_without_logprobs_gets_none_and_a_bad_count_is_refused(runtime) -> None:
    plain = runtime.generate_sync(PROMPTS[0], policy="plain", max_new_tokens=4)
    assert plain.logprobs is None
    for bad in (-1, 21):
        with pytest.raises(InvalidRequestError, match="logprobs must be between 0 and 20"):
            runtime.generate_sync(PROMPTS[0], policy="plain", max_new_tokens=4, logprobs=bad)
    # The runtime is unharmed: the next call runs.
    assert runtime.generate_sync(PROMPTS[0], policy="plain", max_new_tokens=4).token_ids


def test_each_tokens_text_is_decoded_once_per_call(runtime, monkeypatch) -> None:
    """Twenty alternatives per token repeat from step to step: the assembler, on the caller's
    event loop, decodes each distinct token once, not 21 strings per emitted token."""
    decoded: list[list[int]] = []
    real = runtime._calls.decode_text

    def counted(ids):
        decoded.append(list(ids))
        return real(ids)

    monkeypatch.setattr(runtime._calls, "decode_text", counted)
    result = runtime.generate_sync(PROMPTS[0], policy="drafted", max_new_tokens=24, logprobs=20)
    assert result.logprobs is not None
    singles = [ids[0] for ids in decoded if len(ids) == 1]
    seen = {each.token_id for each in result.logprobs} | {
        t.token_id for each in result.logprobs for t in each.top
    }
    assert set(singles) == seen
    # Decoded once each (a one-token output is decoded whole once more, at the end).
    assert len(singles) - len(seen) == (1 if len(result.token_ids) == 1 else 0)


def test_each_tokens_bytes_spell_the_output_where_its_text_cannot(runtime, tokenizer) -> None:
    """A token that is part of a character decodes alone to U+FFFD; its bytes (OpenAI's
    ``bytes``) are its own, so the output's tokens' bytes joined are the output's UTF-8."""
    result = runtime.generate_sync(
        PROMPTS[0], policy="plain", max_new_tokens=48, temperature=0.0, logprobs=2
    )
    assert result.logprobs is not None
    raw = b"".join(bytes(each.as_openai()["bytes"]) for each in result.logprobs)
    assert raw.decode("utf-8", errors="replace") == result.text
    partial = [each for each in result.logprobs if each.text == "\ufffd"]
    assert partial, "the tiny model's output has no piece of a character to check"
    assert all(each.raw is not None and each.raw != "\ufffd".encode() for each in partial)
    for each in result.logprobs:  # each alternative's bytes decode to its text
        for alternative in each.top:
            assert alternative.raw is not None
            assert alternative.raw.decode("utf-8", errors="replace") == tokenizer.decode(
                [alternative.token_id]
            )
