"""Drafters: cheap proposers of the next k tokens.

One small interface (as transformers' ``CandidateGenerator``): ``propose(context, k, ...)`` returns
up to k tokens and, where the drafter has one, the distribution q each was drawn from. A drafter
object lives for one call and keeps that call's state (a draft KV cache); ``observe`` tells it how
many of its tokens were accepted.

- ``DraftModelDrafter``: a separate small model sharing the target's tokenizer.
- ``EarlyExitDrafter``: the target's own first N layers + its final norm and head (self-speculation;
  no second model in memory). Only pays on checkpoints trained for early exit (LayerSkip).
- ``PromptLookupDrafter``: copies what followed the latest earlier occurrence of the last n-gram in
  the prompt or output: free, and strong on extraction, editing and tool-call arguments.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from .cache import (
    ForwardRequest,
    ModelRunner,
    PrefixCache,
    common_prefix_length,
    crop_to,
    prefill,
)
from .sampling import SamplingParams, logits_to_probs, sample
from .schedule import CostModel

__all__ = [
    "DraftModelDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "TokenConstraint",
    "draft_steps",
    "lookup_continuation",
    "run_inline",
]


@dataclass(frozen=True)
class Proposal:
    """Draft tokens and, if the drafter samples, the distribution q of each ``[n, V]``.
    ``probs is None`` means the tokens were proposed deterministically (q is one-hot).
    Under a constraint, ``masks`` holds the allowed-token mask of each drafted position."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    masks: list[torch.Tensor] | None = None
    logits: torch.Tensor | None = None
    """Greedy drafting keeps the draft's logits instead: q is only needed by relaxed rules."""


class TokenConstraint(Protocol):
    """A grammar's state over the output so far (see ``specagent.grammar.GrammarState``)."""

    def allowed(self) -> torch.Tensor:
        """Boolean mask ``[V]`` of the tokens allowed next."""
        ...

    def consume(self, tokens: Sequence[int]) -> None: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_stopped(self) -> bool: ...


EMPTY = Proposal(tokens=[])

T = TypeVar("T")


def run_inline(steps: Generator[ForwardRequest, torch.Tensor | None, T]) -> T:
    """Drive a coroutine of forward requests by running each forward directly."""
    reply: torch.Tensor | None = None
    try:
        while True:
            reply = steps.send(reply).run()
    except StopIteration as stop:
        return stop.value


