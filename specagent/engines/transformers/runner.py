"""The transformers engine's runner: forwards of a Hugging Face causal LM over a call's
transformers cache, single and batched, with the tuning its model was loaded with.

A call keeps one transformers cache per model; after a verification rejects draft tokens the
core crops it back (``decoding.engine.crop_to``), so no step recomputes the prefix. What the
runner does beyond a plain forward is settled once and then fixed (``tuning``): the linear
kernels per forward length (``kernels``), a draft's head rows (``head``), compiled forwards
over the KV slots (``compiled``), a draft's prefill twin in another dtype
(``precision``). The helpers here also hide the one API difference that matters across
transformers versions: the cache keyword (``cache=`` in new releases, ``past_key_values=`` in
older ones).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ...decoding.costs import forward_timer, time_lengths
from ...decoding.engine import (
    Tokens,
    align_vocab,
    crop_to,
    to_device,
    token_list,
    token_rows,
)
from ...decoding.proposal import row_depths
from ...decoding.tree import tree_mask
from .attention import choose_attention, is_sdpa
from .compiled import CompiledSlots, serial_forwards
from .head import restricted_logits
from .kernels import LinearPlan, PackedWeights, kernel_choice_steps
from .keys import model_key
from .quantized import Int8Linear
from .slots import SlotBatch, SlotPool, SlotSequence, batch_mask, slot_shapes

__all__ = [
    "ALONE_ROWS",
    "PREFILL_LENGTHS",
    "ModelRunner",
    "PrefillTwin",
    "cache_keyword",
    "decoder_body",
    "early_exit_view",
]


PREFILL_LENGTHS = (48, 96, 192)
"""Longer forwards, timed once each way for the kernel choice only: prompt prefills (and the
draft's catch-up after plain steps) run through the same linear layers. Past the last one,
torch's kernels."""

ALONE_ROWS = 32
"""A forward over this many tokens (a first step that feeds a prompt) runs alone, not in a
batch: a batch pads every call's tokens to the widest, and a prompt's width would multiply the
work of the calls' few-token verifications."""


@functools.lru_cache(maxsize=64)
def _forward_params(model_type: Any) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def cache_keyword(model_type: Any) -> str:
    """The forward keyword that takes the KV cache: ``cache`` in new transformers releases,
    ``past_key_values`` in older ones."""
    return "cache" if "cache" in _forward_params(model_type) else "past_key_values"


@dataclass(frozen=True)
class PrefillTwin:
    """A copy of a runner's model in another dtype, for its forwards over ``from_rows`` tokens
    or more: on a CPU without native bf16, a bf16 draft decodes single tokens faster than in
    float32 but prefills a prompt several times slower; with AMX, a float32 draft's single
    tokens can cost what bf16's do while its long forwards cost twice as much (``precision``).
    Its KV is cast into the runner's own cache, so every later forward continues in the model's
    dtype. Only for a draft: a draft's numbers never touch losslessness, a target's define it."""

    model: PreTrainedModel
    from_rows: int


class ModelRunner:
    """Runs one causal LM forward over new tokens with its cache, returning float32 logits.

    ``forward`` runs one call's sequence, ``forward_batch`` several at once. ``logits_to_keep``
    avoids computing the vocabulary projection for prompt positions nobody reads.

    How the forwards run is decided by the engine and then fixed: ``head_rows`` and the
    ``prefill_twin`` when the runner is made, the compiled step by ``build_runner`` before the
    runner is handed out, the linear kernels by the runner's first ``tune`` (or ``restore`` of
    an earlier machine's choice). Nothing outside the engine sets any of them, and once
    settled they do not change: a later ``tune`` only times them.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int | None = None,
        *,
        kernels: LinearPlan | None = None,
        packed: PackedWeights | None = None,
        prefill_twin: PrefillTwin | None = None,
        head_rows: int | None = None,
        always: Sequence[int] = (),
        slots: bool = False,
    ) -> None:
        self.model = model
        self.prefill_twin = prefill_twin
        """Where long forwards run in another dtype (``PrefillTwin``; None: all in the model's)."""
        self.attention = choose_attention(model)
        """The model's attention (``attention.choose_attention``: sdpa's, or sdpa over grouped
        key/value heads in place where that measured faster for masked forwards)."""
        if prefill_twin is not None:
            choose_attention(prefill_twin.model)
        self._dtype = next(model.parameters()).dtype
        self._kernels = kernels or LinearPlan()
        self._settled = kernels is not None
        twin = [prefill_twin.model] if prefill_twin is not None else []
        self._linears = tuple(
            m for each in [model, *twin] for m in each.modules() if type(m) is nn.Linear
        )
        """The models' linear modules, which the kernel plan reroutes (``_planned``)."""
        self._packed: PackedWeights | None = packed if self._kernels.packed_rows else None
        params = _forward_params(type(model))  # type: ignore[arg-type]
        self._cache_kw = cache_keyword(type(model))
        self._has_logits_to_keep = "logits_to_keep" in params
        head = model.get_output_embeddings()
        own_vocab = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        self.vocab_size = vocab_size or own_vocab
        """Size of the logits this runner returns (a draft's are aligned to the target's)."""
        self.device = next(model.parameters()).device
        self._body = decoder_body(model)
        body = self._body
        self._base_cache_kw = cache_keyword(type(body)) if body is not None else "past_key_values"
        self._gather_checked: bool | None = None
        """Whether projecting gathered hidden states equals the model's own logits (checked
        once, on the first batch; None until then)."""
        self._compiled: CompiledSlots | None = None
        self._head_rows: int | None = None
        self._head_always = torch.tensor([], dtype=torch.long)
        if head_rows is not None:
            self._use_head_rows(head_rows, always)
        shapes = slot_shapes(model.config) if slots else None
        self._pool: SlotPool | None = None
        if shapes is not None and self._body is not None:
            layers, kv_heads, head_dim = shapes
            self._pool = SlotPool(
                layers,
                kv_heads,
                head_dim,
                dtype=self._dtype,
                device=self.device,
                max_bytes=_slot_budget(self.device),
            )

    @property
    def kernels(self) -> LinearPlan:
        """Which linear-layer kernels this runner's forwards use (``kernels.LinearPlan``; empty:
        torch's own), for the runner's own forwards only (``LinearPlan.active``)."""
        return self._kernels

    @property
    def packed(self) -> PackedWeights | None:
        """The model's weights packed for oneDNN, where the plan's ``packed_rows`` read them
        (``kernels.PackedWeights``; None: not packed)."""
        return self._packed

    @property
    def compiled(self) -> CompiledSlots | None:
        """The compiled few-token forwards over this runner's KV slots, where they measured
        faster (``compiled.choose_compiled_step``); None: eager forwards."""
        return self._compiled

    @property
    def head_rows(self) -> int | None:
        """A draft's logits cover only its head's first ``head_rows`` rows, the always-kept ids
        and each request's own ids (``vocab``), projected onto those alone; -inf elsewhere
        (``head``). None: the whole vocabulary."""
        return self._head_rows

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parameters its forwards read (an early-exit view: its layers only)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def settled(self) -> bool:
        """Whether the linear kernels are chosen (by ``tune`` or ``restore``) and fixed."""
        return self._settled

    def speed_key(self, *parts: object) -> str:
        """The model's shape, dtype and device (``keys.model_key``: not its weights), and
        what this runner fixed at load: a compiled step, a prefill twin, head rows."""
        own: list[object] = []
        if self.compiled is not None:
            own.append("compiled")
        if self.prefill_twin is not None:
            own.append(f"twin-from-{self.prefill_twin.from_rows}")
        if self.head_rows is not None:
            own.append(f"head-rows-{self.head_rows}")
        return model_key(self.model, *parts, *own)

    def tune(
        self,
        lengths: Sequence[int],
        *,
        context_tokens: int = 32,
        repeats: int = 2,
        prefill_lengths: Sequence[int] | None = None,
    ) -> Generator[None, None, dict[int, float]]:
        """Time forwards over each of ``lengths`` rows. The first time, choose each length's
        linear kernels on the way (torch's, the transposed form, or packed weights where the
        machine can pack them and has the memory; also at ``prefill_lengths``, by default
        ``PREFILL_LENGTHS`` past the longest, since prompts run through the same layers:
        ``kernels.kernel_choice_steps``) and keep that plan; the packed copy is dropped where
        no length chose it. Once settled, the plan only runs and is timed. A runner whose
        forwards run compiled keeps torch's kernels (``_planned``) and only times."""
        if self.compiled is not None and not self._settled:
            self._settle(LinearPlan(), None)
        if self._settled:
            return (
                yield from time_lengths(
                    self, lengths, context_tokens=context_tokens, repeats=repeats
                )
            )
        timer = forward_timer(self, context_tokens=context_tokens, repeats=repeats)
        prefill_timer = forward_timer(self, context_tokens=context_tokens, repeats=1, keep=1)
        wanted = set(lengths)

        def time_forward(n: int, plan: LinearPlan) -> float:
            before = self._kernels
            self._kernels = plan
            try:
                return timer(n) if n in wanted else prefill_timer(n)
            finally:
                self._kernels = before

        if prefill_lengths is None:
            prefill_lengths = [n for n in PREFILL_LENGTHS if n > max(wanted)]
        prefills = [n for n in prefill_lengths if n not in wanted]
        packed = PackedWeights.of(self.model) if self.device.type == "cpu" else None
        self._packed = packed
        plan, seconds = yield from kernel_choice_steps(
            time_forward, sorted(wanted) + prefills, packed=packed is not None
        )
        self._settle(plan, packed)
        return {n: t for n, t in seconds.items() if n in wanted}

    @property
    def settings(self) -> dict[str, Any]:
        """The settled kernel plan: its transposed and packed row counts."""
        return {
            "transposed_rows": sorted(self._kernels.transposed_rows),
            "packed_rows": sorted(self._kernels.packed_rows),
        }

    def restore(self, settings: Mapping[str, Any]) -> bool:
        """Take a plan an earlier process settled (``settings``). Refused where it cannot hold
        (packed rows, and the weights cannot be packed now: memory taken) and, once this runner
        has settled, unless it is the same plan."""
        try:
            plan = LinearPlan(
                transposed_rows=frozenset(int(n) for n in settings.get("transposed_rows", ())),
                packed_rows=frozenset(int(n) for n in settings.get("packed_rows", ())),
            )
        except (TypeError, ValueError):
            return False
        if self._settled:
            return plan == self._kernels
        packed = PackedWeights.of(self.model) if plan.packed_rows else None
        if plan.packed_rows and packed is None:
            return False
        self._settle(plan, packed)
        return True

    def _settle(self, plan: LinearPlan, packed: PackedWeights | None) -> None:
        self._kernels = plan
        self._packed = packed if plan.packed_rows else None  # its memory back where unused
        self._settled = True

    def _use_compiled(self, compiled: CompiledSlots | None) -> None:
        """The compiled-forwards decision (``compiled.choose_compiled_step``), made before the
        runner is handed out (``tuning.build_runner``)."""
        self._compiled = compiled
        if self._pool is not None:  # a pool shrunk back would compile every bucket again
            self._pool.shrinks = compiled is None

    def _use_head_rows(self, rows: int, always: Sequence[int]) -> None:
        """Project this runner's logits onto the head's first ``rows`` rows, the ``always``
        ids (end of sequence) and each request's own ids (``vocab``). Only for a draft: a
        target's logits define the output. Kept only where the head is a plain ``nn.Linear``
        or ``Int8Linear`` over the decoder body's last hidden state (checked on a short
        forward against the model's own logits) and ``rows`` is fewer than it has; elsewhere
        the whole head stays (``head_rows`` None)."""
        head = self.model.get_output_embeddings()
        if self._body is None or not isinstance(head, nn.Linear | Int8Linear):
            return
        vocab = int(head.weight.shape[0])
        if not 0 < rows < vocab:
            return
        ids = torch.arange(1, 9, device=self.device)[None] % vocab
        with torch.inference_mode():
            full = self.model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = self._body(input_ids=ids, use_cache=False).last_hidden_state[0]
            projected = head(hidden).float()
        if not torch.allclose(projected, full, atol=1e-3, rtol=1e-3):
            return
        self._head_rows = rows
        self._head_always = torch.tensor(
            sorted({int(i) for i in always if rows <= int(i) < vocab}), dtype=torch.long
        )

    def _restricted(
        self, head: nn.Module, hidden: torch.Tensor, pieces: list[tuple[int, torch.Tensor | None]]
    ) -> torch.Tensor:
        assert self.head_rows is not None
        return restricted_logits(head, hidden, self.head_rows, self._head_always, pieces)

    def _masked(self, logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """Full logits cut to what ``_restricted`` would cover (paths that run the whole
        head: a compiled step, a model whose gathered projection differs)."""
        if self.head_rows is None:
            return logits
        kept = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        kept[: self.head_rows] = True
        kept[to_device(self._head_always, logits.device)] = True
        if vocab is not None:
            kept[to_device(vocab, logits.device)] = True
        return logits.masked_fill(~kept, float("-inf"))

    def _planned(self) -> contextlib.AbstractContextManager[None]:
        """The context this runner's forwards run in: its kernel plan over its models' linear
        modules. A runner whose forwards run compiled has none (inductor picks the kernels, and
        a plan's per-length routing would break the compiled graphs)."""
        if self.compiled is not None:
            return contextlib.nullcontext()
        return self.kernels.active(self.packed, self._linears)

    @property
    def takes_trees(self) -> bool:
        """Whether ``forward`` can run a token tree: the model's attention takes a custom
        mask (eager or sdpa)."""
        return self._mask_dtype() != "other"

    def _mask_dtype(self) -> torch.dtype | str | None:
        """What a custom attention mask is for this model's attention: additive in the
        model's dtype (eager), boolean (sdpa: None), or "other" (no custom mask)."""
        implementation = getattr(self.model.config, "_attn_implementation", None) or "eager"
        if implementation == "eager":
            return self._dtype
        return None if is_sdpa(implementation) else "other"

    @property
    def slots(self) -> SlotPool | None:
        """The pool of KV slots this runner's calls hold (``slots``), None: each call has an
        ordinary transformers cache."""
        return self._pool

    def compiler(self, backend: Any = "inductor") -> CompiledSlots:
        """Compiled forwards over this runner's KV slots (each shape compiled at its first
        use); only for a runner with slots."""
        if self._pool is None or self._body is None:
            raise ValueError("compiled forwards run over KV slots; this runner has none")
        mask_dtype = self._mask_dtype()
        if isinstance(mask_dtype, str):
            raise ValueError("compiled forwards need an attention that takes a custom mask")
        return CompiledSlots(
            self._body,
            self._pool,
            cache_kw=self._base_cache_kw,
            mask_dtype=mask_dtype,
            backend=backend,
        )

    def new_cache(self) -> DynamicCache:
        """An empty cache: a slot of this runner's pool where it has one and a slot is free,
        else an ordinary cache."""
        if self._pool is not None:
            sequence = self._pool.acquire()
            if sequence is not None:
                return sequence  # type: ignore[return-value]
        return self._dynamic_cache()

    def reproducible(self, tokens: int) -> ModelRunner:
        """Itself: a call's KV (a slot, or a cache of its own) never shares memory with
        another call's, and a reproducible call's forwards run alone (``decoding.engine``)."""
        return self

    def _dynamic_cache(self) -> DynamicCache:
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    def adopt(self, cache: DynamicCache) -> DynamicCache:
        """``cache`` (a kept prefix's private copy) as the kind of cache this runner's calls
        use: copied into a slot where this runner's calls hold slots."""
        if self._pool is None or not self._pool.can_hold(int(cache.get_seq_length())):
            return cache
        sequence = self._pool.acquire()
        if sequence is None:
            return cache
        self._pool.fill(sequence, cache)
        return sequence  # type: ignore[return-value]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tokens,
        cache: DynamicCache,
        keep: int | None = None,
        tree: list[int] | None = None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed ``input_ids`` after what ``cache`` holds; returns logits ``[n_kept, V]``.

        ``keep`` = how many trailing positions need logits (None: all of them). ``tree``: the
        rows form a token tree, each row's parent row given (-1: the root, which follows the
        cache); each row then sees the cache and its own ancestors, at its depth's position
        (``tree.py``; all rows' logits are returned). ``vocab``: the call's own ids beyond
        ``head_rows`` (``vocab.CallVocabulary``; ignored without ``head_rows``)."""
        cache = _placed(cache, len(input_ids))
        with serial_forwards(), self._planned():
            if tree is not None:
                rows = token_list(input_ids)
                return self._masked(self._tree_forward(rows, cache, tree), vocab)
            return self._forward(input_ids, cache, keep, vocab)

    def _tree_forward(
        self, input_ids: list[int], cache: DynamicCache, parents: list[int]
    ) -> torch.Tensor:
        if len(parents) != len(input_ids):
            raise ValueError(f"a tree of {len(input_ids)} rows needs as many parents")
        if isinstance(cache, SlotSequence):
            return self._slot_tree_forward(input_ids, cache, parents)
        length = int(cache.get_seq_length())
        width = length + len(input_ids)
        implementation = getattr(self.model.config, "_attn_implementation", None) or "eager"
        dtype = self._dtype if implementation == "eager" else None  # eager adds; sdpa selects
        mask = tree_mask(parents, length, dtype, width)
        depths = row_depths(parents)
        kwargs: dict[str, Any] = {
            self._cache_kw: cache,
            "use_cache": True,
            "attention_mask": to_device(mask, self.device),
            "position_ids": to_device([[length + d for d in depths]], self.device),
            "cache_position": torch.arange(length, length + len(input_ids), device=self.device),
        }
        ids = token_rows([input_ids], len(input_ids), self.device)
        return self._finished(self.model(input_ids=ids, **kwargs).logits[0])

    def _slot_tree_forward(
        self, input_ids: list[int], cache: SlotSequence, parents: list[int]
    ) -> torch.Tensor:
        """A token tree after a slot: its rows written at the slot's next positions, each at
        its depth's position for the rotary embedding, seeing the slot's positions and its own
        ancestors (``tree.tree_mask``); ``SlotSequence.keep_path`` keeps the accepted path."""
        assert self._pool is not None
        length, rows = cache.length, len(input_ids)
        with self._pool.lock:  # no reallocation by another thread under this forward
            batch = SlotBatch(self._pool, [cache], rows)
            mask_dtype = self._mask_dtype()
            mask = tree_mask(parents, length, None if isinstance(mask_dtype, str) else mask_dtype)
            depths = row_depths(parents)
            kwargs: dict[str, Any] = {
                self._cache_kw: batch,
                "use_cache": True,
                "attention_mask": to_device(mask, self.device),
                "position_ids": to_device([[length + d for d in depths]], self.device),
            }
            ids = token_rows([input_ids], rows, self.device)
            logits = self.model(input_ids=ids, **kwargs).logits[0]
            cache.length += rows
        return self._finished(logits)

    def _forward(
        self,
        input_ids: Tokens,
        cache: DynamicCache,
        keep: int | None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        twin = self.prefill_twin
        if twin is not None and len(input_ids) >= twin.from_rows:
            return self._twin_forward(twin.model, input_ids, cache, keep, vocab)
        if isinstance(cache, SlotSequence):
            return self._slot_forward([(input_ids, cache)], [keep], [vocab])[0]
        return self._run(self.model, input_ids, cache, keep, vocab)

    def _run(
        self,
        model: PreTrainedModel,
        input_ids: Tokens,
        cache: DynamicCache,
        keep: int | None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward of ``model`` over ``input_ids`` after ``cache``: the kept logits."""
        ids = token_rows([input_ids], len(input_ids), self.device)
        body = self._body if model is self.model else decoder_body(model)
        if self.head_rows is not None and body is not None:
            kw = {self._base_cache_kw: cache, "use_cache": True}
            hidden = body(input_ids=ids, **kw).last_hidden_state[0]
            if keep is not None:
                hidden = hidden[-keep:] if keep > 0 else hidden[:0]
            head = model.get_output_embeddings()
            return self._finished(self._restricted(head, hidden, [(hidden.shape[0], vocab)]))
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if keep is not None and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        logits = model(input_ids=ids, **kwargs).logits[0]
        if keep is not None:
            logits = logits[-keep:] if keep > 0 else logits[:0]
        return self._finished(logits)

    def _finished(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits as every caller gets them: the target's vocabulary, float32."""
        if logits.shape[-1] != self.vocab_size:
            logits = align_vocab(logits, self.vocab_size)
        return logits.float()

    def _twin_forward(
        self,
        twin: PreTrainedModel,
        input_ids: Tokens,
        cache: DynamicCache,
        keep: int | None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``_forward`` through ``twin``: the cached KV cast to its dtype, the new KV cast back
        and appended to ``cache``."""
        length = int(cache.get_seq_length())
        dtype = next(twin.parameters()).dtype
        held_cache: Any = cache.kept_copy() if isinstance(cache, SlotSequence) else cache
        temp = DynamicCache()
        if length:
            for index, layer in enumerate(held_cache.layers):
                held: Any = layer
                temp.update(
                    held.keys[:, :, :length].to(dtype), held.values[:, :, :length].to(dtype), index
                )
        logits = self._run(twin, input_ids, temp, keep, vocab)
        if isinstance(cache, SlotSequence):
            cache.pool.fill(cache, temp, start=length)
            return logits
        for index, layer in enumerate(temp.layers):
            new: Any = layer
            cache.update(
                new.keys[:, :, length:].to(self._dtype),
                new.values[:, :, length:].to(self._dtype),
                index,
            )
        return logits

    def _slot_forward(
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
        assert self._pool is not None
        sequences = [cache for _, cache in requests]
        counts = [len(tokens) for tokens, _ in requests]
        widest = max(counts)
        compiled = self.compiled
        with self._pool.lock:  # no reallocation by another thread under this forward
            ran = None
            if compiled is not None and self._gather_checked and compiled.fits(widest):
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
                return [self._finished(rows) for rows in logits]
            batch = SlotBatch(self._pool, sequences, widest)
            mask_dtype = self._mask_dtype()
            mask = batch_mask(
                batch.starts,
                counts,
                widest,
                batch.kv_length,
                None if isinstance(mask_dtype, str) else mask_dtype,
            )
            inputs = {
                "input_ids": token_rows([t for t, _ in requests], widest, self.device),
                "attention_mask": to_device(mask, self.device),
                "position_ids": batch.position_index,
                "use_cache": True,
            }
            wanted = [
                (i, count - min(count, k if k is not None else count), count)
                for i, (count, k) in enumerate(zip(counts, keeps, strict=True))
            ]
            with self._planned():
                logits = self._gathered_logits(inputs, batch, wanted, widest, vocabs)
            for sequence, count in zip(sequences, counts, strict=True):
                sequence.length += count
        return [self._finished(rows) for rows in logits]

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
        placed = [(tokens, _placed(cache, len(tokens))) for tokens, cache in requests]
        try:
            with serial_forwards():
                return self._forward_batch(placed, keeps, call_vocabs)
        except BaseException:
            # All or nothing: a forward that ran before the failing one (a prompt run alone)
            # leaves no KV behind, so the caller may retry every request (the worker does, one
            # by one, to find the culprit) without feeding any of them twice.
            for (_, cache), length in zip(requests, lengths, strict=True):
                crop_to(cache, length)
            raise

    def _forward_batch(
        self,
        requests: Sequence[tuple[Tokens, DynamicCache]],
        keeps: list[int | None],
        call_vocabs: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        twin = self.prefill_twin
        if len(requests) > 1:
            alone = min(ALONE_ROWS, twin.from_rows) if twin is not None else ALONE_ROWS
            long = [i for i, (tokens, _) in enumerate(requests) if len(tokens) >= alone]
            if long:  # prefills run alone (through the twin, if any); the rest as one batch
                rest = [i for i in range(len(requests)) if i not in long]
                out: dict[int, torch.Tensor] = {
                    i: self._forward(*requests[i], keeps[i], call_vocabs[i]) for i in long
                }
                if rest:
                    batched = self._forward_batch(
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
                results = self._forward_batch(
                    [requests[i] for i in group],
                    [keeps[i] for i in group],
                    [call_vocabs[i] for i in group],
                )
                out.update(zip(group, results, strict=True))
            return [out[i] for i in range(len(requests))]
        if in_slots:
            return self._slot_forward(requests, keeps, call_vocabs)  # type: ignore[arg-type]
        if len(requests) == 1 or not all(_plain_layers(cache) for _, cache in requests):
            return [
                self._forward(tokens, cache, k, v)
                for (tokens, cache), k, v in zip(requests, keeps, call_vocabs, strict=True)
            ]
        lengths = [int(cache.get_seq_length()) for _, cache in requests]
        counts = [len(tokens) for tokens, _ in requests]
        longest, widest, size = max(lengths), max(counts), len(requests)
        batch_cache = self._dynamic_cache()  # a temporary copy
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
            "input_ids": token_rows([t for t, _ in requests], widest, self.device),
            "attention_mask": to_device(mask, self.device),
            "position_ids": to_device(positions, self.device),
            "use_cache": True,
        }
        with self._planned():
            all_logits = self._gathered_logits(inputs, batch_cache, wanted, widest, call_vocabs)
        results = []
        for i, ((_, cache), count) in enumerate(zip(requests, counts, strict=True)):
            results.append(self._finished(all_logits[i]))
            batch_layers: list[Any] = list(batch_cache.layers)
            for layer, batch_layer in enumerate(batch_layers):
                new = slice(longest, longest + count)
                cache.update(
                    batch_layer.keys[i : i + 1, :, new],
                    batch_layer.values[i : i + 1, :, new],
                    layer,
                )
        return results

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
        difference this runner keeps using the full model's logits. With ``head_rows``, each
        row's logits cover what its ``vocabs`` entry adds to the kept rows (``_restricted``)."""
        base = self._body
        if base is None or self._gather_checked is False:
            out = self.model(**inputs, **{self._cache_kw: batch_cache})
            return [
                self._masked(out.logits[row, start:stop], vocab)
                for (row, start, stop), vocab in zip(wanted, vocabs, strict=True)
            ]
        check = self._gather_checked is None
        reference_cache: Any = None
        if check:  # a slot batch writes the same keys at the same positions again: no copy
            slots = isinstance(batch_cache, SlotBatch)
            reference_cache = batch_cache if slots else copy.deepcopy(batch_cache)
        hidden = base(**inputs, **{self._base_cache_kw: batch_cache}).last_hidden_state
        if not check:
            return self._projected(hidden, wanted, widest, vocabs)
        head = self.model.get_output_embeddings()
        pieces = list(torch.split(head(_gathered(hidden, wanted, widest)), _counts(wanted)))
        full = self.model(**inputs, **{self._cache_kw: reference_cache}).logits
        self._gather_checked = all(
            torch.allclose(piece.float(), full[row, start:stop].float(), atol=1e-3, rtol=1e-3)
            for piece, (row, start, stop) in zip(pieces, wanted, strict=True)
        )
        if not self._gather_checked:
            pieces = [full[row, start:stop] for row, start, stop in wanted]
        return [self._masked(piece, vocab) for piece, vocab in zip(pieces, vocabs, strict=True)]

    def _projected(
        self,
        hidden: torch.Tensor,
        wanted: list[tuple[int, int, int]],
        widest: int,
        vocabs: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Logits of positions ``start:stop`` of each row ``(row, start, stop)`` of ``hidden``
        (``[rows, widest, hidden]``): only those positions go through the head."""
        head = self.model.get_output_embeddings()
        gathered = _gathered(hidden, wanted, widest)
        counts = _counts(wanted)
        if self.head_rows is not None:
            flat = self._restricted(head, gathered, list(zip(counts, vocabs, strict=True)))
            return list(torch.split(flat, counts))
        pieces = torch.split(head(gathered), counts)
        return [self._masked(piece, vocab) for piece, vocab in zip(pieces, vocabs, strict=True)]


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


def _slot_budget(device: torch.device) -> int | None:
    """How much memory a runner's slot pool may grow to before new calls get ordinary caches:
    a quarter of what the machine has available (CUDA: half of the free device memory), None
    where that is not known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) // 2
    from .kernels import available_memory

    available = available_memory()
    return available // 4 if available else None


def decoder_body(model: PreTrainedModel) -> nn.Module | None:
    """The model without its LM head (``model.model`` for Llama-style models), if any."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    head = model.get_output_embeddings()
    if not isinstance(base, nn.Module) or base is model or head is None:
        return None
    return base


def _placed(cache: Any, count: int) -> Any:
    """The cache a forward of ``count`` new tokens runs on: a slot's sequence that the pool
    cannot widen for it within its bound first moves to a cache of its own
    (``SlotSequence.spill``), which it then stands for."""
    if isinstance(cache, SlotSequence):
        if cache.own is None and not cache.pool.can_hold(cache.length + count):
            cache.spill()
        if cache.own is not None:
            return cache.own
    return cache


def _plain_layers(cache: DynamicCache) -> bool:
    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


def early_exit_view(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A model that runs only the first ``num_layers`` decoder layers of ``model``, then its final
    norm and LM head. It shares every parameter with ``model`` (no second copy in memory) and
    leaves ``model`` untouched: shallow copies of the wrappers, a truncated layer list and a
    config copy that says ``num_hidden_layers = num_layers``."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    layers = getattr(base, "layers", None)
    if base is None or not isinstance(layers, nn.ModuleList):
        msg = (
            f"early_exit needs a decoder with a `{prefix}.layers` list (Llama, Qwen, Mistral); "
            f"{type(model).__name__} has none"
        )
        raise ValueError(msg)
    total = len(layers)
    if not 1 <= num_layers < total:
        msg = (
            f"early_exit layers must be between 1 and {total - 1} for this model, got {num_layers}"
        )
        raise ValueError(msg)

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]

    view_base = copy.copy(base)
    view_base._modules = dict(base._modules)
    view_base.layers = nn.ModuleList(list(layers)[:num_layers])
    view_base.config = config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    setattr(view, prefix, view_base)
    view.config = config
    return view
