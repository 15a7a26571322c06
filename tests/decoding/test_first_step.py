"""A call's first step feeds the rest of its prompt, its last token and the first drafts in one
target forward (the prefill and the first verification together), and a draft model's first
forward feeds the prompt with its first guesses the same way; the prompt's KV is still kept
for later calls, and a batch never pads the calls' few-token forwards to a prompt's width."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import hf_greedy, make_model
from test_greedy_and_cache import run

from specagent.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specagent.engines.transformers import ALONE_ROWS, ModelRunner
from specagent.runtime.memory import PrefixCache


def fed_rows(runner: ModelRunner) -> list[int]:
    """Record how many tokens each of ``runner``'s forwards feeds (this runner only)."""
    rows: list[int] = []
    forward = runner.forward

    def counted(input_ids: list[int], cache: Any, *rest: Any, **extra: Any) -> Any:
        rows.append(len(input_ids))
        return forward(input_ids, cache, *rest, **extra)

    runner.forward = counted  # type: ignore[method-assign]
    return rows


def repeating_prompt(vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(5)
    block = torch.randint(3, vocab, (12,), generator=generator).tolist()
    return [*block, *block, *block[:6]]  # prompt lookup finds drafts at the first step


def test_the_first_forward_feeds_the_prompt_with_the_first_drafts(target) -> None:
    ids = repeating_prompt(target.config.vocab_size)
    runner = ModelRunner(target)
    rows = fed_rows(runner)
    last = run(runner, ids, PromptLookupDrafter(), 4, n=24)
    assert last.output_ids == hf_greedy(target, ids, 24)
    assert len(ids) < rows[0] <= len(ids) + 4  # the whole prompt, then the first drafts
    # No forward of its own for the prompt: one target forward per decoding step.
    assert len(rows) == last.counters.target_forwards
    assert all(n <= 5 for n in rows[1:])


def test_a_plain_call_pays_one_forward_per_token(target) -> None:
    """Without drafts, the first token comes from the forward over the prompt itself."""
    ids = repeating_prompt(target.config.vocab_size)
    runner = ModelRunner(target)
    rows = fed_rows(runner)
    last = run(runner, ids, None, 0, n=6)
    assert last.output_ids == hf_greedy(target, ids, 6)
    assert rows == [len(ids), 1, 1, 1, 1, 1]


def test_a_draft_models_first_forward_feeds_the_prompt(target, draft) -> None:
    ids = repeating_prompt(target.config.vocab_size)
    draft_runner = ModelRunner(draft)
    rows = fed_rows(draft_runner)
    drafter = DraftModelDrafter(draft_runner, PrefixCache(min_tokens=4))
    last = run(ModelRunner(target), ids, drafter, 3, n=20)
    assert last.output_ids == hf_greedy(target, ids, 20)
    assert rows[0] == len(ids)  # prompt and last token in one forward; its row drafts
    assert len(rows) == drafter.draft_forwards


def test_the_prompt_fed_with_the_first_step_is_kept_for_the_next_call(target) -> None:
    ids = repeating_prompt(target.config.vocab_size)
    prefixes = PrefixCache(min_tokens=4)
    runner = ModelRunner(target)
    rows = fed_rows(runner)

    def call(prompt: list[int]) -> Any:
        return run(runner, prompt, PromptLookupDrafter(), 3, n=8, prefixes=prefixes)

    first = call(ids)
    assert first.counters.cached_prompt_tokens == 0
    rows.clear()
    # The same prompt with another last message: everything the first call fed is reused.
    again = call([*ids[:-1], ids[0]])
    assert again.counters.cached_prompt_tokens == len(ids) - 1
    assert rows[0] <= 4  # the last token and the drafts only
    assert again.output_ids == hf_greedy(target, [*ids[:-1], ids[0]], 8)


def test_a_stored_prompt_is_exactly_the_prompts_kv(target) -> None:
    runner = ModelRunner(target)
    prefixes = PrefixCache(min_tokens=4)
    prompt = list(range(5, 45))
    cache = runner.new_cache()
    runner.forward([*prompt, 7, 8, 9], cache, keep=4)  # a prompt, its last token, two drafts
    prefixes.store(runner, prompt, cache)  # a copy cut to the prompt
    assert cache.get_seq_length() == len(prompt) + 3  # the call's own cache is untouched
    kept, length = prefixes.lookup(runner, [*prompt, 11])
    assert length == len(prompt)
    assert kept is not None
    assert kept.get_seq_length() == len(prompt)
    fresh = runner.new_cache()
    runner.forward(prompt, fresh, keep=1)
    torch.testing.assert_close(runner.forward([11], kept), runner.forward([11], fresh))


def test_a_batch_runs_a_prompt_alone_and_the_rest_together() -> None:
    model = make_model(320, seed=3)
    runner = ModelRunner(model)
    widths: list[tuple[int, int]] = []
    forward = model.forward

    def spied(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        widths.append(tuple(ids.shape))
        return forward(*args, **kwargs)

    model.forward = spied  # type: ignore[method-assign]
    rng = torch.Generator().manual_seed(0)
    history = [torch.randint(3, 320, (n,), generator=rng).tolist() for n in (6, 9, 4)]
    feeds = [torch.randint(3, 320, (n,), generator=rng).tolist() for n in (ALONE_ROWS + 8, 3, 2)]
    alone_caches, batch_caches = [], []
    for tokens in history:
        for caches in (alone_caches, batch_caches):
            caches.append(runner.new_cache())
            runner.forward(tokens, caches[-1], keep=1)
    keeps = [4, None, 1]
    alone = [runner.forward(f, c, k) for f, c, k in zip(feeds, alone_caches, keeps, strict=True)]
    widths.clear()
    batched = runner.forward_batch(list(zip(feeds, batch_caches, strict=True)), keeps)
    assert sorted(widths) == [(1, ALONE_ROWS + 8), (2, 3)]  # the prompt alone, two together
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_failed_batch_leaves_no_kv_behind() -> None:
    """The prompt ran alone and succeeded, the batch of the others failed: every cache is as it
    was, so the worker's one-by-one retry feeds nobody's tokens twice."""
    model = make_model(320, seed=3)
    runner = ModelRunner(model)
    forward = model.forward

    def failing(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[0] > 1:
            raise RuntimeError("out of memory (simulated)")
        return forward(*args, **kwargs)

    caches = [runner.new_cache() for _ in range(3)]
    runner.forward([5, 6, 7], caches[1], keep=1)
    model.forward = failing  # type: ignore[method-assign]
    feeds = [list(range(10, 10 + ALONE_ROWS)), [8, 9], [3]]
    with pytest.raises(RuntimeError, match="simulated"):
        runner.forward_batch(list(zip(feeds, caches, strict=True)), [1, None, None])
    assert [int(c.get_seq_length()) for c in caches] == [0, 3, 0]
