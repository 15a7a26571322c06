"""Prefix reuse: the KV of a repeated prompt prefix is reused, and outputs do not change."""

from __future__ import annotations

import pytest
import torch

from specagent import Policy, RuntimeOptions, SpecRuntime
from specagent.chat import render_prompt
from specagent.decoding.prefix import reuse_prefix
from specagent.engines.transformers import ModelRunner
from specagent.runtime.memory import PrefixCache

SYSTEM = "You are a support agent. Tools: lookup_order(order_id), shop_policy(topic). " * 3


def test_lookup_store_and_eviction(target) -> None:
    runner = ModelRunner(target)
    cache = PrefixCache(max_tokens=100, min_tokens=4)
    tokens = list(range(10, 50))
    kv = runner.new_cache()
    runner.forward(tokens, kv, keep=1)
    cache.store(runner, tokens, kv)
    hit, n = cache.lookup(runner, [*tokens[:30], 99, 98])
    assert n == 30
    assert hit is not None
    assert hit.get_seq_length() == 30
    assert kv.get_seq_length() == 40  # the kept entry is untouched by the copy's crop
    assert cache.lookup(runner, [1, 2, 3, 4, 5]) == (None, 0)
    assert cache.lookup(object(), tokens) == (None, 0)  # another model's KV never matches
    assert cache.lookup(runner, [*tokens[:3], 7]) == (None, 0)  # below min_tokens
    for start in (100, 200):  # two more 40-token entries: the oldest is evicted (100 tokens max)
        other = list(range(start, start + 40))
        kv2 = runner.new_cache()
        runner.forward(other, kv2, keep=1)
        cache.store(runner, other, kv2)
    assert len(cache) == 2
    assert cache.lookup(runner, tokens)[1] == 0


def test_an_entry_a_longer_one_holds_is_dropped(target) -> None:
    """A finished call's KV (prompt and output) holds its prompt's: the prompt's entry goes."""
    runner = ModelRunner(target)
    cache = PrefixCache(max_tokens=1000, min_tokens=4)
    tokens = list(range(10, 70))
    kv = runner.new_cache()
    runner.forward(tokens[:40], kv, keep=1)
    cache.store(runner, tokens[:40], kv)
    runner.forward(tokens[40:], kv, keep=1)
    cache.store(runner, tokens, kv, copy=False)
    assert len(cache) == 1
    assert cache.size == 60
    hit, n = cache.lookup(runner, [*tokens, 5])
    assert n == 60
    assert hit is not kv  # lookups always copy
    other = cache.scoped("tenant-b")
    assert other.lookup(runner, tokens) == (None, 0)  # another scope sees nothing
    cache.clear()
    assert len(cache) == 0
    assert cache.size == 0


def test_one_tenants_prompts_never_flush_another_tenants_prefixes(target) -> None:
    """Over budget, the scope holding the most loses its least recently used entry: a tenant
    sending many long prompts keeps cycling its own entries while a small tenant's prefix stays
    (and is still found); alone, a tenant fills the whole budget."""
    runner = ModelRunner(target)
    cache = PrefixCache(max_tokens=200, min_tokens=4)
    quiet, loud = cache.scoped("quiet"), cache.scoped("loud")

    def kv_of(tokens: list[int]):  # type: ignore[no-untyped-def]
        kv = runner.new_cache()
        runner.forward(tokens, kv, keep=1)
        return kv

    kept = list(range(10, 50))
    quiet.store(runner, kept, kv_of(kept))
    for start in range(60, 300, 40):  # six 40-token prompts: 240 tokens of the loud tenant's
        prompt = list(range(start, start + 40))
        loud.store(runner, prompt, kv_of(prompt))
    assert cache.size <= 200
    assert quiet.lookup(runner, [*kept, 3])[1] == 40
    assert loud.lookup(runner, list(range(260, 300)))[1] == 40  # its newest stays
    assert loud.lookup(runner, list(range(60, 100)))[1] == 0  # its oldest went
    alone = PrefixCache(max_tokens=200, min_tokens=4)
    for start in range(60, 300, 40):
        prompt = list(range(start, start + 40))
        alone.scoped("a").store(runner, prompt, kv_of(prompt))
    assert alone.size == 200


