"""Weight-only int8 linears for a draft: the products, the model after quantizing, and that an
int8 draft keeps sampling lossless (its distribution is whatever it is; the target's decides)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model
from distributions import (
    chi_square_pvalues,
    exact_marginals,
    sample_counts,
)

from specagent.decoding import acceptance
from specagent.decoding.drafters import DraftModelDrafter
from specagent.decoding.sampling import SamplingParams
from specagent.engines.transformers import ModelRunner
from specagent.engines.transformers.checkpoint import model_vocab_size
from specagent.engines.transformers.keys import model_key
from specagent.engines.transformers.quantized import (
    Int8Linear,
    has_int8_weights,
    int8_supported,
    quantize_linears,
)

pytestmark = pytest.mark.skipif(
    not int8_supported(torch.device("cpu")), reason="this torch has no CPU int8 weight kernel"
)


def int8_copy(model: torch.nn.Module) -> torch.nn.Module:
    return quantize_linears(copy.deepcopy(model).to(torch.bfloat16))


@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_the_full_product_to_its_rounding(shape, bias) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=bias)
    x = torch.randn(*shape)
    quantized = Int8Linear(linear)
    out = quantized(x.to(torch.bfloat16)).float()
    exact = F.linear(x, linear.weight, linear.bias)
    assert out.shape == exact.shape == (*shape[:-1], 48)
    # int8 rows (scale max|w| / 127) and bf16 activations: about 1% of the output's size.
    assert (out - exact).norm() < 0.02 * exact.norm()
    assert quantized.weight.dtype == torch.int8
    assert quantized.weight.shape == linear.weight.shape


def test_an_int8_row_is_its_weight_rounded_to_127_steps_of_its_largest_entry() -> None:
    linear = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    quantized = Int8Linear(linear, torch.float32)
    assert quantized.weight.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0]]  # -63.5 rounds to even
    assert quantized.scales[0].item() == pytest.approx(1 / 127)
    out = quantized(torch.ones(1, 4))
    assert out.float().tolist()[0][1] == 0.0  # an all-zero row stays zero (no division by 0)


def test_quantizing_a_model_swaps_every_linear_and_keeps_its_predictions() -> None:
    model = make_model(96, layers=2, seed=3, init=0.2)
    full = copy.deepcopy(model).to(torch.bfloat16)
    quantized = int8_copy(model)
    linears = [m for m in quantized.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []
    assert isinstance(quantized.get_output_embeddings(), Int8Linear)
    assert quantized.get_input_embeddings().weight.dtype == torch.bfloat16  # stays as it was
    assert has_int8_weights(quantized)
    assert not has_int8_weights(full)
    assert model_vocab_size(quantized) == 96
    assert model_key(quantized) != model_key(full)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = full(input_ids=ids).logits.float()
        got = quantized(input_ids=ids).logits.float()
    agree = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree > 0.9, agree


def test_linears_the_int8_kernel_cannot_take_stay_as_they_are() -> None:
    """torch's kernel crashed the process on multi-row products over 24 input columns."""
    model = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    quantize_linears(model)
    assert type(model[0]) is torch.nn.Linear
    assert isinstance(model[1], Int8Linear)
    assert model(torch.randn(3, 24, dtype=torch.bfloat16)).shape == (3, 8)


def test_an_int8_draft_runs_in_the_runner_with_its_cache() -> None:
    """Cached single-token steps continue what a prefill left, as in the unquantized model."""
    draft = int8_copy(make_model(96, layers=2, seed=4, init=0.2))
    runner = ModelRunner(draft)
    ids = list(range(10, 30))
    cache = runner.new_cache()
    whole = runner.forward(ids, runner.new_cache())
    split = runner.forward(ids[:-1], cache)
    step = runner.forward(ids[-1:], cache)
    assert runner.vocab_size == 96
    assert torch.allclose(whole[-1], step[-1], atol=0.05), (whole[-1] - step[-1]).abs().max()
    assert split.shape[-1] == 96


@pytest.mark.slow
def test_int8_draft_sampling_matches_target(small_target, small_draft) -> None:
    params = SamplingParams(temperature=1.0)
    marginals = exact_marginals(small_target, params)
    runner = ModelRunner(int8_copy(small_draft))
    counts = sample_counts(small_target, lambda: DraftModelDrafter(runner), params, 4)
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.slow
def test_the_check_catches_a_wrong_residual_with_an_int8_draft(
    small_target, small_draft, monkeypatch
) -> None:
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, accepted: p)
    params = SamplingParams(temperature=1.0)
    marginals = exact_marginals(small_target, params)
    runner = ModelRunner(int8_copy(small_draft))
    counts = sample_counts(small_target, lambda: DraftModelDrafter(runner), params, 4)
    assert min(chi_square_pvalues(counts, marginals)) < 1e-6
