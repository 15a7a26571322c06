"""Token trees: the trie of several drafts, the tree forward against each draft's own chain
forward, keeping the accepted path's KV, the greedy walk, exactness under sampling (chi-square,
with a planted bug the test must catch) and greedy equality when ``auto`` rides a history
branch beside the draft model's."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import hf_greedy, make_model
from distributions import chi_square_pvalues, exact_marginals, sample_counts
from test_history import HISTORY, _history_drafter

from specagent.decoding import tree as tree_module
from specagent.decoding.acceptance import TopKRule
from specagent.decoding.costs import CostModel
from specagent.decoding.drafters import AutoDrafter, Drafter, DraftModelDrafter, SuffixDrafter
from specagent.decoding.history import SuffixIndex, continuation, runner_up
from specagent.decoding.loop import DecodeEvent, speculative_generate
from specagent.decoding.proposal import DraftRequest, DraftTree, Proposal
from specagent.decoding.sampling import SamplingParams, make_generator
from specagent.decoding.schedule import AdaptiveSchedule, FixedSchedule
from specagent.decoding.tree import tree_mask, verify_tree
from specagent.engines.transformers import ModelRunner


def test_drafts_merge_into_a_trie_and_keep_their_order_of_tries() -> None:
    tree = DraftTree.of(
        [Proposal([5, 6, 7]), Proposal([5, 8], source="history"), Proposal([9], source="history")]
    )
    assert tree.tokens == [5, 6, 7, 8, 9]
    assert tree.parents == [-1, 0, 1, 0, -1]
    assert tree.row_parents() == [-1, 0, 1, 2, 1, 0]
    assert tree.depths() == [0, 1, 2, 3, 2, 1]
    # The shared first token is tried twice (once per draft), in the order of the drafts.
    assert [(child, source) for child, _, source in tree.tries[-1]] == [
        (0, "model"),
        (0, "history"),
        (4, "history"),
    ]
    assert tree.chains == [[0, 1, 2], [0, 3], [4]]
    assert tree.accepted_of(0, [0, 3]) == 1
    assert tree.accepted_of(1, [0, 3]) == 2
    assert tree.accepted_of(2, [0, 3]) == 0


def test_mask_lets_each_row_see_the_cache_and_its_ancestors_only() -> None:
    mask = tree_mask([-1, 0, 1, 0], cached=2, dtype=None, width=8)[0, 0]
    assert mask.shape == (4, 8)
    assert mask[:, :2].all()
    assert not mask[:, 6:].any()
    assert mask[:, 2:6].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, False, False, True],
    ]
    additive = tree_mask([-1, 0], cached=1, dtype=torch.float32)[0, 0]
    assert additive[1].tolist()[:2] == [0.0, 0.0]
    assert additive[0, 2] < -1e30
    with pytest.raises(ValueError, match="not an earlier row"):
        tree_mask([-1, 1], cached=0, dtype=None)
    with pytest.raises(ValueError, match="cannot hold"):
        tree_mask([-1, 0], cached=3, dtype=None, width=4)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_tree_forward_equals_each_drafts_chain_and_keeps_the_accepted_path(
    attention: str,
) -> None:
    model = make_model(50, layers=2, seed=1)
    model.config._attn_implementation = attention
    runner = ModelRunner(model)
    assert runner.inputs.trees
    context = [5, 6, 7, 8, 9, 10]
    cache = runner.new_cache()
    runner.forward(context[:-1], cache)
    tree = DraftTree.of([Proposal([11, 12, 13]), Proposal([11, 14, 15, 16]), Proposal([20, 21])])
    in_tree = copy.deepcopy(cache)
    logits = runner.forward([context[-1], *tree.tokens], in_tree, tree=tree.row_parents())
    assert logits.shape == (1 + len(tree), 50)
    for chain in tree.chains:
        alone = copy.deepcopy(cache)
        chain_logits = runner.forward([context[-1], *(tree.tokens[n] for n in chain)], alone)
        rows = [0, *(node + 1 for node in chain)]
        torch.testing.assert_close(logits[rows], chain_logits, atol=1e-5, rtol=1e-5)
    # Keep the second draft's path (not contiguous in the tree's rows), then go on decoding.
    runner.keep_path(in_tree, len(context) - 1, tree.chains[1])
    assert in_tree.get_seq_length() == len(context) + 4
    reference = copy.deepcopy(cache)
    runner.forward([context[-1], 11, 14, 15, 16], reference)
    torch.testing.assert_close(
        runner.forward([40, 3], in_tree), runner.forward([40, 3], reference), atol=1e-5, rtol=1e-5
    )


def test_greedy_walk_follows_the_targets_choice_through_the_branches() -> None:
    tree = DraftTree.of([Proposal([1, 2]), Proposal([1, 3, 4], source="history")])
    logits = torch.full((1 + len(tree), 6), -5.0)
    # Rows: root, node 0 (1), node 1 (2), node 2 (3), node 3 (4).
    for row, choice in enumerate([1, 3, 0, 4, 5]):
        logits[row, choice] = 5.0
    verdict = verify_tree(tree, logits, True, None, torch.Generator())
    assert verdict.path == [0, 2, 3]
    assert [tree.tokens[n] for n in verdict.path] == [1, 3, 4]
    assert verdict.next_token == 5
    assert verdict.sources == ["model", "history", "history"]


# --------------------------------------------------------------------------- exactness


class TreeDrafter(Drafter):
    """Every step: the first drafter's draft and, beside it in a tree, the others'."""

    name = "tree"

    def __init__(self, *drafters: object) -> None:
        self.drafters = drafters

    def propose(self, ask: DraftRequest) -> Proposal:
        drafts = [d.propose(ask) for d in self.drafters]  # type: ignore[attr-defined]
        drafts = [d for d in drafts if d.tokens]
        if not drafts:
            return Proposal([])
        return dataclasses.replace(drafts[0], tree=DraftTree.of(drafts))


def _model(runner: ModelRunner) -> DraftModelDrafter:
    return DraftModelDrafter(runner)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["model-history", "history-model", "model-model"])
def test_tree_sampling_matches_the_target(small_target, small_draft, order: str) -> None:
    """Recursive rejection over a sampled draft, a deterministic history draft and a second
    independently sampled draft, in either order: the emitted tokens keep the target's exact
    marginals."""
    params = SamplingParams(temperature=1.0)
    runner = ModelRunner(small_draft)
    makers = {
        "model-history": lambda: TreeDrafter(_model(runner), _history_drafter()),
        "history-model": lambda: TreeDrafter(_history_drafter(), _model(runner)),
        "model-model": lambda: TreeDrafter(_model(runner), _model(runner), _history_drafter()),
    }
    counts = sample_counts(small_target, makers[order], params, 4)
    pvalues = chi_square_pvalues(counts, exact_marginals(small_target, params))
    assert min(pvalues) > 1e-3, pvalues


@pytest.mark.slow
def test_the_tree_check_catches_a_residual_left_unchanged(
    small_target, small_draft, monkeypatch
) -> None:
    """Planted bug: after a rejected try, the next one faces p again instead of the residual;
    a rejected history token then comes back too often. The same test must fail."""
    monkeypatch.setattr(tree_module, "residual_distribution", lambda p, accepted: p)
    params = SamplingParams(temperature=1.0)
    runner = ModelRunner(small_draft)
    counts = sample_counts(
        small_target, lambda: TreeDrafter(_history_drafter(), _model(runner)), params, 4
    )
    pvalues = chi_square_pvalues(counts, exact_marginals(small_target, params))
    assert min(pvalues) < 1e-6, pvalues


# --------------------------------------------------------------------------- history runner-up


def test_the_runner_up_takes_the_other_way_at_the_likeliest_split() -> None:
    index = SuffixIndex()
    for doc_id, doc in enumerate([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 5, 9]]):
        index.add(doc_id, doc)
    main = continuation([index], [0, 1, 2, 3], 3)
    assert main.tokens[:2] == [4, 5]
    other = runner_up([index], [0, 1, 2, 3], main, 3)
    # Splits: after 4 (7 holds 1 of 3 places, reached surely) and after 4, 5 (one of the two
    # places, reached with 2/3): equal chances, the earlier split is kept.
    assert other.tokens == [4, 7, 8]
    assert other.confidences == [1.0, pytest.approx(1 / 3), 1.0]
    agreed = SuffixIndex()
    agreed.add(0, [1, 2, 3, 4, 5])
    assert runner_up([agreed], [1, 2, 3], continuation([agreed], [1, 2, 3], 2), 2).tokens == []


def test_suffix_drafts_carry_the_runner_up_where_rows_are_free() -> None:
    drafter = _history_drafter()
    drafter.trees = True
    proposal = drafter.propose(
        DraftRequest([3, 7, 3], 4, SamplingParams(temperature=0.0), make_generator(0))
    )
    assert proposal.tree is not None
    chains = [[proposal.tree.tokens[n] for n in chain] for chain in proposal.tree.chains]
    assert chains[0] == proposal.tokens
    assert chains[1] != chains[0]
    # Every branch is a continuation some earlier document holds after the match.
    texts = [" ".join(map(str, doc)) for doc in HISTORY]
    assert all(any(" ".join(map(str, [7, 3, *c])) in t for t in texts) for c in chains)


@pytest.mark.slow
def test_history_trees_keep_sampling_exact(small_target) -> None:
    """Two deterministic tries per split (the history's best and its runner-up): the second
    faces the residual left by the first."""

    def drafter() -> object:
        made = _history_drafter()
        made.trees = True
        return made

    params = SamplingParams(temperature=1.0)
    counts = sample_counts(small_target, drafter, params, 4)
    pvalues = chi_square_pvalues(counts, exact_marginals(small_target, params))
    assert min(pvalues) > 1e-3, pvalues


# --------------------------------------------------------------------------- auto with trees


def _greedy(
    target: object, prompt: list[int], drafter: object, tokens: int, k: int, **options: object
) -> DecodeEvent:
    """The last event of a greedy call decoded with ``drafter`` at up to k tokens a step."""
    events = list(
        speculative_generate(
            ModelRunner(target),  # type: ignore[arg-type]
            prompt,
            params=SamplingParams(temperature=0.0),
            generator=make_generator(0),
            max_new_tokens=tokens,
            drafter=drafter,
            schedule=FixedSchedule(k),
            **options,
        )
    )
    return events[-1]


FLAT = CostModel(draft_step=0.05, verify=(1.0,) * 24, draft=(0.05,) * 24)
"""A verify curve flat to 24 rows and cheap draft forwards (as a GPU's): trees cost nothing."""


@pytest.mark.parametrize("prompt_seed", [0, 1, 2])
def test_auto_with_history_branches_equals_plain_greedy(target, draft, prompt_seed: int) -> None:
    """``auto`` drafts with the model and rides what the history continues beside it; the
    output is the target's greedy output token for token, and trees were verified."""
    gen = torch.Generator().manual_seed(prompt_seed)
    prompt = torch.randint(3, 40, (12,), generator=gen).tolist()
    truth = hf_greedy(target, prompt, 24)
    # Earlier calls that wrote the prompt, then what the target wrote or something else: the
    # history's vote is split three ways, so the model drafts and the history rides beside it.
    index = SuffixIndex()
    for doc in range(3):
        other = torch.randint(3, 40, (24,), generator=gen).tolist()
        index.add(doc, [*prompt, *(truth if doc == prompt_seed else other)])
    schedule = AdaptiveSchedule(max_k=8, costs=FLAT)
    drafter = AutoDrafter(
        SuffixDrafter([index], FLAT, own_context=True),
        DraftModelDrafter(ModelRunner(draft), costs=FLAT),
        schedule,
        trees=True,
    )
    last = _greedy(target, prompt, drafter, 24, 8)
    assert last.output_ids == truth
    counters = last.counters
    assert counters.emitted_tokens == 24
    assert counters.tree_steps > 0


def test_trees_are_built_where_the_model_is_chosen_and_history_disagrees(target, draft) -> None:
    """The model's draft goes first; a history continuation that leaves it is merged beside it
    when the flat costs make its rows free, and not when trees are off."""
    context = [5, 6, 7, 8, 9, 10, 11]
    index = SuffixIndex()
    index.add(0, [9, 10, 11, 30, 31, 32, 33])
    for trees in (True, False):
        schedule = AdaptiveSchedule(max_k=8, costs=FLAT)
        drafter = AutoDrafter(
            SuffixDrafter([index], FLAT, own_context=False),
            DraftModelDrafter(ModelRunner(draft), costs=FLAT),
            schedule,
            trees=trees,
        )
        # The history's vote is worth less than the model's expected run: the model drafts.
        drafter.history._calibration.hits = 0.2
        proposal = drafter.propose(
            DraftRequest(context, 6, SamplingParams(temperature=0.0), make_generator(0))
        )
        assert proposal.source == "model"
        assert proposal.tokens
        if trees:
            assert proposal.tree is not None
            assert proposal.tree.sources == ["model", "history"]
            assert [proposal.tree.tokens[n] for n in proposal.tree.chains[0]] == proposal.tokens
            branch = [proposal.tree.tokens[n] for n in proposal.tree.chains[1]]
            assert branch
            assert branch == [30, 31, 32, 33][: len(branch)]
        else:
            assert proposal.tree is None


def test_a_relaxed_rule_verifies_the_first_draft_alone(target, draft) -> None:
    """Relaxed rules judge a chain; a tree proposal under one is verified as its first draft."""
    prompt = [5, 9, 14, 5, 9, 14, 5]
    drafter = TreeDrafter(DraftModelDrafter(ModelRunner(draft)), _history_drafter())
    last = _greedy(target, prompt, drafter, 12, 4, rule=TopKRule())
    counters = last.counters
    assert counters.tree_steps == 0
    assert counters.num_drafts > 0
    assert last.output_ids is not None
    assert len(last.output_ids) == 12


def test_every_forward_of_a_tree_step_is_yielded(target) -> None:
    """The prompt a first tree step feeds before its tree is a forward the coroutine yields,
    as every other: a worker batches what is yielded, and a forward run inside the coroutine
    would run outside its round."""
    from specagent.decoding.engine import ForwardRequest
    from specagent.decoding.loop import Decoding, speculative_steps

    prompt = [5, 6, 7, 8, 9, 10, 11]
    first, second = SuffixIndex(), SuffixIndex()
    first.add(0, [9, 10, 11, 30, 31, 32, 33])
    second.add(0, [9, 10, 11, 40, 41, 42, 43])
    drafter = TreeDrafter(
        SuffixDrafter([first], own_context=False), SuffixDrafter([second], own_context=False)
    )
    runner = ModelRunner(target)
    ran: list[int] = []
    forward = runner.forward

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        ran.append(len(args[0]))  # type: ignore[arg-type]
        return forward(*args, **kwargs)  # type: ignore[arg-type]

    runner.forward = counted  # type: ignore[method-assign]
    how = Decoding(
        params=SamplingParams(temperature=0.0),
        generator=make_generator(0),
        max_new_tokens=4,
        drafter=drafter,
        schedule=FixedSchedule(4),
    )
    steps = speculative_steps(runner, prompt, how)
    yielded: list[int] = []
    reply = None
    trees = 0
    for _ in range(100):
        try:
            item = steps.send(reply)
        except StopIteration:
            break
        if isinstance(item, ForwardRequest):
            yielded.append(len(item.tokens))
            trees += item.tree is not None
            reply = item.run()
        else:
            reply = None
    assert trees  # the first step verified a tree...
    assert yielded[0] == len(prompt) - 1  # ...after the prompt, in a forward of its own
    assert ran == yielded  # every forward the target ran was one the coroutine yielded
