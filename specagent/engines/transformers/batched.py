"""The runner's batched forwards (``ModelRunner.forward_batch``): several calls' new tokens in
one model call, over their KV slots in place (``slots.SlotBatch``, compiled where measured
faster) or over ordinary caches left-padded into a temporary batch cache; a prompt runs alone;
only the rows somebody reads go through the LM head."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ...decoding.engine import Tokens, crop_to, to_device, token_rows
from .compiled import CompiledSlots, serial_forwards
from .head import Head
from .slots import SlotBatch, SlotSequence
from .tuned import KernelSet
from .views import ModelView, PrefillTwin, plain_layers

__all__ = ["ALONE_ROWS", "BatchedForwards", "OneForward", "batch_mask", "cache_for"]

OneForward = Callable[[Tokens, Any, "int | None", "torch.Tensor | None"], torch.Tensor]
"""One call's forward (``ModelRunner``'s): tokens, cache, keep, vocab -> finished logits."""


ALONE_ROWS = 32
"""A forward over this many tokens (a first step that feeds a prompt) runs alone, not in a
batch: a batch pads every call's tokens to the widest, and a prompt's width would multiply the
work of the calls' few-token verifications."""


class BatchedForwards:
    """``ModelRunner``'s forwards over several calls' sequences, and one call's over a slot
    (its step function where calls hold slots). Made of the runner's parts: what it knows of
    the model (``view``), the head its logits cover (``head``), its kernels (``kernels``),
    its prefill twin and its one-call forward (``one``, which prompts run through alone);
    ``compiled`` is set once, before the runner is handed out."""

    def __init__(
        self,
        view: ModelView,
        head: Head,
        kernels: KernelSet,
        twin: PrefillTwin | None,
        one: OneForward,
    ) -> None:
        self.view = view
        self.head = head
        self.kernels = kernels
        self.twin = twin
        self.one = one
        self.compiled: CompiledSlots | None = None
        self.gather_checked: bool | None = None
        """Whether projecting gathered hidden states equals the model's own logits (checked
        once, on the first batch; None until then)."""

    def planned(self) -> Any:
        """The kernel plan these forwards run under (none where they run compiled)."""
        return self.kernels.active(self.compiled is not None)

    @torch.inference_mode()
    def forward_batch(
        self,
        requests: Sequence[tuple[Tokens, DynamicCache]],
        keep: Sequence[int | None] | None = None,
        vocabs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """``forward`` for several sequences at once: one model call over all of them, each
        feeding its own tokens after its own cache. Returns each request's logits (``[n_i, V]``,
        or its last ``keep[i]`` positions) and appends each one's new KV to its cache, exactly as
        ``forward`` would.

        Caches differ in length and requests in token count: caches are left-padded and tokens
        right-padded into one batch, with an attention mask that hides the padding and position
        ids that continue each sequence where it stands. The batch cache is a temporary copy;
        each call's own cache stays the source of truth, so calls join and leave between steps
        freely. Caches with other layer types (sliding windows, quantised) run one by one.

        The vocabulary projection is the largest matrix product of a small model; it runs only
        over the positions somebody reads (``_gathered_logits``), not over the padding or the
        positions ``keep`` drops. ``vocabs``: each request's own ids (``forward``'s ``vocab``)."""
        keeps: list[int | None] = list(keep) if keep is not None else [None] * len(requests)
        call_vocabs: list[torch.Tensor | None] = (
            list(vocabs) if vocabs is not None else [None] * len(requests)
        )
        lengths = [int(cache.get_seq_length()) for _, cache in requests]
        placed = [(tokens, cache_for(cache, len(tokens))) for tokens, cache in requests]
        try:
            with serial_forwards():
                return self._batch(placed, keeps, call_vocabs)
        except BaseException:
            # All or nothing: a forward that ran before the failing one (a prompt run alone)
            # leaves no KV behind, so the caller may retry every request (the worker does, one
            # by one, to find the culprit) without feeding any of them twice.
            for (_, cache), length in zip(requests, lengths, strict=True):
                crop_to(cache, length)
            raise

    def _batch(
        self,
        requests: Sequence[tuple[Tokens, DynamicCache]],
        keeps: list[int | None],
        call_vocabs: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        twin = self.twin
        if len(requests) > 1:
            alone = min(ALONE_ROWS, twin.from_rows) if twin is not None else ALONE_ROWS
            long = [i for i, (tokens, _) in enumerate(requests) if len(tokens) >= alone]
            if long:  # prefills run alone (through the twin, if any); the rest as one batch
                rest = [i for i in range(len(requests)) if i not in long]
                out: dict[int, torch.Tensor] = {
                    i: self.one(*requests[i], keeps[i], call_vocabs[i]) for i in long
                }
                if rest:
                    batched = self._batch(
                        [requests[i] for i in rest],
                        [keeps[i] for i in rest],
                        [call_vocabs[i] for i in rest],
                    )
                    out.update(zip(rest, batched, strict=True))
                return [out[i] for i in range(len(requests))]
        in_slots = [i for i, (_, cache) in enumerate(requests) if isinstance(cache, SlotSequence)]
        if in_slots and len(in_slots) < len(requests):  # the pool was full for some calls
            others = [i for i in range(len(requests)) if i not in in_slots]
            out = {}
            for group in (in_slots, others):
                results = self._batch(
                    [requests[i] for i in group],
                    [keeps[i] for i in group],
                    [call_vocabs[i] for i in group],
                )
                out.update(zip(group, results, strict=True))
            return [out[i] for i in range(len(requests))]
        if in_slots:
            return self.slot_forward(requests, keeps, call_vocabs)  # type: ignore[arg-type]
        if len(requests) == 1 or not all(plain_layers(cache) for _, cache in requests):
            return [
                self.one(tokens, cache, k, v)
                for (tokens, cache), k, v in zip(requests, keeps, call_vocabs, strict=True)
            ]
        lengths = [int(cache.get_seq_length()) for _, cache in requests]
        counts = [len(tokens) for tokens, _ in requests]
        longest, widest, size = max(lengths), max(counts), len(requests)
        batch_cache = self.view.dynamic_cache()  # a temporary copy
        if longest > 0:
            template = next(c for (_, c), n in zip(requests, lengths, strict=True) if n)
            for layer in range(len(template.layers)):
                ref: Any = template.layers[layer]
                # Left-padded with zeros (masked out; garbage could be NaN and spread).
                heads, key_dim, value_dim = (
                    ref.keys.shape[1],
                    ref.keys.shape[3],
                    ref.values.shape[3],
                )
                keys = ref.keys.new_zeros((size, heads, longest, key_dim))
                values = ref.values.new_zeros((size, heads, longest, value_dim))
                for i, ((_, cache), length) in enumerate(zip(requests, lengths, strict=True)):
                    if length:
                        own: Any = cache.layers[layer]
                        keys[i, :, longest - length :] = own.keys[0, :, :length]
                        values[i, :, longest - length :] = own.values[0, :, :length]
                batch_cache.update(keys, values, layer)
        mask = torch.zeros(size, longest + widest, dtype=torch.long)
        positions = torch.zeros(size, widest, dtype=torch.long)
        for i, ((tokens, _), length) in enumerate(zip(requests, lengths, strict=True)):
            mask[i, longest - length : longest + len(tokens)] = 1
            positions[i] = torch.arange(length, length + widest)
        # Rows of the flattened [size * widest] positions whose logits are read.
        wanted = [
            (i, count - min(count, k if k is not None else count), count)
            for i, (count, k) in enumerate(zip(counts, keeps, strict=True))
        ]
        inputs = {
            "input_ids": token_rows([t for t, _ in requests], widest, self.view.device),
            "attention_mask": to_device(mask, self.view.device),
            "position_ids": to_device(positions, self.view.device),
            "use_cache": True,
        }
        with self.planned():
            all_logits = self._gathered_logits(inputs, batch_cache, wanted, widest, call_vocabs)
        results = []
        for i, ((_, cache), count) in enumerate(zip(requests, counts, strict=True)):
            results.append(self.view.finished(all_logits[i]))
            batch_layers: list[Any] = list(batch_cache.layers)
            for layer, batch_layer in enumerate(batch_layers):
                new = slice(longest, longest + count)
                cache.update(
                    batch_layer.keys[i : i + 1, :, new],
                    batch_layer.values[i : i + 1, :, new],
                    layer,
                )
        return results

    def slot_forward(
        self,
        requests: Sequence[tuple[Tokens, SlotSequence]],
        keeps: Sequence[int | None],
        vocabs: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """One forward over calls that hold slots of this runner's pool: each row's tokens at
        its own positions, its new keys and values written into its slot where they belong,
        attention over the slots in place (``slots.SlotBatch``; compiled where this runner's
        forwards run compiled and the rows are few, ``compiled.CompiledSlots``). Only the rows
        somebody reads are projected onto the vocabulary."""
        sequences = [cache for _, cache in requests]
        pool = sequences[0].pool
        counts = [len(tokens) for tokens, _ in requests]
        widest = max(counts)
        compiled = self.compiled
        with pool.lock:  # no reallocation by another thread under this forward
            ran = None
            if compiled is not None and self.gather_checked and compiled.fits(widest):
                ran = compiled.hidden(sequences, [t for t, _ in requests])
            if ran is not None:
                hidden, width = ran
                wanted = [
                    (sequence.slot, count - min(count, k if k is not None else count), count)
                    for sequence, count, k in zip(sequences, counts, keeps, strict=True)
                ]
                logits = self._projected(hidden, wanted, width, vocabs)
                for sequence, count in zip(sequences, counts, strict=True):
                    sequence.length += count
                return [self.view.finished(rows) for rows in logits]
            batch = SlotBatch(pool, sequences, widest)
            mask_dtype = self.view.mask_dtype
            mask = batch_mask(
                batch.starts,
                counts,
                widest,
                batch.kv_length,
                None if isinstance(mask_dtype, str) else mask_dtype,
            )
            inputs = {
                "input_ids": token_rows([t for t, _ in requests], widest, self.view.device),
                "attention_mask": to_device(mask, self.view.device),
                "position_ids": batch.position_index,
                "use_cache": True,
            }
            wanted = [
                (i, count - min(count, k if k is not None else count), count)
                for i, (count, k) in enumerate(zip(counts, keeps, strict=True))
            ]
            with self.planned():
                logits = self._gathered_logits(inputs, batch, wanted, widest, vocabs)
            for sequence, count in zip(sequences, counts, strict=True):
                sequence.length += count
        return [self.view.finished(rows) for rows in logits]

    def _gathered_logits(
        self,
        inputs: dict[str, Any],
        batch_cache: DynamicCache | SlotBatch,
        wanted: list[tuple[int, int, int]],
        widest: int,
        vocabs: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Logits of positions ``start:stop`` of each row ``(row, start, stop)`` in ``wanted``.

        Runs the decoder body, gathers the wanted hidden states and projects only those. Models
        whose head is more than the output embedding (logit soft-capping, scaling) would give
        other numbers, so the first batch also runs the full model and compares; on any
        difference this runner keeps using the full model's logits. With head rows, each row's
        logits cover what its ``vocabs`` entry adds to the kept rows (``Head.restricted``)."""
        view, base = self.view, self.view.body
        if base is None or self.gather_checked is False:
            out = view.model(**inputs, **{view.cache_kw: batch_cache})
            return [
                self.head.masked(out.logits[row, start:stop], vocab)
                for (row, start, stop), vocab in zip(wanted, vocabs, strict=True)
            ]
        check = self.gather_checked is None
        reference_cache: Any = None
        if check:  # a slot batch writes the same keys at the same positions again: no copy
            slots = isinstance(batch_cache, SlotBatch)
            reference_cache = batch_cache if slots else copy.deepcopy(batch_cache)
        hidden = base(**inputs, **{view.body_cache_kw: batch_cache}).last_hidden_state
        if not check:
            return self._projected(hidden, wanted, widest, vocabs)
        head = view.model.get_output_embeddings()
        pieces = list(torch.split(head(_gathered(hidden, wanted, widest)), _counts(wanted)))
        full = view.model(**inputs, **{view.cache_kw: reference_cache}).logits
        self.gather_checked = all(
            torch.allclose(piece.float(), full[row, start:stop].float(), atol=1e-3, rtol=1e-3)
            for piece, (row, start, stop) in zip(pieces, wanted, strict=True)
        )
        if not self.gather_checked:
            pieces = [full[row, start:stop] for row, start, stop in wanted]
        return [self.head.masked(piece, vocab) for piece, vocab in zip(pieces, vocabs, strict=True)]

    def _projected(
        self,
        hidden: torch.Tensor,
        wanted: list[tuple[int, int, int]],
        widest: int,
        vocabs: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Logits of positions ``start:stop`` of each row ``(row, start, stop)`` of ``hidden``
        (``[rows, widest, hidden]``): only those positions go through the head."""
        head = self.view.model.get_output_embeddings()
        gathered = _gathered(hidden, wanted, widest)
        counts = _counts(wanted)
        if self.head.rows is not None:
            flat = self.head.restricted(head, gathered, list(zip(counts, vocabs, strict=True)))
            return list(torch.split(flat, counts))
        pieces = torch.split(head(gathered), counts)
        return [self.head.masked(piece, vocab) for piece, vocab in zip(pieces, vocabs, strict=True)]


def _gathered(
    hidden: torch.Tensor, wanted: list[tuple[int, int, int]], widest: int
) -> torch.Tensor:
    """The wanted positions of ``hidden`` ``[rows, widest, H]``, one after another ``[n, H]``."""
    index = to_device(
        [row * widest + j for row, start, stop in wanted for j in range(start, stop)],
        hidden.device,
    )
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)


def _counts(wanted: list[tuple[int, int, int]]) -> list[int]:
    return [stop - start for _, start, stop in wanted]


def cache_for(cache: Any, count: int) -> Any:
    """The cache a forward of ``count`` new tokens runs on: a slot's sequence that the pool
    cannot widen for it within its bound first moves to a cache of its own
    (``SlotSequence.spill``), which it then stands for."""
    if isinstance(cache, SlotSequence):
        if cache.own is None and not cache.pool.can_hold(cache.length + count):
            cache.spill()
        if cache.own is not None:
            return cache.own
    return cache


def batch_mask(
    starts: Sequence[int], counts: Sequence[int], widest: int, kv_length: int, dtype: Any
) -> torch.Tensor:
    """``[B, 1, widest, kv_length]``: row ``b``'s query ``j`` (``j < counts[b]``) sees its own
    positions up to ``starts[b] + j``; a padding query sees the row's first position (its
    output is dropped; a row of nothing but masked keys would give NaN). ``dtype`` None: a
    boolean mask (True: attend); else additive (0 or the dtype's lowest value)."""
    start = torch.tensor(list(starts), dtype=torch.long)[:, None, None]
    count = torch.tensor(list(counts), dtype=torch.long)[:, None, None]
    query = torch.arange(widest)[None, :, None]
    key = torch.arange(kv_length)[None, None, :]
    visible = key <= start + torch.minimum(query, count - 1).clamp(min=0)
    visible = visible[:, None]
    if dtype is None:
        return visible
    zero = torch.zeros((), dtype=dtype)
    return torch.where(visible, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype))
