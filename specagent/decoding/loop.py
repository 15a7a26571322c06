"""The speculative decoding loop for one sequence.

``speculative_steps`` is a coroutine: every forward a step needs (each draft-model token, then
the target forward that verifies the drafts) is yielded as a ``ForwardRequest`` and its logits
come back through ``send``; then the step yields the ``DecodeEvent`` with the tokens it emitted.
The caller runs the forwards, which is how the runtime batches the forwards of many calls into
one model call per model, and decides between steps whether to go on (cancellation at the next
step). ``speculative_generate`` runs the
forwards inline for a single sequence and yields only the events. The final event carries the
finish reason and counters.

One step, with ``context`` = prompt + output so far and the target cache holding all of it but the
last token:

1. the schedule picks k; the drafter proposes up to k tokens ``x_1..x_k`` (and their q);
2. one target forward over ``[context[-1], x_1..x_k]`` gives p for k + 1 positions;
3. the acceptance rule accepts a prefix of n draft tokens and emits one more token;
4. the target cache is cropped to ``len(context) + n``; the drafter crops its own on its next call.

The first step's forward also feeds what the cache lacks of the prompt (all of it, or what a
kept prefix does not hold) before ``context[-1]``: the prefill and the first verification are
one forward, not two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .acceptance import RelaxedRule, Verdict, verify_greedy, verify_lossless, verify_relaxed
from .constrained import (
    consume_until_complete,
    joined,
    masks_and_rewind,
    one_hot,
    take_forced,
)
from .drafters.base import Drafter
from .engine import (
    ForwardRequest,
    KVSequence,
    Runner,
    advance,
    crop_to,
    to_device,
)
from .parts import Prefixes
from .prefix import reuse_prefix
from .proposal import EMPTY, DraftRequest, DraftTree, Proposal, TokenConstraint
from .sampling import SamplingParams, TokenLogprob, logits_to_probs, token_logprobs
from .schedule import FixedSchedule, Schedule
from .tree import TreeVerdict, verify_tree

__all__ = [
    "DecodeCounters",
    "DecodeEvent",
    "DecodeSteps",
    "Decoding",
    "ForwardRequest",
    "speculative_generate",
    "speculative_steps",
]

StopCheck = Callable[[list[int]], "int | None"]
"""Given the output so far, the number of tokens to keep if a stop string appeared, else None."""


@dataclass
class DecodeCounters:
    """What one call's speculation did; the runtime turns this into ``SpecStats``."""

    num_drafts: int = 0
    """Verification steps that checked at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    target_forwards: int = 0
    """Decoding forwards of the target (speculative and plain steps; not the prefill)."""
    emitted_tokens: int = 0
    divergence_sum: float = 0.0
    fell_back_to_lossless: bool = False
    num_forced_tokens: int = 0
    """Tokens a grammar forced, verified with the drafts at no drafting cost (not counted in
    ``num_draft_tokens``)."""
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    """Accepted tokens per source: ``model``, ``history``, ``grammar``."""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose target KV came from the prefix cache (not prefilled by this call)."""
    tree_steps: int = 0
    """Verification steps that checked a token tree (several drafts in one forward)."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def divergence(self) -> float:
        return self.divergence_sum / self.emitted_tokens if self.emitted_tokens else 0.0

    def record(
        self,
        proposed: int,
        verdict: Verdict,
        forced: int = 0,
        forced_after: int = 0,
        source: str = "model",
    ) -> int:
        """Count a step that verified ``forced`` grammar tokens, ``proposed`` drafted ones and
        ``forced_after`` more grammar tokens; returns how many drafted tokens were accepted."""
        self.target_forwards += 1
        self.emitted_tokens += verdict.num_accepted + 1
        self.divergence_sum += sum(verdict.divergences)
        n = verdict.num_accepted
        accepted = min(max(n - forced, 0), proposed)
        if forced or forced_after:
            self.num_forced_tokens += forced + forced_after
            after = min(max(n - forced - proposed, 0), forced_after)
            self._credit("grammar", min(n, forced) + after)
        if proposed:
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            self._credit(source, accepted)
            if len(self.accepted_per_position) < proposed:
                self.accepted_per_position.extend(
                    [0] * (proposed - len(self.accepted_per_position))
                )
            for i in range(accepted):
                self.accepted_per_position[i] += 1
        return accepted

    def record_tree(self, nodes: int, verdict: TreeVerdict) -> None:
        """Count a step that verified a token tree of ``nodes`` draft tokens (every draft's,
        a shared prefix once), crediting each accepted token to the draft that won it."""
        self.target_forwards += 1
        self.tree_steps += 1
        accepted = verdict.num_accepted
        self.emitted_tokens += accepted + 1
        self.num_drafts += 1
        self.num_draft_tokens += nodes
        self.num_accepted_tokens += accepted
        for source in verdict.sources:
            self._credit(source, 1)
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def _credit(self, source: str, accepted: int) -> None:
        self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + accepted


@dataclass
class DecodeEvent:
    """Tokens emitted by one step; ``finish_reason`` is set on the last event of a call."""

    token_ids: list[int]
    counters: DecodeCounters
    finish_reason: str | None = None
    """``"stop"`` (EOS or a stop string) or ``"length"`` (max_new_tokens or the context window)."""
    output_ids: list[int] | None = None
    """On the last event: the whole output, cut before any stop string or EOS."""
    logprobs: list[TokenLogprob] | None = None
    """Each of ``token_ids``' log-probability under the target (``Decoding.logprobs``)."""


