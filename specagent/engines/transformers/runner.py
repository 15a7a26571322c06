"""The transformers engine's runner: forwards of a Hugging Face causal LM over a call's
transformers cache, single and batched, with the tuning its model was loaded with.

A call keeps one transformers cache per model; after a verification rejects draft tokens the
core crops it back (``decoding.engine.crop_to``), so no step recomputes the prefix. What the
runner does beyond a plain forward is settled once and then fixed (``tuning``): the linear
kernels per forward length (``kernels``), a draft's head rows (``head``), compiled forwards
over the KV slots (``compiled``), a draft's prefill twin in another dtype
(``precision``).

``ModelRunner`` is made of parts split by concern, each its own module and a base class of
the runner over the state they share (``state.RunnerState``): one call's forward (here),
several calls' (``batched``), token trees (``trees``), the kernel plan and head rows
(``tuned``); what it reads of the model apart from running it is in ``views``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ...decoding.engine import Tokens, align_vocab, token_list, token_rows
from .attention import choose_attention, is_sdpa
from .batched import ALONE_ROWS, BatchedForwards, cache_for
from .compiled import CompiledSlots, serial_forwards
from .kernels import LinearPlan, PackedWeights
from .keys import model_key
from .slots import SlotPool, SlotSequence, keep_cache_path, slot_shapes
from .trees import TreeForwards
from .tuned import PREFILL_LENGTHS, TunedForwards
from .views import (
    PrefillTwin,
    _forward_params,
    cache_keyword,
    decoder_body,
    early_exit_view,
)

__all__ = [
    "ALONE_ROWS",
    "PREFILL_LENGTHS",
    "ModelRunner",
    "PrefillTwin",
    "cache_keyword",
    "decoder_body",
    "early_exit_view",
]


class ModelRunner(TunedForwards, BatchedForwards, TreeForwards):
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
    def compiled(self) -> CompiledSlots | None:
        """The compiled few-token forwards over this runner's KV slots, where they measured
        faster (``compiled.choose_compiled_step``); None: eager forwards."""
        return self._compiled

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parameters its forwards read (an early-exit view: its layers only)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

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

    def _use_compiled(self, compiled: CompiledSlots | None) -> None:
        """The compiled-forwards decision (``compiled.choose_compiled_step``), made before the
        runner is handed out (``tuning.build_runner``)."""
        self._compiled = compiled
        if self._pool is not None:  # a pool shrunk back would compile every bucket again
            self._pool.shrinks = compiled is None

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

    def kept(self, cache: DynamicCache, copied: bool) -> DynamicCache:
        """A slot's prefix is kept as an ordinary cache of its length (the pool's buffers stay
        the pool's), copied or not; an ordinary cache as a copy, or itself."""
        if isinstance(cache, SlotSequence):
            return cache.kept_copy()
        return copy.deepcopy(cache) if copied else cache

    def keep_path(self, cache: DynamicCache, start: int, path: list[int]) -> None:
        """A token tree's accepted path kept: in the slot, or by moving the cache's rows."""
        if isinstance(cache, SlotSequence):
            cache.keep_path(start, path)
        else:
            keep_cache_path(cache, start, path)

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
        cache = cache_for(cache, len(input_ids))
        with serial_forwards(), self._planned():
            if tree is not None:
                rows = token_list(input_ids)
                return self._masked(self._tree_forward(rows, cache, tree), vocab)
            return self._forward(input_ids, cache, keep, vocab)

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
