"""The seam between the decoding core and the engines that run forward passes.

The core (loop, drafters, acceptance, history, grammar, cost planning) asks an engine for
forwards and nothing else; how a forward runs (transformers with its caches and CPU tuning,
llama.cpp with its sequences) is the engine's own business, decided when it is loaded:

- ``KVSequence``: one call's KV on one model: how long it is, and cut back to a length.
  ``copy.deepcopy`` gives an independent sequence with the same content; dropping the last
  reference frees it. Two more operations on its sequences are the runner's, so the core edits
  no engine's cache itself: ``Runner.kept`` (what the prefix cache keeps of a sequence: a deep
  copy, or the sequence itself when its call is done with it; ``CopiedSequences`` is that
  default) and ``Runner.keep_path`` (after a token-tree forward, keep the accepted path's
  rows; only a runner whose ``inputs`` take trees does).
- ``Runner``: forwards over new tokens after a sequence, one call's (``forward``) or several
  calls' in one engine call (``forward_batch``), returning float32 logits of the rows asked for
  (``keep``), over the target's vocabulary. The new tokens are ids on the host, or ids a
  drafter chose on the device and never read (``Tokens``: a 1-D integer tensor on the runner's
  device, so the next draft step need not wait for the last one to finish). And its step
  costs: ``tune`` times forwards of given lengths (an engine that chooses how to run them by
  timing settles that choice there, once, and keeps it), ``settings`` says what it settled
  and ``restore`` takes back what an earlier process settled on this machine, keyed by
  ``speed_key``.
- ``ForwardInputs``: what a runner's forward takes beyond tokens, a sequence and ``keep``,
  declared once by the runner (``Runner.inputs``): token trees, and a vocabulary limited to its
  head's leading rows plus each call's own ids. The core sends only what a runner declares.

``specagent.engines.transformers.ModelRunner`` is the transformers engine's runner (its caches
are transformers ``Cache`` objects, which already behave as a ``KVSequence``);
``specagent.engines.llama_cpp.LlamaCppRunner`` is the llama.cpp engine's.
"""

from __future__ import annotations

import copy
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch

__all__ = [
    "CopiedSequences",
    "ForwardInputs",
    "ForwardRequest",
    "KVSequence",
    "Runner",
    "Tokens",
    "advance",
    "align_vocab",
    "crop_to",
    "cropped_length",
    "to_device",
    "token_list",
    "token_rows",
]

Tokens: TypeAlias = "list[int] | torch.Tensor"
"""New tokens for a forward: ids on the host, or a 1-D integer tensor on the runner's device
(tokens a drafter chose there; ``token_list`` reads them where an engine needs ids)."""


def token_list(tokens: Tokens) -> list[int]:
    """``tokens`` as host ids (a read from the device where they live there)."""
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


def to_device(values: Sequence[Any] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host integers (or a host tensor, its dtype kept) on ``device``, without waiting for the
    device: a plain copy from host memory synchronises a CUDA stream (every queued kernel must
    finish first), so on CUDA the values go through pinned memory and an asynchronous copy."""
    host = torch.as_tensor(
        values, dtype=values.dtype if isinstance(values, torch.Tensor) else torch.long
    )
    if host.device.type != "cpu":  # already on a device
        return host.to(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@runtime_checkable
class KVSequence(Protocol):
    """One call's KV on one model."""

    def get_seq_length(self) -> int:
        """Positions held."""
        ...

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end)."""
        ...


@dataclass(frozen=True)
class ForwardInputs:
    """The optional inputs a runner's ``forward`` takes, fixed when the runner is made."""

    trees: bool = False
    """``tree``: the new tokens form a token tree, each row's parent given (a custom attention
    mask); the runner then also keeps an accepted path (``Runner.keep_path``)."""
    head_rows: int | None = None
    """``vocab``: the logits cover only the head's first ``head_rows`` rows and each call's own
    ids (a draft's, ``decoding.vocab.CallVocabulary``); None: the whole vocabulary, and no
    ``vocab`` is sent."""