DecodeSteps = Generator["ForwardRequest | DecodeEvent", "torch.Tensor | None", None]


def speculative_generate(
    target: Runner, prompt_ids: Sequence[int], **options: Any
) -> Iterator[DecodeEvent]:
    """``speculative_steps`` with every forward run inline: one event per step (``options``:
    the fields of ``Decoding``)."""
    steps = speculative_steps(target, prompt_ids, Decoding(**options))
    try:
        while True:
            yield advance(steps, None, inline=True)
    except StopIteration:
        return
    finally:
        steps.close()


@dataclass(frozen=True)
class Decoding:
    """How one call decodes (``speculative_steps``): its sampling, budget and ends, its drafts,
    its acceptance rule, its grammar, and where its prefixes are kept."""

    params: SamplingParams
    generator: torch.Generator
    """The call's own random stream (sampling, and the acceptance tests)."""
    max_new_tokens: int
    drafter: Drafter | None = None
    schedule: Schedule | None = None
    """How many tokens the drafter is asked for each step (None: no drafts)."""
    rule: RelaxedRule | None = None
    """None: lossless."""
    max_divergence: float | None = None
    """With a ``rule``: once the running mean divergence exceeds it, the rest of the call is
    verified losslessly."""
    eos_token_ids: Sequence[int] = ()
    stop_check: StopCheck | None = None
    max_context: int | None = None
    constraint: TokenConstraint | None = None
    """A grammar over the output: it masks the draft's and the target's distributions at
    every position, so exactness holds with respect to the constrained target."""
    prefixes: Prefixes | None = None
    """Where the KV of prefixes seen by earlier calls is reused from, and this call's (prompt
    and output) kept when it finishes."""
    logprobs: int | None = None
    """Each emitted token's log-probability under the target, read from the verification
    forward that accepted it, with this many most likely alternatives (None: none)."""


