"""Aligned copying (``decoding.alignment``): drafting the unchanged rest of a text the output
rewrites, re-anchored right after each change, substitutions carried to later occurrences; and
the caller's prediction, which only drafts (lossless stays exactly lossless, by a distribution
test)."""

from __future__ import annotations

import pytest
from distributions import PROMPT, chi_square_pvalues, exact_marginals, sample_counts

from specagent.decoding.alignment import SpanCopier
from specagent.decoding.costs import CostModel
from specagent.decoding.drafters.suffix import SuffixDrafter
from specagent.decoding.sampling import SamplingParams

# Verifying up to 33 rows costs 1 + 0.1 per extra row: long drafts pay when they are right.
FLAT = CostModel(verify=tuple(1.0 + 0.1 * n for n in range(33)))

# The llama.cpp engine's curve on a 2-core Zen 4 (Qwen2.5-Coder-1.5B Q4_K_M, timed pairwise):
# 17 rows cost ten single steps, so only long drafts that are nearly always right pay.
STEEP = CostModel(
    verify=(
        1.0, 2.09, 2.59, 3.05, 3.81, 4.41, 5.06, 6.88, 7.4, 7.92, 8.44, 8.96, 8.99, 9.03, 9.06,
        9.1, 10.22, 10.68, 11.15, 11.61, 12.07, 12.54, 13.0, 13.46, 13.61, 13.75, 13.89, 14.04,
        14.18, 14.33, 14.47, 14.62, 16.07,
    )
)  # fmt: skip

# A "function" of 120 tokens where token 7 (a name) occurs every 20 tokens and the lines
# repeat their shape (tokens 100..104 on every line), as code does.
LINE = [100, 101, 102, 103, 104]
SOURCE = [t for i in range(6) for t in (7, 200 + 3 * i, 201 + 3 * i, *LINE, 202 + 3 * i, *LINE)]


def _steps(
    drafter: SuffixDrafter, prompt: list[int], answer: list[int], costs: CostModel = FLAT
) -> tuple[int, float]:
    """Verification steps to emit ``answer`` greedily with ``drafter``, and their total cost."""
    context, done, steps, cost = list(prompt), 0, 0, 0.0
    while done < len(answer):
        found, _ = drafter.candidate(context, 32)
        tokens = drafter.take(found, None).tokens
        accepted = 0
        while (
            accepted < len(tokens)
            and done + accepted < len(answer)
            and tokens[accepted] == answer[done + accepted]
        ):
            accepted += 1
        drafter.observe(len(tokens), accepted)
        emitted = min(accepted + 1, len(answer) - done)
        context += answer[done : done + emitted]
        done += emitted
        steps += 1
        cost += costs.verify_cost(len(tokens) + 1)
    return steps, cost


def _renamed(tokens: list[int], old: int, new: list[int]) -> list[int]:
    return [t for token in tokens for t in (new if token == old else [token])]


def test_a_rename_copies_through_every_later_occurrence() -> None:
    """The output renames token 7 to two tokens (8, 9) six times: aligned copying learns the
    substitution at the first and drafts it at the others; the n-gram match alone stops at
    every occurrence and its repeated lines split its votes (half again as many steps)."""
    prompt = [1, 2, *SOURCE, 3, 4]
    answer = _renamed(SOURCE, 7, [8, 9])
    aligned = SuffixDrafter(costs=FLAT)
    ngrams = SuffixDrafter(costs=FLAT)
    ngrams.copiers = []
    aligned_steps, aligned_cost = _steps(aligned, prompt, answer)
    ngram_steps, ngram_cost = _steps(ngrams, prompt, answer)
    assert aligned_steps * 1.5 <= ngram_steps, (aligned_steps, ngram_steps)
    assert aligned_cost < ngram_cost
    own = aligned.copiers[0]
    assert own.rules == {(7,): (8, 9)}


def test_a_copy_learns_from_what_the_output_writes_where_verifying_is_steep() -> None:
    """On a steep curve the priors alone make no draft worth verifying; a copier that learnt
    only from its own drafts would never draft at all. It reads the output's tokens instead:
    once the output has followed the source for some plain steps, its copies pay (the rename's
    whole answer for under 85% of plain decoding's steps' cost)."""
    prompt = [1, 2, *SOURCE, 3, 4]
    answer = _renamed(SOURCE, 7, [8, 9])
    copier = SpanCopier([], own=True)
    found, rate = copier.candidate([*prompt, *answer[:4]], 32, STEEP)
    assert rate <= 1.0 or not found.tokens  # nothing known yet: plain steps
    steps, cost = _steps(SuffixDrafter(costs=STEEP), prompt, answer, STEEP)
    assert cost < 0.85 * len(answer), (steps, cost, len(answer))