class Drafter(Protocol):
    """Proposes draft tokens for one call."""

    name: str

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Proposal:
        """Up to ``k`` tokens to follow ``context`` (prompt + output so far). Under a
        ``constraint``, only allowed tokens, each consumed into it (the loop rolls them back)."""
        ...

    def observe(self, proposed: int, accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted."""
        ...


class DraftModelDrafter:
    """Autoregressive drafting with a small model and its own KV cache.

    The cache tracks which tokens it holds; before drafting, it is cropped to the longest prefix
    it shares with the accepted context and only the rest is fed. That one rule rolls back
    rejected draft tokens and catches up after plain (k = 0) steps alike.
    """

    name = "draft_model"

    def __init__(
        self,
        runner: ModelRunner,
        prefixes: PrefixCache | None = None,
        confidence_threshold: float = 0.0,
        guess_ngrams: tuple[int, int] | None = None,
        costs: CostModel | None = None,
        plan_lengths: bool = True,
    ) -> None:
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        """Stop drafting once the draft's own top probability falls below this: a token it is
        unsure of is likely rejected, and every token after it surely wasted."""
        self.guess_ngrams = guess_ngrams
        """``(shortest, longest)`` n-gram for lookup guesses (None: no guessing); see
        ``propose_steps``."""
        self.costs = costs
        """Measured step costs (draft forwards and target verifications). With them, a guess is
        cut to the length that pays, and (with ``plan_lengths``) a draft ends where more tokens
        are expected to cost more than they bring (``_planned_length``); without them, drafts
        run to k and guesses as long as the lookup found."""
        self.plan_lengths = plan_lengths
        """False keeps every draft at k (a fixed schedule), short of the confidence stop."""
        self._tested_confidence = 2.0
        self._tested_hits = 2.0
        """Decayed sums over the draft tokens the target has judged: the draft's confidence in
        each, and how many it accepted (a neutral prior of two tokens). Their ratio calibrates
        the draft's confidence to the target's acceptance."""
        self._call_hits = 0.4
        self._call_trials = 0.5
        """Decayed per-token acceptance of this call (prior 0.8), as ``AdaptiveSchedule``'s."""
        self._last_confidences: list[float] = []
        self._guess_hits = 0.0
        self._guess_trials = 0.0
        self.draft_forwards = 0
        """Draft forwards run so far (a guessed run checked in one forward counts once)."""
        self.cache = runner.new_cache()
        self._cached: list[int] = []
        self._prefixes = prefixes

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Proposal:
        return run_inline(self.propose_steps(context, k, params, generator, constraint))

    def propose_steps(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        """``propose`` as a coroutine that yields each draft forward instead of running it, so
        the runtime can batch the draft steps of many calls into one forward."""
        if k <= 0 or not context:
            return EMPTY
        if not self._cached and self._prefixes is not None and len(context) > 1:
            self.cache = prefill(self.runner, context[:-1], self._prefixes)
            self._cached = list(context[:-1])
        shared = common_prefix_length(self._cached, context)
        shared = min(shared, len(context) - 1)  # always feed at least the last token
        crop_to(self.cache, shared)
        del self._cached[shared:]
        feed = context[shared:]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        confidences: list[float] = []
        self._last_confidences = confidences
        expected, all_accepted = 1.0, 1.0  # tokens this step is expected to emit; P(all pass)
        calibration = self._tested_hits / self._tested_confidence
        # The schedule has decided to draft: at least one token, however the plan looks.
        planned = max(1, self._planned_length(0, k, expected, all_accepted))
        while len(tokens) < planned:
            # Guesses beyond the planned length would be checked and then thrown away.
            guess = self._guess(context + tokens, planned - len(tokens) - 1)
            before = len(self._cached)
            fed = [*feed, *guess]
            logits = yield ForwardRequest(self.runner, fed, self.cache, keep=len(guess) + 1)
            if logits is None:
                raise RuntimeError("a draft forward request must be answered with its logits")
            self.draft_forwards += 1
            self._cached.extend(fed)
            go_on = True
            agreed = missed = 0
            # Row j is the draft's distribution after feed + guess[:j]; walk while it agrees.
            for j in range(len(guess) + 1):
                row = logits[j]
                if constraint is not None:
                    mask = constraint.allowed().to(row.device)
                    if not bool(mask.any()):
                        go_on = False
                        break
                    row = row.masked_fill(~mask, float("-inf"))
                    masks.append(mask)
                if params.greedy:
                    # q is only read by a relaxed rule; keep the logits, softmax when needed.
                    token = int(row.argmax())
                    rows.append(row)
                    confidence = _probability(row, token)
                else:
                    probs = logits_to_probs(row, params)
                    token = int(sample(probs, generator))
                    rows.append(probs)
                    confidence = float(probs[token])
                tokens.append(token)
                confidences.append(confidence)
                all_accepted *= min(confidence * calibration, 0.999)
                expected += all_accepted
                if constraint is not None:
                    constraint.consume([token])
                    if constraint.is_stopped():
                        go_on = False
                planned = self._planned_length(len(tokens), k, expected, all_accepted)
                if confidence < self.confidence_threshold or planned <= len(tokens):
                    go_on = False
                if j < len(guess):
                    agreed += token == guess[j]
                    missed = int(token != guess[j])
                if not go_on or j == len(guess) or token != guess[j]:
                    # The cache holds the fed tokens; only those up to this row stay valid.
                    valid = before + len(feed) + j
                    crop_to(self.cache, valid)
                    del self._cached[valid:]
                    feed = [token]
                    break
            if guess:
                self._guess_hits = self._guess_hits * 0.9 + agreed
                self._guess_trials = self._guess_trials * 0.9 + agreed + missed
            if not go_on:
                break
        if not tokens:
            return EMPTY
        stacked = torch.stack(rows)
        if params.greedy:
            return Proposal(tokens=tokens, logits=stacked, masks=masks or None)
        return Proposal(tokens=tokens, probs=stacked, masks=masks or None)

    def _guess(self, context: list[int], limit: int) -> list[int]:
        """Tokens the draft will likely produce next, by n-gram lookup in the context. Fed with
        the draft's next token, they let one forward check a run the draft would otherwise
        produce one forward per token: each row is taken only while the draft's own choice
        equals the guess, so the proposal is exactly the draft's (same tokens, same q, same
        random numbers), only cheaper when the text repeats what came before."""
        if self.guess_ngrams is None or limit <= 0:
            return []
        shortest, longest = self.guess_ngrams
        guess = lookup_continuation(context, limit, shortest, longest)
        if not guess or self.costs is None:
            return guess
        # Keep the length that makes the most draft tokens per unit of forward cost, with the
        # guesses' hit rate so far (a decayed estimate, prior 0.5): a wider forward costs more,
        # and on some hardware a lot more past a few rows.
        hit = (self._guess_hits + 0.5) / (self._guess_trials + 1.0)
        best, best_rate = 0, 1.0 / max(self.costs.draft_cost(1), 1e-9)
        expected, chance = 1.0, 1.0
        for n in range(1, len(guess) + 1):
            chance *= hit
            expected += chance
            rate = expected / max(self.costs.draft_cost(n + 1), 1e-9)
            if rate > best_rate:
                best, best_rate = n, rate
        return guess[:best]

    def _planned_length(self, drafted: int, k: int, expected: float, all_accepted: float) -> int:
        """How many tokens this step's draft should reach, given ``drafted`` so far: the length
        (up to k) with the most expected tokens per unit of cost (drafting plus verifying, from
        the measured curves); ``drafted`` itself when drafting further does not pay.

        The tokens drafted so far are expected to bring ``expected`` (the bonus token included),
        all of them accepted with probability ``all_accepted`` (the draft's own confidences,
        calibrated by what the target accepted so far). Further tokens are priced at the call's
        acceptance rate. Looking ahead up to k, not one token: the verify curve is not monotone
        (on a 2-core CPU, 16 rows cost less than 10), so one more token can be a loss while six
        more are a gain. Without costs (or ``plan_lengths``), the plan is k."""
        if self.costs is None or not self.plan_lengths or drafted >= k:
            return max(k, drafted)
        best, best_rate = drafted, expected / self.costs.step_cost(drafted)
        future = min(self._call_hits / self._call_trials, 0.999)
        gain, chance = 0.0, all_accepted
        for length in range(drafted + 1, k + 1):
            chance *= future
            gain += chance
            rate = (expected + gain) / self.costs.step_cost(length)
            if rate > best_rate:
                best, best_rate = length, rate
        return best

    def observe(self, proposed: int, accepted: int) -> None:
        """Calibrate: the target judged the draft tokens up to the first rejected one."""
        if proposed <= 0:
            return
        judged = self._last_confidences[: min(accepted + 1, proposed)]
        self._tested_confidence = self._tested_confidence * 0.9 + sum(judged)
        self._tested_hits = self._tested_hits * 0.9 + accepted
        self._call_hits = self._call_hits * 0.95 + accepted
        self._call_trials = self._call_trials * 0.95 + accepted + (1 if accepted < proposed else 0)


class EarlyExitDrafter(DraftModelDrafter):
    """Self-speculation through a shallow view of the target (see ``cache.early_exit_view``)."""

    name = "early_exit"


class PromptLookupDrafter:
    """n-gram lookup in the context (Saxena 2023; transformers' prompt lookup decoding).

    Tries the longest n-gram first (``max_ngram`` down to ``min_ngram``) and takes the most recent
    earlier match, which tracks what the output is currently copying."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            msg = f"prompt_lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            raise ValueError(msg)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        constraint: TokenConstraint | None = None,
    ) -> Proposal:
        if k <= 0:
            return EMPTY
        follow = lookup_continuation(context, k, self.min_ngram, self.max_ngram)
        return _admissible(follow, constraint) if follow else EMPTY

    def observe(self, proposed: int, accepted: int) -> None:
        """Lookup has no state to update."""


def lookup_continuation(
    context: Sequence[int], limit: int, min_ngram: int, max_ngram: int
) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the context's last
    n-gram (longest n first, ``max_ngram`` down to ``min_ngram``); empty when none occurs."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = context[length - n :]
        # Search right to left, excluding the tail itself.
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + limit]
                if follow:
                    return list(follow)
    return []


def _probability(logits: torch.Tensor, token: int) -> float:
    """p(token) = 1 / sum(exp(logits - logits[token])), without building the distribution."""
    return 1.0 / float(torch.exp(logits - logits[token]).sum())


def draft_steps(
    drafter: Drafter,
    context: list[int],
    k: int,
    params: SamplingParams,
    generator: torch.Generator,
    constraint: TokenConstraint | None = None,
) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
    """A proposal, yielding the drafter's forwards when it has any (``propose_steps``) so they
    can be batched; drafters without a model (prompt lookup) answer at once."""
    stepwise = getattr(drafter, "propose_steps", None)
    if stepwise is None:
        return drafter.propose(context, k, params, generator, constraint)
    proposal: Proposal = yield from stepwise(context, k, params, generator, constraint)
    return proposal


def _admissible(tokens: list[int], constraint: TokenConstraint | None) -> Proposal:
    """The longest prefix of ``tokens`` the constraint allows, consumed into it, with masks."""
    if constraint is None:
        return Proposal(tokens=tokens)
    masks: list[torch.Tensor] = []
    for token in tokens:
        mask = constraint.allowed()
        if not bool(mask[token]):
            break
        masks.append(mask)
        constraint.consume([token])
        if constraint.is_stopped():
            break
    kept = tokens[: len(masks)]
    return Proposal(tokens=kept, masks=masks) if kept else EMPTY
