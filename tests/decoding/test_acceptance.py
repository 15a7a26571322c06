"""Acceptance rules against brute force on a small vocabulary.

For each relaxed rule the induced distribution is (1) recomputed from the rule's definition with
plain Python loops, (2) matched by Monte Carlo runs of ``verify_relaxed`` itself, and its TV
distance is what the verifier reports as divergence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specagent.decoding.acceptance import (
    LenienceRule,
    TopKRule,
    TypicalRule,
    induced_distribution,
    lossless_acceptance,
    total_variation,
    verify_greedy,
    verify_lossless,
    verify_relaxed,
)
from specagent.decoding.sampling import SamplingParams, logits_to_probs, make_generator

V = 6


def random_pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(V, generator=gen) * 1.5, dim=-1)
    return p, q


def brute_criterion(rule, p: list[float], q: list[float], x: int) -> float:
    """The rule's definition, token by token."""
    if isinstance(rule, TypicalRule):
        entropy = -sum(pi * math.log(pi) for pi in p if pi > 0)
        return 1.0 if p[x] > min(rule.epsilon, rule.delta * math.exp(-entropy)) else 0.0
    if isinstance(rule, TopKRule):
        rank = sorted(p, reverse=True)
        return 1.0 if p[x] >= rank[rule.top_k - 1] and p[x] >= rule.ratio * max(p) else 0.0
    assert isinstance(rule, LenienceRule)
    return min(1.0, p[x] / (rule.lenience * q[x])) if q[x] > 0 else 1.0


def brute_induced(rule, p: list[float], q: list[float]) -> list[float]:
    """Enumerate: draft x ~ q, accept with a(x) = max(min(1, p/q), criterion), else resample
    from norm(max(0, p - q a))."""
    a = [
        max(min(1.0, p[x] / q[x]) if q[x] > 0 else 1.0, brute_criterion(rule, p, q, x))
        for x in range(V)
    ]
    accepted = [q[x] * a[x] for x in range(V)]
    residual = [max(0.0, p[x] - accepted[x]) for x in range(V)]
    mass = sum(residual)
    residual = [r / mass for r in residual] if mass > 0 else list(p)
    reject = 1.0 - sum(accepted)
    return [accepted[x] + reject * residual[x] for x in range(V)]


RULES = [
    TypicalRule(epsilon=0.3, delta=0.5),
    TypicalRule(epsilon=0.1, delta=0.09),
    TopKRule(top_k=2, ratio=0.3),
    TopKRule(top_k=3, ratio=0.1),
    LenienceRule(lenience=0.5),
    LenienceRule(lenience=0.2),
]


@pytest.mark.parametrize("rule", RULES, ids=repr)
@pytest.mark.parametrize("seed", range(5))
def test_induced_distribution_and_tv_match_enumeration(rule, seed: int) -> None:
    p, q = random_pair(seed)
    a = torch.maximum(lossless_acceptance(p, q), rule.criterion(p[None], q[None])[0])
    pi = induced_distribution(p, q, a)
    expected = brute_induced(rule, p.tolist(), q.tolist())
    assert torch.allclose(pi, torch.tensor(expected), atol=1e-6)
    assert math.isclose(float(pi.sum()), 1.0, abs_tol=1e-6)
    tv = 0.5 * sum(abs(e - pp) for e, pp in zip(expected, p.tolist(), strict=True))
    assert math.isclose(float(total_variation(pi, p)), tv, abs_tol=1e-6)


@pytest.mark.parametrize("rule", [RULES[0], RULES[2], RULES[4]], ids=repr)
def test_verify_relaxed_samples_its_induced_distribution(rule) -> None:
    """Monte Carlo over the real verifier (k = 1: one drafted position)."""
    p, q = random_pair(42)
    target = torch.stack([p, p])  # row 1 is the bonus position
    gen = make_generator(0)
    counts = np.zeros(V)
    reported = set()
    for _ in range(4000):
        x = torch.multinomial(q, 1, generator=gen)
        verdict = verify_relaxed(x, q[None], target, rule, gen)
        token = int(x) if verdict.num_accepted == 1 else verdict.next_token
        counts[token] += 1
        reported.add(round(verdict.divergences[0], 6))
    expected = np.array(brute_induced(rule, p.tolist(), q.tolist()))
    assert chisquare(counts, expected * counts.sum()).pvalue > 1e-3
    tv = 0.5 * np.abs(expected - p.numpy()).sum()
    assert reported == {round(float(tv), 6)}  # the first position's divergence is exact