def speculative_steps(target: Runner, prompt_ids: Sequence[int], how: Decoding) -> DecodeSteps:
    """Generate up to ``how.max_new_tokens`` after ``prompt_ids``: per step, a forward request,
    then (after the logits are sent) the step's event."""
    params, generator, max_new_tokens = how.params, how.generator, how.max_new_tokens
    drafter, rule, constraint, prefixes = how.drafter, how.rule, how.constraint, how.prefixes
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    schedule = how.schedule or FixedSchedule(0)
    limit = how.max_context if how.max_context is not None else math.inf
    eos = set(how.eos_token_ids)
    counters = DecodeCounters()
    context = list(prompt_ids)
    output: list[int] = []
    # The cache holds everything but the last token, which every step feeds first. It starts
    # from the prompt's longest kept prefix; the rest of the prompt (``unfed``) goes into the
    # first step's forward, before the last token and the drafts: the prefill and the first
    # verification in one forward, as transformers' assisted generation does, not two (a
    # single-token step costs nearly what a 10-token one does on a CPU). Drafting never reads
    # the target's cache, and the first token waits for the first verification either way.
    cache, counters.cached_prompt_tokens = reuse_prefix(target, context[:-1], prefixes)
    unfed = context[counters.cached_prompt_tokens : -1]

    while True:
        # Room: every step writes k + 1 positions after the context and emits up to k + 1 tokens.
        room = min(max_new_tokens - len(output), limit - len(context))
        forced = take_forced(constraint, int(min(room - 1, 1 << 30)))
        room -= len(forced.tokens)
        k = schedule.next_k(int(min(room - 1, 1 << 30))) if drafter is not None else 0
        complete = constraint is not None and constraint.is_stopped()  # forced to the end
        if k > 0 and drafter is not None and not complete:
            drafted_from = [*context, *forced.tokens]
            ask = DraftRequest(drafted_from, k, params, generator, constraint)
            proposal = yield from drafter.propose_steps(ask)
        else:
            proposal = EMPTY
        proposed = len(proposal.tokens)
        tree = proposal.tree
        if tree is not None and rule is None and constraint is None and not forced.tokens:
            if unfed:  # a tree's mask covers the cache and the tree: the prompt goes first
                yield ForwardRequest(target, unfed, cache, keep=1)
                unfed = _kept(prefixes, target, context, cache)
            # Several drafts in one forward (``tree.py``): the accepted path and one more token.
            judged, logits = yield from _tree_step(target, tree, context, cache, params, generator)
            counters.record_tree(len(tree), judged)
            schedule.observe(proposed, tree.accepted_of(0, judged.path))
            if drafter is not None:
                drafter.observe_tree(tree, judged.path)
            new = [*(tree.tokens[node] for node in judged.path), judged.next_token]
            rows = [0, *(node + 1 for node in judged.path)]  # the row that predicted each
        else:
            tail = take_forced(constraint, int(min(room - 1 - proposed, 1 << 30)))
            step = joined(forced, proposal, tail)
            verdict, logits = yield from _chain_step(
                target, step, unfed, context, cache, constraint, prefixes, params, rule, generator
            )
            unfed = []  # fed with the first forward, and kept for later calls
            accepted = counters.record(
                proposed, verdict, len(forced.tokens), len(tail.tokens), proposal.source
            )
            schedule.observe(proposed, accepted)
            if drafter is not None:
                drafter.observe(proposed, accepted)
            new = [*step.tokens[: verdict.num_accepted], verdict.next_token]
            rows = list(range(len(new)))
        bound = how.max_divergence
        if rule is not None and bound is not None and counters.divergence > bound:
            rule = None
            counters.fell_back_to_lossless = True

        new, finish = _emit(new, output, context, eos, max_new_tokens, constraint, how.stop_check)
        logprobs = None
        if how.logprobs is not None:  # ``new`` is what the step's rows predicted, cut short
            logprobs = token_logprobs(logits, rows, new, how.logprobs)
        if finish is None and (len(output) >= max_new_tokens or len(context) >= limit):
            finish = "length"
        if finish is not None:
            if prefixes is not None:
                _keep_for_later(prefixes, target, cache, context, drafter)
            yield DecodeEvent(new, counters, finish, list(output), logprobs)
            return
        yield DecodeEvent(new, counters, logprobs=logprobs)


def _chain_step(
    target: Runner,
    step: Proposal,
    unfed: list[int],
    context: list[int],
    cache: KVSequence,
    constraint: TokenConstraint | None,
    prefixes: Prefixes | None,
    params: SamplingParams,
    rule: RelaxedRule | None,
    generator: torch.Generator,
) -> Generator[ForwardRequest, torch.Tensor | None, tuple[Verdict, torch.Tensor]]:
    """One forward over the prompt's unfed rest (first step only), the last token and the
    step's tokens, each row masked by the grammar, verified; the cache cut to what was
    accepted. Returns the verdict and the (masked) logits it was given."""
    masks = masks_and_rewind(constraint, step) if constraint is not None else None
    rows = len(step.tokens) + 1
    logits = yield ForwardRequest(  # [k+1, V]
        target, [*unfed, context[-1], *step.tokens], cache, keep=rows if unfed else None
    )
    if logits is None:
        raise RuntimeError("a forward request must be answered with its logits")
    if unfed:
        _kept(prefixes, target, context, cache)
    if masks is not None:
        logits = logits.masked_fill(~to_device(masks, logits.device), float("-inf"))
    verdict = _verify(step, logits, params, rule, generator)
    crop_to(cache, len(context) + verdict.num_accepted)
    return verdict, logits


