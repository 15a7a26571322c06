"""Single-query attention as grouped products: the same attention as SDPA (masks and heads as
transformers passes them), used only inside a runner's forwards, in that thread, where it
measured faster; the model's configuration is left as it was."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specagent.decoding import attention
from specagent.decoding.attention import NAME, grouped_attention, single_query_attention
from specagent.decoding.cache import ModelRunner, cache_keyword
from specagent.decoding.draft_model import DraftModelDrafter
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams
from specagent.decoding.schedule import FixedSchedule


def _qkv(rows: int, length: int, dtype: torch.dtype, heads: int = 6, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(rows * 1000 + length)
    q = torch.randn(2, heads, rows, 16, generator=gen).to(dtype)
    k = torch.randn(2, kv_heads, length, 16, generator=gen).to(dtype)
    v = torch.randn(2, kv_heads, length, 16, generator=gen).to(dtype)
    return q, k, v


def _reference(q, k, v, mask) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per_head"])
def test_grouped_attention_equals_sdpa(rows, mask_kind) -> None:
    q, k, v = _qkv(rows, 11, torch.float32)
    visible = torch.arange(11)[None, :] <= (11 - rows + torch.arange(rows))[:, None]
    visible = visible & (torch.arange(11) != 4)  # a padded slot
    mask = {
        "none": None,
        "bool": visible[None, None].expand(2, 1, rows, 11),
        "additive": torch.where(visible, 0.0, float("-inf"))[None, None].expand(2, 1, rows, 11),
        "per_head": visible[None, None].expand(2, 6, rows, 11),
    }[mask_kind]
    got = grouped_attention(q, k, v, mask, 16**-0.5)
    assert got.shape == (2, rows, 6, 16)
    assert got.is_contiguous()
    torch.testing.assert_close(got, _reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_grouped_attention_in_bf16_is_computed_in_float32() -> None:
    q, k, v = _qkv(1, 300, torch.bfloat16)
    got = grouped_attention(q, k, v, None, 16**-0.5)
    assert got.dtype == torch.bfloat16
    # Within the output's own rounding of the float32 result.
    torch.testing.assert_close(got.float(), _reference(q, k, v, None), rtol=1e-2, atol=4e-3)


def test_grouped_only_inside_the_context_in_its_thread(target, monkeypatch) -> None:
    calls: list[int] = []
    original = attention.grouped_attention

    def spy(q, k, v, mask, scaling):
        calls.append(q.shape[2])
        return original(q, k, v, mask, scaling)

    monkeypatch.setattr(attention, "grouped_attention", spy)
    monkeypatch.setattr(attention, "_faster_grouped", lambda *args: True)
    ids = torch.tensor([[5, 11, 42, 57]])
    layers = target.config.num_hidden_layers
    keyword = cache_keyword(type(target))
    with torch.inference_mode():
        prompt_cache = DynamicCache()
        target(input_ids=ids, **{keyword: prompt_cache})
        step = torch.tensor([[9]])

        def one_step() -> torch.Tensor:
            with torch.inference_mode():  # thread-local: the other thread enters it too
                return target(input_ids=step, **{keyword: copy.deepcopy(prompt_cache)}).logits

        expected = one_step()
        assert calls == []  # outside the context: transformers' SDPA
        elsewhere: list[torch.Tensor] = []
        with single_query_attention(target):
            assert target.config._attn_implementation == NAME
            got = one_step()
            assert calls == [1] * layers  # one query per layer: grouped
            target(input_ids=ids)  # four queries: SDPA
            assert calls == [1] * layers
            thread = threading.Thread(target=lambda: elsewhere.append(one_step()))
            thread.start()
            thread.join()
            assert calls == [1] * layers  # another thread meanwhile: SDPA
            with single_query_attention(target):
                pass
            assert target.config._attn_implementation == NAME  # nested: the outer one holds
        assert target.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(elsewhere[0], expected)


def test_other_attention_implementations_are_left_alone(target) -> None:
    before = target.config._attn_implementation
    target.config._attn_implementation = "eager"
    try:
        with single_query_attention(target):
            assert target.config._attn_implementation == "eager"
    finally:
        target.config._attn_implementation = before


def test_grouped_is_kept_only_where_it_measures_faster(monkeypatch) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    q, k, _ = _qkv(1, 8, torch.float32)
    monkeypatch.setattr(attention, "_choices", {})
    monkeypatch.setattr(attention, "MIN_GAIN", 0.0)  # nothing wins over SDPA
    assert not attention._faster_grouped(q, k, sdpa_attention_forward, Module())
    assert attention._faster_grouped(q, k, sdpa_attention_forward, Module()) is False  # kept
    monkeypatch.setattr(attention, "_choices", {})
    monkeypatch.setattr(attention, "MIN_GAIN", 1e9)  # grouped always wins
    assert attention._faster_grouped(q, k, sdpa_attention_forward, Module())


def test_greedy_speculation_with_grouped_attention_equals_plain_greedy(
    target, draft, monkeypatch
) -> None:
    """Every one-query step of the target and the draft grouped: the greedy tokens stay the
    target's (tiny fp32 models)."""
    monkeypatch.setattr(attention, "_faster_grouped", lambda *args: True)
    calls: list[int] = []
    original = attention.grouped_attention

    def spy(q, k, v, mask, scaling):
        calls.append(q.shape[2])
        return original(q, k, v, mask, scaling)

    monkeypatch.setattr(attention, "grouped_attention", spy)
    prompt = [5, 11, 42, 57, 99, 23, 64, 8, 77, 31]
    expected = target.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert calls == []  # transformers' own generate: untouched
    events = list(
        speculative_generate(
            ModelRunner(target),
            prompt,
            params=SamplingParams(temperature=0.0),
            generator=torch.Generator().manual_seed(0),
            max_new_tokens=24,
            drafter=DraftModelDrafter(ModelRunner(draft)),
            schedule=FixedSchedule(5),
        )
    )
    assert events[-1].output_ids == expected
    assert calls  # the draft's one-token steps ran grouped
    assert target.config._attn_implementation == "sdpa"
    assert draft.config._attn_implementation == "sdpa"
