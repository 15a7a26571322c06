"""Drafting with a model and its own KV (``DraftModelDrafter``): the runtime's draft model
(``draft_model``), the target's first layers (``early_exit``), and ``auto``'s model drafts.

It keeps a draft KV cache per call and ends each draft where the measured step costs and the
draft's calibrated confidence say one more token no longer pays (``costs.most_per_cost``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..costs import CostModel, expected_tokens, most_per_cost
from ..engine import ForwardRequest, Runner, Tokens, crop_to
from ..parts import Prefixes
from ..prefix import common_prefix_length, reuse_prefix
from ..proposal import EMPTY, DraftRequest, Proposal
from ..sampling import SamplingParams, logits_to_probs, sample
from ..vocab import CallVocabulary
from .base import Calibration, StepwiseDrafter, lookup_continuation

if TYPE_CHECKING:
    from collections.abc import Generator

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter(StepwiseDrafter):
    """Autoregressive drafting with a small model and its own KV cache.

    The cache tracks which tokens it holds; before drafting, it is cropped to the longest prefix
    it shares with the accepted context and only the rest is fed. That one rule rolls back
    rejected draft tokens and catches up after plain (k = 0) steps alike.
    """

    name = "draft_model"

    def __init__(
        self,
        runner: Runner,
        prefixes: Prefixes | None = None,
        confidence_threshold: float = 0.0,
        guess_ngrams: tuple[int, int] | None = None,
        costs: CostModel | None = None,
        plan_lengths: bool = True,
        call_end: int | None = None,
        on_device: bool | None = None,
    ) -> None:
        self.runner = runner
        self.on_device = runner.device.type != "cpu" if on_device is None else on_device
        """Decide each draft on the device and read it once (``_drafted_on_device``), not one
        token at a time: on an accelerator every read waits for the device's queue to drain.
        None: where the draft runs on one. Grammar-constrained drafts stay on the host (the
        grammar reads every token), and drafts on the device make no lookup guesses (a guess
        continues tokens the host has not read)."""
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
        self.call_end = call_end
        """The context length at which the call ends (None: unknown). With costs, the draft
        catches up on a long unseen context (a first prefill) only where the call has enough
        tokens left to earn it back (``catch_up_pays``)."""
        self._declined = False
        self._calibration = Calibration(confidence=2.0, hits=2.0)
        """The draft's confidence against the target's acceptance (a neutral prior of two
        tokens)."""
        self._call_hits = 0.4
        self._call_trials = 0.5
        """Decayed per-token acceptance of this call (prior 0.8), as ``AdaptiveSchedule``'s."""
        self._guess_hits = 0.0
        self._guess_trials = 0.0
        self.draft_forwards = 0
        """Draft forwards run so far (a guessed run checked in one forward counts once)."""
        self.cache = runner.new_cache()
        self._cached: list[int] = []
        self._prefixes = prefixes
        rows = runner.inputs.head_rows
        self._vocab = CallVocabulary(rows) if rows is not None else None
        """This call's own ids beyond the runner's head rows (None: the whole head)."""

    def propose_steps(
        self, ask: DraftRequest
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        """``propose`` as a coroutine that yields each draft forward instead of running it, so
        the runtime can batch the draft steps of many calls into one forward."""
        context, k, params, generator, constraint = ask
        if k <= 0 or not context or not self.catch_up_pays(context):
            return EMPTY
        feed, prompt = self._unfed(context)
        vocab = self._vocab.update(context) if self._vocab is not None else None
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        confidences: list[float] = []
        self._calibration.last = confidences
        stops = _Stops(self, k)
        if self.on_device and constraint is None:
            proposal = yield from self._drafted_on_device(
                context, feed, stops, params, generator, vocab, prompt
            )
            return proposal
        planned = stops.planned
        while len(tokens) < planned:
            # Guesses beyond the planned length would be checked and then thrown away.
            guess = self._guess(context + tokens, planned - len(tokens) - 1)
            before = len(self._cached)
            fed = [*feed, *guess]
            logits = yield ForwardRequest(
                self.runner, fed, self.cache, keep=len(guess) + 1, vocab=vocab
            )
            if logits is None:
                raise RuntimeError("a draft forward request must be answered with its logits")
            self.draft_forwards += 1
            self._cached.extend(fed)
            if prompt and self._prefixes is not None:
                self._prefixes.store(self.runner, context[:prompt], self.cache)
                prompt = 0
            go_on = True
            agreed = missed = 0
            # Row j is the draft's distribution after feed + guess[:j]; walk while it agrees.
            for j in range(len(guess) + 1):
                row = logits[j]
                if constraint is not None:
                    mask = constraint.allowed().to(row.device)
                    row = row.masked_fill(~mask, float("-inf"))
                    # Nothing allowed, or nothing allowed that the draft's head covers.
                    if not bool(torch.isfinite(row).any()):
                        go_on = False
                        break
                    masks.append(mask)
                if params.greedy:
                    # q is one-hot on the argmax: no distribution to keep.
                    best = row.argmax().view(1)
                    token = int(best)
                    confidence = float(_probability(row, best))
                else:
                    probs = logits_to_probs(row, params)
                    token = int(sample(probs, generator))
                    rows.append(probs)
                    confidence = float(probs[token])
                tokens.append(token)
                confidences.append(confidence)
                if constraint is not None:
                    constraint.consume([token])
                    if constraint.is_stopped():
                        go_on = False
                if not stops.go_on(len(tokens), confidence):
                    go_on = False
                planned = stops.planned
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
        if params.greedy:
            return Proposal(tokens=tokens, masks=masks or None)
        return Proposal(tokens=tokens, probs=torch.stack(rows), masks=masks or None)

    def _unfed(self, context: list[int]) -> tuple[list[int], int]:
        """What of ``context`` the draft's cache lacks (its cache cut back to what they share,
        at least the last token left to feed), and the prompt length to keep for later calls
        after the next forward (0: none). A first draft starts from the longest kept prefix."""
        prompt = 0
        if not self._cached and self._prefixes is not None and len(context) > 1:
            # From the longest kept prefix; the rest goes with the first draft forward.
            self.cache, reused = reuse_prefix(self.runner, context[:-1], self._prefixes)
            self._cached = list(context[:reused])
            prompt = len(context) - 1 if reused < len(context) - 1 else 0
        shared = common_prefix_length(self._cached, context)
        shared = min(shared, len(context) - 1)  # always feed at least the last token
        crop_to(self.cache, shared)
        del self._cached[shared:]
        return context[shared:], prompt

    def _drafted_on_device(
        self,
        context: list[int],
        feed: list[int],
        stops: _Stops,
        params: SamplingParams,
        generator: torch.Generator,
        vocab: torch.Tensor | None,
        prompt: int,
    ) -> Generator[ForwardRequest, torch.Tensor | None, Proposal]:
        """``propose_steps``' draft decided on the device: as many forwards as planned before
        the first token, each fed the last one's token where it lies (greedy: the argmax;
        sampled: drawn from q with the call's generator, which lives there too), the tokens and
        their confidences read in one transfer at the end. The stops the host loop makes token
        by token (the confidence threshold, a plan cut short by low confidence) are replayed on
        what was read, and the cache keeps only the tokens kept: the same tokens and q as the
        host loop, short of a plan the host would have extended after confident tokens."""
        planned = stops.planned
        start = len(self._cached)
        fed: Tokens = feed
        chosen: list[torch.Tensor] = []
        confidence: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for _ in range(planned):
            logits = yield ForwardRequest(self.runner, fed, self.cache, keep=1, vocab=vocab)
            if logits is None:
                raise RuntimeError("a draft forward request must be answered with its logits")
            self.draft_forwards += 1
            if prompt and self._prefixes is not None:
                self._prefixes.store(self.runner, context[:prompt], self.cache)
                prompt = 0
            row = logits[-1]
            if params.greedy:
                token = row.argmax().view(1)
                confidence.append(_probability(row, token))
            else:
                probs = logits_to_probs(row, params)
                token = sample(probs, generator).view(1)
                rows.append(probs)
                confidence.append(probs.gather(0, token))
            chosen.append(token)
            fed = token
        read = torch.cat([torch.cat(chosen).float(), torch.cat(confidence).float()]).tolist()
        tokens = [int(token) for token in read[:planned]]  # exact: ids stay below 2**24
        confidences = read[planned:]
        kept = next(
            (n for n in range(1, planned + 1) if not stops.go_on(n, confidences[n - 1])),
            planned,
        )
        # The cache holds the feed and every token but the last; only the kept ones stay.
        self._cached.extend([*feed, *tokens[: planned - 1]])
        valid = start + len(feed) + kept - 1
        crop_to(self.cache, valid)
        del self._cached[valid:]
        self._calibration.last = confidences[:kept]
        if params.greedy:
            return Proposal(tokens=tokens[:kept])
        return Proposal(tokens=tokens[:kept], probs=torch.stack(rows[:kept]))

    def catch_up_pays(self, context: list[int]) -> bool:
        """Whether drafting now is worth feeding the draft what it has not seen of ``context``.

        The first draft of a call prefills the prompt into the draft's cache (less what the
        prefix cache holds), and drafting after plain steps feeds their tokens; a long prompt
        makes that a cost of many steps. Drafting saves ``1 - 1 / rate`` target steps per token
        (``rate``: expected tokens per unit of cost at the call's acceptance, best draft
        length), at most over the tokens the call has left; where even that does not cover
        the catch-up (a short tool call after a long tool schema), the call decodes without
        the draft model and never pays its prefill. Without costs, a known end or planned
        lengths (a fixed k: the policy asked to draft at every step): always.

        Only the first catch-up is priced. Once the draft holds the call's context, what it
        has not seen is the few tokens since its last draft (plain steps, history drafts),
        and whether drafting pays at the call's acceptance is the schedule's question, probes
        included: pricing those catch-ups at a low acceptance (no saving at all) would turn
        the draft model off for the rest of the call after one bad start."""
        if self.costs is None or self.call_end is None or not self.plan_lengths:
            return True
        if self._cached:
            return True
        if self._declined:
            # Nothing the answer depends on improves while the draft never runs: the unseen
            # context grows with each plain step, the tokens left shrink, and the acceptance
            # stays the prior (only the draft's own drafts move it).
            return False
        if self._prefixes is not None and len(context) > 1:
            seen = self._prefixes.matched(self.runner, context[:-1])
        else:
            seen = 0
        unseen = len(context) - 1 - seen
        if unseen <= 0:
            return True
        acceptance = min(self._call_hits / self._call_trials, 0.999)
        longest = max(len(self.costs.verify) - 1, 1)
        rate = max(
            expected_tokens(acceptance, k) / self.costs.step_cost(k) for k in range(1, longest + 1)
        )
        saved_per_token = max(1.0 - 1.0 / rate, 0.0)
        left = max(self.call_end - len(context), 0)
        self._declined = left * saved_per_token < self.costs.catch_up_cost(unseen)
        return not self._declined

    def leave_cache(self) -> None:
        """At the end of the call: hand this drafter's KV to the prefix cache, so the draft's
        next call on the same conversation prefills only what is new (no copy: the call is
        over)."""
        if self._prefixes is not None and self._cached:
            self._prefixes.store(self.runner, list(self._cached), self.cache, copy=False)
            self.cache, self._cached = self.runner.new_cache(), []

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
        expected = [sum(hit**i for i in range(n + 1)) for n in range(len(guess) + 1)]
        costs = [self.costs.draft_cost(n + 1) for n in range(len(guess) + 1)]
        return guess[: most_per_cost(expected, costs)]

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
        future = min(self._call_hits / self._call_trials, 0.999)
        gains, chance = [expected], all_accepted
        for _ in range(drafted + 1, k + 1):
            chance *= future
            gains.append(gains[-1] + chance)
        costs = [self.costs.step_cost(length) for length in range(drafted, k + 1)]
        return drafted + most_per_cost(gains, costs)

    def observe(self, proposed: int, accepted: int) -> None:
        """Calibrate: the target judged the draft tokens up to the first rejected one."""
        if proposed <= 0:
            return
        self._calibration.judged(proposed, accepted)
        self._call_hits = self._call_hits * 0.95 + accepted
        self._call_trials = self._call_trials * 0.95 + accepted + (1 if accepted < proposed else 0)


def _probability(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """p(token) = 1 / sum(exp(logits - logits[token])), without building the distribution;
    ``token``: ``[1]`` on the logits' device, the result ``[1]`` there (nothing read)."""
    return torch.exp(logits - logits.gather(0, token)).sum().reciprocal().view(1)


class _Stops:
    """Where one draft ends, decided token by token: the draft's own confidence in each token
    (calibrated by what the target accepted so far) and the planned length
    (``DraftModelDrafter._planned_length``) decide whether one more token pays."""

    def __init__(self, drafter: DraftModelDrafter, k: int) -> None:
        self._drafter, self._k = drafter, k
        self._expected, self._all_accepted = 1.0, 1.0  # tokens expected; P(all pass)
        self._calibration = drafter._calibration.ratio()
        # The schedule has decided to draft: at least one token, however the plan looks.
        self.planned = max(1, drafter._planned_length(0, k, 1.0, 1.0))
        """The length the draft should reach, as planned after the tokens so far."""

    def go_on(self, drafted: int, confidence: float) -> bool:
        """After the ``drafted``-th token, drafted with ``confidence``: whether to draft more."""
        self._all_accepted *= min(confidence * self._calibration, 0.999)
        self._expected += self._all_accepted
        drafter = self._drafter
        self.planned = drafter._planned_length(drafted, self._k, self._expected, self._all_accepted)
        return confidence >= drafter.confidence_threshold and self.planned > drafted