def _tree_step(
    target: Runner,
    tree: DraftTree,
    context: list[int],
    cache: KVSequence,
    params: SamplingParams,
    generator: torch.Generator,
) -> Generator[ForwardRequest, torch.Tensor | None, tuple[TreeVerdict, torch.Tensor]]:
    """One forward over the last token and the tree's nodes (its mask and positions), the walk
    down the tree, and the accepted path's KV kept (``Runner.keep_path``). Returns the
    verdict and the tree's logits (row 0: the last token's; row ``n + 1``: node ``n``'s)."""
    logits = yield ForwardRequest(
        target, [context[-1], *tree.tokens], cache, tree=tree.row_parents()
    )
    if logits is None:
        raise RuntimeError("a forward request must be answered with its logits")
    probs = None if params.greedy else logits_to_probs(logits, params)
    judged = verify_tree(tree, logits, params.greedy, probs, generator)
    target.keep_path(cache, len(context) - 1, judged.path)
    return judged, logits


def _emit(
    new: list[int],
    output: list[int],
    context: list[int],
    eos: set[int],
    max_new_tokens: int,
    constraint: TokenConstraint | None,
    stop_check: StopCheck | None,
) -> tuple[list[int], str | None]:
    """The step's tokens that the call emits, appended to ``output`` and ``context``, and why
    the call stops there: ``"stop"`` at an end token, a complete grammar or a stop string (the
    output cut before it), None to go on (the caller checks the length)."""
    finish: str | None = None
    for i, token in enumerate(new):
        if token in eos:
            new, finish = new[:i], "stop"
            break
    new = new[: max_new_tokens - len(output)]
    if constraint is not None:
        new = consume_until_complete(constraint, new)
        if constraint.is_stopped():
            finish = "stop"
    output.extend(new)
    context.extend(new)
    if finish is None and stop_check is not None:
        keep = stop_check(output)
        if keep is not None:
            del output[keep:]
            finish = "stop"
    return new, finish


def _kept(
    prefixes: Prefixes | None, target: Runner, context: list[int], cache: KVSequence
) -> list[int]:
    """After the forward that fed the rest of the prompt: keep the prompt's KV for later calls
    (a concurrent call with the same prompt, or this one's next turn should it fail); returns
    what is left unfed (nothing)."""
    if prefixes is not None:
        prefixes.store(target, context[:-1], cache)
    return []


def _keep_for_later(
    prefixes: Prefixes,
    target: Runner,
    cache: KVSequence,
    context: list[int],
    drafter: Drafter | None,
) -> None:
    """Hand the finished call's KV (prompt and output) to ``prefixes``: an agent's next turn
    resends this conversation and prefills only what it adds. The cache is not used again, so it
    is kept without a copy; the drafter leaves its own the same way."""
    crop_to(cache, len(context) - 1)  # the cache may hold accepted tokens cut at a stop
    prefixes.store(target, context[:-1], cache, copy=False)
    if drafter is not None:
        drafter.leave_cache()


def _verify(
    proposal: Proposal,
    logits: torch.Tensor,
    params: SamplingParams,
    rule: RelaxedRule | None,
    generator: torch.Generator,
) -> Verdict:
    tokens, q = proposal.tokens, proposal.probs
    draft = to_device(tokens, logits.device)
    if params.greedy:
        return verify_greedy(draft, logits, rule=rule, generator=generator)
    p = logits_to_probs(logits, params)  # [k+1, V]
    if q is None:  # deterministic proposal: q is one-hot on the proposed tokens
        q = one_hot(tokens, p)
    if rule is None:
        return verify_lossless(draft, q, p, generator)
    return verify_relaxed(draft, q, p, rule, generator)