def test_relaxed_rules_accept_at_least_what_lossless_accepts() -> None:
    """Coupled runs of the two verifiers: the same generator seed gives both the same uniform, so
    every draft token that exact verification accepts, each relaxed rule accepts too."""
    accepted = {"lossless": 0, **{repr(rule): 0 for rule in RULES}}
    for seed in range(10):
        p, q = random_pair(seed)
        target = torch.stack([p, p])
        for x in range(V):
            for trial in range(20):
                draft = torch.tensor([x])
                run = seed * 1000 + x * 20 + trial
                exact = verify_lossless(draft, q[None], target, make_generator(run))
                accepted["lossless"] += exact.num_accepted
                for rule in RULES:
                    relaxed = verify_relaxed(draft, q[None], target, rule, make_generator(run))
                    assert relaxed.num_accepted >= exact.num_accepted, (rule, seed, x)
                    accepted[repr(rule)] += relaxed.num_accepted
    for rule in RULES:  # and each accepts strictly more over all these pairs
        assert accepted[repr(rule)] > accepted["lossless"], accepted
    # and strictly more on a pair where the draft is overconfident on a plausible token
    p = torch.tensor([0.40, 0.35, 0.10, 0.05, 0.05, 0.05])
    q = torch.tensor([0.05, 0.85, 0.04, 0.02, 0.02, 0.02])
    for rule in (TypicalRule(), TopKRule(top_k=2, ratio=0.5), LenienceRule(lenience=0.3)):
        relaxed = (
            q * torch.maximum(lossless_acceptance(p, q), rule.criterion(p[None], q[None])[0])
        ).sum()
        assert relaxed > (q * lossless_acceptance(p, q)).sum()


def test_lossless_single_step_is_exact() -> None:
    p, q = random_pair(7)
    target = torch.stack([p, p])
    gen = make_generator(1)
    counts = np.zeros(V)
    for _ in range(4000):
        x = torch.multinomial(q, 1, generator=gen)
        verdict = verify_lossless(x, q[None], target, gen)
        counts[int(x) if verdict.num_accepted == 1 else verdict.next_token] += 1
    assert chisquare(counts, p.numpy() * counts.sum()).pvalue > 1e-3


def test_lossless_acceptance_is_the_rule_with_no_divergence() -> None:
    p, q = random_pair(3)
    pi = induced_distribution(p, q, lossless_acceptance(p, q))
    assert torch.allclose(pi, p, atol=1e-6)


def test_verify_greedy_exact_and_relaxed() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    exact = verify_greedy(torch.tensor([2, 0]), logits)
    assert (exact.num_accepted, exact.next_token, exact.divergences) == (0, 1, [0.0])
    relaxed = verify_greedy(torch.tensor([2, 0]), logits, rule=TopKRule(top_k=2, ratio=0.5))
    assert (relaxed.num_accepted, relaxed.next_token) == (2, 3)
    assert relaxed.divergences == [1.0, 0.0, 0.0]  # the non-argmax token counts, the rest match


def test_greedy_lenience_is_judged_against_the_argmax() -> None:
    """At temperature 0 lenience accepts a non-argmax x with min(1, p(x) / (lenience * max p))."""
    logits = torch.tensor([[0.0, 5.0, 4.9, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    ratio = math.exp(-0.1)  # p(2) / max p
    assert verify_greedy(torch.tensor([2, 0]), logits, rule=LenienceRule(1.0)).num_accepted == 0
    loose = verify_greedy(torch.tensor([2, 0]), logits, rule=LenienceRule(0.9))
    assert (loose.num_accepted, loose.divergences) == (2, [1.0, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    trials = 4000
    accepted = sum(
        verify_greedy(torch.tensor([2]), logits[[0, 1]], LenienceRule(1.0), gen).num_accepted
        for _ in range(trials)
    )
    assert accepted / trials == pytest.approx(ratio, abs=0.03)


def test_top_p_keeps_the_most_likely_token_and_renormalises() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert probs[0, 0] == pytest.approx(1.0)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (probs[0, 2:] == 0).all()
    assert probs[0].sum() == pytest.approx(1.0)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert probs[0, 3] == 0
    assert probs[0, :3].min() > 0


@pytest.mark.parametrize("scale", [8.0, 0.05])
def test_top_p_on_a_large_vocabulary_equals_the_full_sort(scale: float) -> None:
    """Scale 8 concentrates the mass in a few tokens (the fast path ranks only the head); scale
    0.05 spreads it so the head cannot hold top_p (the full sort runs). Same result either way."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * scale
    top_p = 0.9
    probs = torch.softmax(logits, dim=-1)
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    keep_sorted = (torch.cumsum(ordered, dim=-1) - ordered) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    reference = probs * keep
    reference = reference / reference.sum(dim=-1, keepdim=True)
    got = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(got > 0, reference > 0)
    assert torch.allclose(got, reference, atol=1e-6)
    head_mass = torch.topk(probs, 1024, dim=-1).values.sum(dim=-1)
    assert bool((head_mass >= top_p).all()) == (scale > 1.0)  # each path is exercised