def test_reused_kv_equals_recomputed_kv(target) -> None:
    runner = ModelRunner(target)
    prefixes = PrefixCache(min_tokens=8)
    prompt = list(range(5, 60))
    kv = runner.new_cache()
    runner.forward(prompt, kv, keep=1)
    prefixes.store(runner, prompt, kv)
    reused, n = prefixes.lookup(runner, [*prompt[:50], 3, 4])
    assert n == 50
    fresh = runner.new_cache()
    runner.forward(prompt[:50], fresh, keep=1)
    a = runner.forward([3, 4], reused)
    b = runner.forward([3, 4], fresh)
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("drafter", ["draft_model", "prompt_lookup"])
def test_outputs_with_and_without_reuse_are_equal(target, draft, tokenizer, drafter) -> None:
    policy = Policy(
        name="p",
        description="d",
        mode="lossless",
        drafter={"kind": drafter, "num_speculative_tokens": 3, "adaptive": False},
    )
    with_reuse = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=[policy], device="cpu"
    )
    without = SpecRuntime(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        policies=[policy],
        device="cpu",
        options=RuntimeOptions(prefix_cache_tokens=0),
    )
    for question in ("Where is order A-1?", "Refund for order B-2?", "Where is order A-1?"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        a = with_reuse.generate_sync(messages, policy="p", max_new_tokens=20, tenant="t")
        b = without.generate_sync(messages, policy="p", max_new_tokens=20, tenant="t")
        assert a.token_ids == b.token_ids
    assert with_reuse.prefix_cache is not None
    assert with_reuse.prefix_cache.hits >= 2
    assert with_reuse.prefix_cache.reused_tokens > 100
    with_reuse.close()
    without.close()


def conversation_policy() -> Policy:
    return Policy(
        name="p",
        description="d",
        mode="lossless",
        drafter={"kind": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
    )


def test_the_next_turn_starts_from_the_kv_the_last_turn_left(target, draft, tokenizer) -> None:
    """An agent's next call resends the conversation: prompt, the reply, a new message. The
    finished call left its KV (prompt and output, target and draft), so only the new message
    is prefilled; the tokens equal a runtime that prefills everything."""
    runtimes = [
        SpecRuntime(target, draft, tokenizer, [conversation_policy()], "cpu"),
        SpecRuntime(
            target,
            draft,
            tokenizer,
            [conversation_policy()],
            "cpu",
            options=RuntimeOptions(prefix_cache_tokens=0),
        ),
    ]
    reused, cold = runtimes
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Order A-1?"}]
    first = reused.generate_sync(messages, policy="p", max_new_tokens=16, tenant="t")
    assert first.token_ids == cold.generate_sync(messages, policy="p", max_new_tokens=16).token_ids
    prompt = render_prompt(messages, tokenizer, vocab_size=reused.vocab_size)
    assert reused.prefix_cache is not None
    before = reused.prefix_cache.reused_tokens
    follow_up = [*prompt, *first.token_ids, *tokenizer.encode("<|user|>And B-2?<|assistant|>")]
    second = reused.generate_sync(follow_up, policy="p", max_new_tokens=16, tenant="t")
    alone = cold.generate_sync(follow_up, policy="p", max_new_tokens=16)
    assert second.token_ids == alone.token_ids
    gained = reused.prefix_cache.reused_tokens - before
    # Usage says how much of the prompt came from the cache (OpenAI's cached_tokens).
    assert second.usage.cached_input_tokens == len(prompt) + len(first.token_ids) - 1
    assert alone.usage.cached_input_tokens == 0
    # The target skips the prompt and all but the last output token; the draft the same, short
    # of what its last step fed past the accepted tokens (at most k + 1 = 5).
    held = len(prompt) + len(first.token_ids) - 1
    assert gained >= held + (held - 4)
    for rt in runtimes:
        rt.close()


def test_kv_is_reused_within_a_tenant_only(target, draft, tokenizer) -> None:
    rt = SpecRuntime(target, draft, tokenizer, [conversation_policy()], "cpu")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Order A-1?"}]
    assert rt.prefix_cache is not None
    rt.generate_sync(messages, policy="p", max_new_tokens=8, tenant="acme")
    rt.generate_sync(messages, policy="p", max_new_tokens=8, tenant="globex")
    assert rt.prefix_cache.hits == 0  # the same prompt, another tenant: prefilled again
    rt.generate_sync(messages, policy="p", max_new_tokens=8, tenant="acme")
    assert rt.prefix_cache.hits >= 1
    rt.close()


def test_calls_that_name_no_tenant_share_nothing(target, draft, tokenizer) -> None:
    """Two anonymous callers are not known to be one party: neither starts from the other's
    KV nor drafts from the other's text (a policy whose history is the tenant's)."""
    shared = Policy(
        name="shared",
        description="d",
        mode="lossless",
        drafter={"kind": "suffix", "history": "tenant", "num_speculative_tokens": 4},
    )
    rt = SpecRuntime(target, draft, tokenizer, [conversation_policy(), shared], "cpu")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Order A-1?"}]
    assert rt.prefix_cache is not None
    assert rt.history is not None
    for policy in ("p", "shared"):
        first = rt.generate_sync(messages, policy=policy, max_new_tokens=8)
        again = rt.generate_sync(messages, policy=policy, max_new_tokens=8)
        assert first.token_ids == again.token_ids
        assert again.usage.cached_input_tokens == 0
    assert rt.prefix_cache.hits == 0
    assert rt.history.stats()["documents"] == 0  # nothing kept for anyone to draft from
    rt.generate_sync(messages, policy="shared", max_new_tokens=8, tenant="acme")
    assert rt.history.stats()["documents"] == 1  # a named tenant's calls are kept for it
    rt.close()


def test_a_kept_prefix_continues_as_the_whole_prompt_would_on_every_engine(engine_pair) -> None:
    """Store a prompt's KV, look up a longer prompt that shares it: the copy holds the shared
    part, the kept entry is untouched, and the logits after feeding the rest equal those of a
    forward over the whole prompt."""
    runner = engine_pair.target
    cache = PrefixCache(max_tokens=1000, min_tokens=4)
    prompt = [3, 7, 3, 7, 3, 4, 5, 6, 4, 5]
    kv = runner.new_cache()
    runner.forward(prompt, kv, keep=1)
    cache.scoped("t").store(runner, prompt, kv)
    longer = [*prompt[:8], 9, 10, 11]
    copied, reused = reuse_prefix(runner, longer, cache.scoped("t"))
    assert reused == 8
    assert copied.get_seq_length() == 8
    assert kv.get_seq_length() == len(prompt)
    resumed = runner.forward(longer[reused:], copied, keep=1)
    whole = runner.forward(longer, runner.new_cache(), keep=1)
    torch.testing.assert_close(resumed, whole, atol=1e-4, rtol=1e-4)
    assert reuse_prefix(runner, longer, cache.scoped("other"))[1] == 0  # no other scope's KV


def test_a_runner_made_later_never_finds_a_dropped_runners_kv(target) -> None:
    """Entries are filed under the runner itself, neither its address (a runner made after
    another was dropped, as one is for each reproducible call, may be given it) nor its model
    (another runner over the same weights may lay out its KV otherwise)."""
    import gc

    cache = PrefixCache(max_tokens=1000, min_tokens=4)
    tokens = list(range(10, 30))
    first = ModelRunner(target)
    kv = first.new_cache()
    first.forward(tokens, kv, keep=1)
    cache.store(first, tokens, kv)
    del first, kv
    gc.collect()
    for _ in range(10):
        assert cache.lookup(ModelRunner(target), tokens) == (None, 0)
