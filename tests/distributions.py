"""The statistics behind every losslessness test: the exact marginals of plain sampling from a
model (by enumerating every continuation of a short prompt on a small vocabulary), the counts of
a speculative sampler's tokens over many seeds, and the chi-square p-values of one against the
other, per position. Losslessness is a property of a distribution, not of one output."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams, logits_to_probs, make_generator
from specagent.decoding.schedule import FixedSchedule

PROMPT = [3, 7, 3, 7, 3]
STEPS = 4
N = 2000


def exact_marginals(model, params: SamplingParams, vocab: int | None = None) -> np.ndarray:
    """``[STEPS, V]``: P(token t = v) under plain sampling from ``model``: a transformers model
    (all continuations in one batched forward) or any engine's runner (one forward each)."""
    if isinstance(model, torch.nn.Module):
        return _marginals_of_module(model, params)
    vocab = vocab or model.vocab_size
    marginals = np.zeros((STEPS, vocab))
    for prefix in itertools.product(range(vocab), repeat=STEPS - 1):
        logits = model.forward([*PROMPT, *prefix], model.new_cache())[len(PROMPT) - 1 :]
        probs = logits_to_probs(logits.double(), params).double().numpy()
        path = 1.0
        for t in range(STEPS):
            marginals[t] += path * probs[t] / vocab ** (STEPS - 1 - t)
            if t < STEPS - 1:
                path *= probs[t, prefix[t]]
    return marginals


def _marginals_of_module(model: torch.nn.Module, params: SamplingParams) -> np.ndarray:
    vocab = int(model.config.vocab_size)
    prefixes = list(itertools.product(range(vocab), repeat=STEPS - 1))
    ids = torch.tensor([PROMPT + list(p) for p in prefixes])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    probs = logits_to_probs(logits[:, len(PROMPT) - 1 :], params).double()  # [P, STEPS, V]
    marginals = np.zeros((STEPS, vocab))
    path = torch.ones(len(prefixes), dtype=torch.float64)
    for t in range(STEPS):
        # Every prefix row covers the same first t tokens once per (STEPS-1-t) suffix; weight
        # each row by the probability of its first t tokens and divide out the repetition.
        repeat = vocab ** (STEPS - 1 - t)
        marginals[t] = (path[:, None] * probs[:, t]).sum(0).numpy() / repeat
        if t < STEPS - 1:
            chosen = ids[:, len(PROMPT) + t]
            path = path * probs[torch.arange(len(prefixes)), t, chosen]
    return marginals


def sample_counts(target, drafter, params: SamplingParams, k: int) -> np.ndarray:
    """Counts ``[STEPS, V]`` of the tokens of ``N`` speculative samples (seeds 0..N-1) from
    ``target`` (a transformers model or a runner), drafting with a fresh ``drafter()`` per
    sample (None: plain sampling) at a fixed k."""
    if isinstance(target, torch.nn.Module):
        from specagent.engines.transformers import ModelRunner

        target = ModelRunner(target)
    counts = np.zeros((STEPS, target.vocab_size))
    for seed in range(N):
        events = list(
            speculative_generate(
                target,
                PROMPT,
                params=params,
                generator=make_generator(seed),
                max_new_tokens=STEPS,
                drafter=drafter() if drafter else None,
                schedule=FixedSchedule(k),
            )
        )
        for t, token in enumerate(events[-1].output_ids):
            counts[t, token] += 1
    return counts


def chi_square_pvalues(counts: np.ndarray, marginals: np.ndarray) -> list[float]:
    """Per position, the p-value of the counts under the marginals (tokens expected fewer than
    5 times pooled into one bin, as the test requires)."""
    pvalues = []
    for t in range(STEPS):
        expected = marginals[t] * counts[t].sum()
        big = expected >= 5
        obs = np.append(counts[t][big], counts[t][~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        pvalues.append(float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue))
    return pvalues
