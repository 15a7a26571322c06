"""Grouped-query attention in place (``attention.grouped_sdpa``) gives transformers' sdpa
attention: the function against sdpa's on random heads and masks, and a model switched to it
against the same weights on sdpa in every forward the runner makes (a verification over an
ordinary cache, ragged batches over slots, a token tree) and in transformers' own ``generate``
with padding. Where it is used is measured (``choose_attention``); these tests set the
measurement's answer both ways."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specagent.engines.transformers import ModelRunner, attention
from specagent.engines.transformers.attention import NAME, choose_attention, grouped_sdpa

VOCAB = 96
TOL = {"atol": 1e-5, "rtol": 1e-4}


def gqa_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A random Qwen2 with 6 query heads over 2 key/value heads, on sdpa."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        use_sliding_window=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


class _Grouped(torch.nn.Module):
    num_key_value_groups = 3


@pytest.mark.parametrize("new", [1, 2, 5])
@pytest.mark.parametrize("boolean", [True, False])
def test_grouped_heads_give_sdpa_attention(new: int, boolean: bool) -> None:
    generator = torch.Generator().manual_seed(new)
    query = torch.randn(3, 6, new, 16, generator=generator)
    key, value = torch.randn(2, 3, 2, 40, 16, generator=generator)
    starts = torch.tensor([10, 33, 40 - new])  # each row sees its own first positions
    visible = torch.arange(40)[None, None, :] <= starts[:, None, None] + torch.arange(new)[:, None]
    mask = visible[:, None]
    if not boolean:  # an additive mask, as eager-style callers pass
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = _Grouped().eval()
    got, _ = grouped_sdpa(module, query, key, value, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(got, want, **TOL)


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> tuple[ModelRunner, ModelRunner]:
    """Runners over the same weights: one whose measurement chose grouped heads, one sdpa."""
    grouped_model = gqa_model()
    sdpa_model = copy.deepcopy(grouped_model)
    monkeypatch.setattr(attention, "_grouped_is_faster", lambda *shape: True)
    grouped = ModelRunner(grouped_model, slots=True)
    monkeypatch.setattr(attention, "_grouped_is_faster", lambda *shape: False)
    sdpa = ModelRunner(sdpa_model, slots=True)
    assert grouped.attention == NAME == grouped_model.config._attn_implementation
    assert sdpa.attention == "sdpa" == sdpa_model.config._attn_implementation
    return grouped, sdpa


def test_a_model_on_grouped_heads_gives_sdpa_logits_in_every_forward(pair) -> None:
    prompt = [(7 * i) % (VOCAB - 1) + 1 for i in range(60)]
    # One call over an ordinary cache: a prompt, then a verification of five tokens.
    for runner in pair:
        assert runner.inputs.trees
    caches = [runner.view.dynamic_cache() for runner in pair]
    for feed in (prompt, [3, 9, 27, 81, 50]):
        got, want = (r.forward(feed, c) for r, c in zip(pair, caches, strict=True))
        torch.testing.assert_close(got, want, **TOL)
    # Ragged batches over slots, one of them rolled back.
    slots = [[runner.new_cache() for _ in range(3)] for runner in pair]
    feeds = [prompt[:20], prompt[:45], prompt[:7]]
    for _ in range(2):
        got, want = (
            r.forward_batch(list(zip(feeds, s, strict=True)))
            for r, s in zip(pair, slots, strict=True)
        )
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL)
        for own in slots:
            own[1].crop(-2)
        feeds = [[5, 6, 7, 8], [1], [11, 12]]
    # A token tree after the first call's slot.
    parents = [-1, 0, 0, 1, 2]
    got, want = (
        r.forward([4, 8, 15, 16, 23], s[0], tree=parents) for r, s in zip(pair, slots, strict=True)
    )
    torch.testing.assert_close(got, want, **TOL)


def test_transformers_generate_with_padding_answers_as_on_sdpa(pair) -> None:
    ids = torch.tensor([[0, 0, 0, 5, 9, 13, 17], [3, 1, 4, 1, 5, 9, 2]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    outputs = [
        runner.model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        for runner in pair
    ]
    assert torch.equal(outputs[0], outputs[1])


def test_models_it_does_not_apply_to_are_left_as_they_are(monkeypatch) -> None:
    monkeypatch.setattr(attention, "_grouped_is_faster", lambda *shape: True)
    eager = gqa_model()
    eager.config._attn_implementation = "eager"
    assert choose_attention(eager) == "eager" == eager.config._attn_implementation
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,  # no grouped heads: nothing is repeated
        use_sliding_window=False,
        attn_implementation="sdpa",
    )
    ungrouped = Qwen2ForCausalLM(config)
    assert choose_attention(ungrouped) == "sdpa" == ungrouped.config._attn_implementation


def test_the_measurement_answers_on_this_machine() -> None:
    """The timing itself runs (whatever it answers here) and is made once per shape."""
    choice = attention._grouped_is_faster(torch.device("cpu"), torch.float32, 6, 2, 16)
    assert isinstance(choice, bool)
    before = attention._grouped_is_faster.cache_info().hits
    attention._grouped_is_faster(torch.device("cpu"), torch.float32, 6, 2, 16)
    assert attention._grouped_is_faster.cache_info().hits == before + 1