class Runner(Protocol):
    """Forwards of one model, as the decoding core asks for them."""

    model: Any
    """What runs (a transformers model, a ``LlamaCppModel``): measurements are keyed by it."""
    vocab_size: int
    """Columns of every logits tensor returned (a draft's aligned to the target's)."""
    device: torch.device
    """Where the returned logits live."""

    @property
    def inputs(self) -> ForwardInputs:
        """The optional inputs its ``forward`` takes (trees, a limited vocabulary)."""
        ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads (the prior of what a step costs, ``costs``)."""
        ...

    def speed_key(self, *parts: object) -> str:
        """A key for this runner's measured speed on this machine: what it depends on (shapes,
        dtype, the engine's settings fixed at load), not the weights; ``parts`` are added."""
        ...

    def tune(
        self, lengths: Sequence[int], *, context_tokens: int = 32, repeats: int = 2
    ) -> Generator[None, None, dict[int, float]]:
        """Seconds of one forward over each of ``lengths`` new tokens after ``context_tokens``
        (logits of every row, as a verification asks), one timing per step of the generator.
        The first time, an engine that chooses how to run its forwards by timing them settles
        that choice here; afterwards nothing changes, the forwards are only timed."""
        ...

    @property
    def settings(self) -> Mapping[str, Any]:
        """What ``tune`` settled (JSON-able; empty where the engine settles nothing)."""
        ...

    def restore(self, settings: Mapping[str, Any]) -> bool:
        """Take ``settings`` stored by an earlier process on this machine; False where they
        cannot hold now (the runner is then tuned)."""
        ...

    def new_cache(self) -> Any:
        """An empty ``KVSequence`` for a new call."""
        ...

    def reproducible(self, tokens: int) -> Runner:
        """This runner for a call whose forwards must depend on nothing other calls hold (a
        reproducible policy's; up to ``tokens`` positions): itself where a call's KV never
        shares memory with another's (transformers' caches and slots), else a runner whose
        calls get KV of their own (llama.cpp's unified pool places a call's cells wherever
        others left room, which changes the order its attention sums them in)."""
        ...

    def adopt(self, cache: Any) -> Any:
        """A kept prefix's private copy as the kind of sequence this runner's calls use."""
        ...

    def kept(self, cache: Any, copied: bool) -> Any:
        """What the prefix cache keeps of ``cache``: an independent copy, or (``copied=False``:
        its call is done with it) the sequence itself where that can be kept as it is."""
        ...

    def keep_path(self, cache: Any, start: int, path: list[int]) -> None:
        """After a token-tree forward that wrote its rows from position ``start`` (the root),
        keep the KV of the root and the accepted ``path`` (nodes), moved to follow one
        another, and drop the rest (runners whose ``inputs`` take trees only)."""
        ...

    def forward(
        self,
        input_ids: Tokens,
        cache: Any,
        keep: int | None = None,
        tree: list[int] | None = None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [n_kept, V] float32
        """Feed ``input_ids`` after ``cache``; logits ``[n_kept, V]`` (``keep``: the last rows
        only, None: all). ``tree``: each row's parent row; ``vocab``: the call's own ids beyond
        the head's rows (each only where ``inputs`` declares it)."""
        ...

    def forward_batch(
        self,
        requests: Sequence[tuple[Tokens, Any]],
        keep: Sequence[int | None] | None = None,
        vocabs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:  # each [n_kept_i, V]
        """``forward`` for several calls in one engine call, all or nothing: on failure every
        sequence is left as it was (the caller may retry each request alone). ``keep[i]`` and
        ``vocabs[i]`` are request ``i``'s ``keep`` and ``vocab`` (``vocab``: 1-D ids)."""
        ...


def token_rows(rows: Sequence[Tokens], width: int, device: torch.device) -> torch.Tensor:
    """``[len(rows), width]`` ids on ``device``, each row's tokens first, then zeros: the host
    rows in one asynchronous copy (``to_device``), the device rows placed there, none read."""
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    placed = []
    for i, tokens in enumerate(rows):
        if isinstance(tokens, torch.Tensor):
            placed.append(i)
        elif tokens:
            ids[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    ids = to_device(ids, device)
    if placed and all(len(rows[i]) == 1 for i in placed):  # a draft round: one kernel
        column = torch.cat([torch.as_tensor(rows[i]).view(1) for i in placed]).to(device)
        ids[to_device(placed, device), 0] = column
    else:
        for i in placed:
            ids[i, : len(rows[i])] = torch.as_tensor(rows[i]).to(device)
    return ids


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Make a draft's logits cover exactly the target's vocabulary: ids the target lacks are cut,
    ids only the target has (padding rows) get -inf so the draft never proposes them."""
    n = logits.shape[-1]
    if n > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - n), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def cropped_length(held: int, max_length: int) -> int | None:
    """How many of ``held`` positions ``KVSequence.crop(max_length)`` keeps (negative: drop
    that many from the end, transformers' convention); None where it keeps them all."""
    keep = held + max_length if max_length < 0 else max_length
    return keep if 0 <= keep < held else None


def crop_to(cache: KVSequence, length: int) -> None:
    """Drop cached positions beyond ``length`` (a negative crop, which every transformers
    version with ``DynamicCache.crop`` takes, and every engine's sequence)."""
    extra = int(cache.get_seq_length()) - length
    if extra > 0:
        cache.crop(-extra)


class CopiedSequences:
    """The sequence side of ``Runner`` for an engine whose sequences are kept as deep copies (or
    as themselves once their call is done) and that runs no token trees."""

    def kept(self, cache: Any, copied: bool) -> Any:
        return copy.deepcopy(cache) if copied else cache

    def keep_path(self, cache: Any, start: int, path: list[int]) -> None:
        msg = f"{type(cache).__name__} cannot keep a token tree's path: its runner takes no trees"
        raise TypeError(msg)


@dataclass
class ForwardRequest:
    """A forward a decoding step needs: ``tokens`` fed after what ``cache`` holds. The step
    continues when it is sent the logits ``[len(tokens), V]`` (``Runner.forward``)."""

    runner: Runner
    tokens: Tokens
    cache: Any
    """The call's ``KVSequence`` on ``runner``'s model."""
    keep: int | None = None
    """Logits wanted for the last ``keep`` positions only (None: all)."""
    tree: list[int] | None = None
    """The tokens form a token tree: each row's parent row (``Runner.forward``); such a
    forward runs alone, never batched with other calls'."""
    vocab: torch.Tensor | None = None
    """The call's own ids beyond a draft runner's ``head_rows`` (``vocab.CallVocabulary``)."""

    def __post_init__(self) -> None:
        inputs = self.runner.inputs
        if self.tree is not None and not inputs.trees:
            msg = f"{type(self.runner).__name__} takes no token trees (ForwardInputs.trees)"
            raise ValueError(msg)
        if self.vocab is not None and inputs.head_rows is None:
            msg = f"{type(self.runner).__name__} takes no vocabulary (ForwardInputs.head_rows)"
            raise ValueError(msg)

    def run(self) -> torch.Tensor:
        return self.runner.forward(self.tokens, self.cache, self.keep, self.tree, self.vocab)


def advance(
    steps: Generator[Any, torch.Tensor | None, Any], reply: torch.Tensor | None, *, inline: bool
) -> Any:
    """The one driver of decoding coroutines: send ``reply`` and return the next item the
    coroutine yields, running forward requests directly on the way when ``inline`` (a single
    sequence) or returning them to be batched with other calls' (the runtime's worker).
    ``StopIteration`` passes through with the coroutine's value."""
    while True:
        item = steps.send(reply)
        if inline and isinstance(item, ForwardRequest):
            reply = item.run()
            continue
        return item
