"""A runner declares the optional inputs its forward takes (``ForwardInputs``); the core sends
only those: a request carrying another is refused before any forward runs, naming it."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from fake_engine import FakeModel

from specagent.decoding.engine import ForwardInputs, ForwardRequest
from specagent.engines.transformers import ModelRunner

VOCAB = 96


def test_a_runner_without_trees_or_head_rows_is_sent_neither() -> None:
    runner = FakeModel().runner()
    assert runner.inputs == ForwardInputs()
    cache = runner.new_cache()
    with pytest.raises(ValueError, match=r"takes no token trees \(ForwardInputs.trees\)"):
        ForwardRequest(runner, [1, 2], cache, tree=[-1, 0])
    with pytest.raises(ValueError, match=r"takes no vocabulary \(ForwardInputs.head_rows\)"):
        ForwardRequest(runner, [1, 2], cache, vocab=torch.tensor([3]))
    assert cache.get_seq_length() == 0  # nothing ran
    assert ForwardRequest(runner, [1, 2], cache).run().shape[0] == 2


def test_the_transformers_runner_declares_what_it_was_made_with() -> None:
    model = make_model(VOCAB)
    assert ModelRunner(model).inputs == ForwardInputs(trees=True, head_rows=None)
    drafty = ModelRunner(model, head_rows=VOCAB // 2)
    assert drafty.inputs == ForwardInputs(trees=True, head_rows=VOCAB // 2)
    own = torch.tensor([VOCAB - 1])
    logits = ForwardRequest(drafty, [1, 2], drafty.new_cache(), vocab=own).run()
    assert torch.isfinite(logits[:, VOCAB - 1]).all()
    assert torch.isinf(logits[:, VOCAB - 2]).all()