def test_a_copy_resumes_right_after_a_changed_literal() -> None:
    """One token changed (a literal): once the output writes the token after it, the next step
    drafts the rest of the source from there, on a one-token anchor that would be a guess
    anywhere but just ahead of the change."""
    copier = SpanCopier([], own=True)
    prompt = [1, *SOURCE, 3]
    changed = list(SOURCE)
    changed[30] = 999  # the output writes 999 where the source had SOURCE[30]
    context = [*prompt, *changed[:32]]
    for end in range(len(prompt), len(prompt) + 30):  # a step a token through the start
        copier.sync(context[:end])
    assert copier.cursor is not None
    found, rate = copier.candidate(context, 32, FLAT)
    assert SOURCE.count(SOURCE[31]) > 1  # the anchor token recurs: only its place decides
    assert len(found.tokens) >= 3
    assert found.tokens == SOURCE[32 : 32 + len(found.tokens)]
    assert rate > 1.0


def test_a_prediction_drafts_from_the_first_step_and_after_a_preamble() -> None:
    prediction = SOURCE[:40]
    copier = SpanCopier(list(prediction), label="prediction")
    prompt = [1, 2, 3]
    found, _ = copier.candidate(prompt, 16, FLAT)
    assert len(found.tokens) >= 4
    assert found.tokens == prediction[: len(found.tokens)]
    # The output opens with a preamble the prediction lacks, then starts it: re-anchored at
    # the prediction's start, not on a token that merely recurs in it.
    other = SpanCopier(list(prediction), label="prediction")
    other.candidate(prompt, 16, FLAT)
    found, _ = other.candidate([*prompt, 500, 101], 16, FLAT)
    assert not found.tokens  # 101 alone recurs all over the prediction: no guess
    found, _ = other.candidate([*prompt, 500, 101, 7], 16, FLAT)
    assert found.tokens
    assert found.tokens == prediction[1 : 1 + len(found.tokens)]


def test_drafts_follow_costs_and_acceptance() -> None:
    """Where verifying more rows costs as much as the tokens they bring, no draft is worth it;
    a copier whose drafts keep failing lowers its estimates and its drafts shorten."""
    steep = CostModel(verify=tuple(float(n + 1) for n in range(33)))
    copier = SpanCopier(list(SOURCE), label="prediction")
    found, rate = copier.candidate(PROMPT, 32, steep)
    assert rate <= 1.0 + 1e-9 or len(found.tokens) <= 1
    hopeful = SpanCopier(list(SOURCE), label="prediction")
    first, _ = hopeful.candidate([9], 32, FLAT)
    for _ in range(30):
        hopeful.rates.further.add(0.0, 1.0)
    hopeful.seen, hopeful.cursor = -1, None
    hopeful.__post_init__()
    later, _ = hopeful.candidate([9], 32, FLAT)
    assert len(later.tokens) < len(first.tokens)


def test_re_anchoring_reads_a_bounded_number_of_places(monkeypatch) -> None:
    """A source that repeats one line a thousand times: each re-anchoring reads at most the
    latest places and those just ahead of the break, never every occurrence."""
    read: list[int] = []
    original = SpanCopier._matches

    def counting(self, places, context, limit):
        read.append(len(places))
        return original(self, places, context, limit)

    monkeypatch.setattr(SpanCopier, "_matches", counting)
    line = [100, 101, 102, 103, 104, 105]
    source = line * 1000
    copier = SpanCopier(list(source), label="prediction")
    context = [1, 2]
    for token in [*line, 55, *line[1:], 56, 57, *line]:  # drift in and out of alignment
        context.append(token)
        copier.candidate(context, 16, FLAT)
    assert read
    assert max(read) <= 2 * 32 + 1


@pytest.mark.slow
@pytest.mark.parametrize("prediction", [[3, 7, 3, 7, 3, 7, 3, 7], [1, 2, 5, 0, 4, 4, 6, 2]])
def test_a_prediction_keeps_sampling_lossless(engine_pair, prediction) -> None:
    """Whatever the prediction (one that follows the prompt's pattern, one at random), the
    tokens are distributed exactly as the target's: the prediction only drafts."""
    params = SamplingParams(temperature=0.8, top_p=0.9)
    marginals = exact_marginals(engine_pair.target, params)
    vocab = engine_pair.target.vocab_size
    guess = [t % vocab for t in prediction]
    counts = sample_counts(
        engine_pair.target, lambda: SuffixDrafter(costs=FLAT, prediction=guess), params, 4
    )
    pvalues = chi_square_pvalues(counts, marginals)
    assert min(pvalues) > 1e-3, pvalues
