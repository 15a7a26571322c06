"""The transformers engine's runner: forwards of a Hugging Face causal LM over a call's
transformers cache, single and batched, with the tuning its model was loaded with.

A call keeps one transformers cache per model; after a verification rejects draft tokens the
core crops it back (``decoding.engine.crop_to``), so no step recomputes the prefix. What the
runner does beyond a plain forward is settled once and then fixed (``tuning``): the linear
kernels per forward length (``kernels``), a draft's head rows (``head``), compiled forwards
over the KV slots (``compiled``), a draft's prefill twin in another dtype
(``precision``).

``ModelRunner`` is composed of parts, each its own object over what it needs and nothing
else: what it reads of the model once (``views.ModelView``), the head its logits cover
(``head.Head``), its kernel set (``tuned.KernelSet``), its calls' caches
(``sequences.Sequences``), and its step functions: one call's forward (here), several calls'
and one call's over a slot (``batched.BatchedForwards``), token trees (``trees``).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from ...decoding.engine import ForwardInputs, Tokens, token_list, token_rows
from .attention import choose_attention
from .batched import ALONE_ROWS, BatchedForwards, cache_for
from .compiled import CompiledSlots, serial_forwards
from .head import Head
from .kernels import LinearPlan, PackedWeights
from .keys import model_key
from .sequences import Sequences
from .slots import SlotPool, SlotSequence
from .trees import tree_forward
from .tuned import PREFILL_LENGTHS, KernelSet
from .views import (
    ModelView,
    PrefillTwin,
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
        self.view = ModelView.of(model, vocab_size)
        self.vocab_size = self.view.vocab_size
        """Size of the logits this runner returns (a draft's are aligned to the target's)."""
        self.device = self.view.device
        self.head = Head.checked(self.view, head_rows, always)
        self.inputs = ForwardInputs(trees=self.view.mask_dtype != "other", head_rows=self.head.rows)
        """Token trees where the model's attention takes a custom mask (eager or sdpa); a
        limited vocabulary where the head's rows were kept (``head.Head``)."""
        twin = [prefill_twin.model] if prefill_twin is not None else []
        self.kernel_set = KernelSet([model, *twin], self.device, kernels, packed)
        self.sequences = Sequences(self.view, slots)
        self.batched = BatchedForwards(
            self.view, self.head, self.kernel_set, prefill_twin, self._planned_forward
        )

    # ------------------------------------------------------------ what it settled

    @property
    def compiled(self) -> CompiledSlots | None:
        """The compiled few-token forwards over this runner's KV slots, where they measured
        faster (``compiled.choose_compiled_step``); None: eager forwards."""
        return self.batched.compiled

    def _use_compiled(self, compiled: CompiledSlots | None) -> None:
        """The compiled-forwards decision (``compiled.choose_compiled_step``), made before the
        runner is handed out (``tuning.build_runner``)."""
        self.batched.compiled = compiled
        if self.slots is not None:  # a pool shrunk back would compile every bucket again
            self.slots.shrinks = compiled is None

    @property
    def kernels(self) -> LinearPlan:
        """Which linear-layer kernels this runner's forwards use (``kernels.LinearPlan``; empty:
        torch's own), for the runner's own forwards only (``LinearPlan.active``)."""
        return self.kernel_set.plan

    @property
    def packed(self) -> PackedWeights | None:
        """The model's weights packed for oneDNN, where the plan's ``packed_rows`` read them
        (``kernels.PackedWeights``; None: not packed)."""
        return self.kernel_set.packed

    @property
    def settled(self) -> bool:
        """Whether the linear kernels are chosen (by ``tune`` or ``restore``) and fixed."""
        return self.kernel_set.settled

    @property
    def slots(self) -> SlotPool | None:
        """The pool of KV slots this runner's calls hold (``slots``), None: each call has an
        ordinary transformers cache."""
        return self.sequences.pool

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
        if self.head.rows is not None:
            own.append(f"head-rows-{self.head.rows}")
        return model_key(self.model, *parts, *own)

    def tune(
        self,
        lengths: Sequence[int],
        *,
        context_tokens: int = 32,
        repeats: int = 2,
        prefill_lengths: Sequence[int] | None = None,
    ) -> Generator[None, None, dict[int, float]]:
        """Time forwards over each of ``lengths`` rows; the first time, choose the linear
        kernels on the way and keep them (``tuned.KernelSet.tune``)."""
        return (
            yield from self.kernel_set.tune(
                self,
                lengths,
                compiled=self.compiled is not None,
                context_tokens=context_tokens,
                repeats=repeats,
                prefill_lengths=prefill_lengths,
            )
        )

    @property
    def settings(self) -> dict[str, Any]:
        """The settled kernel plan: its transposed and packed row counts."""
        return self.kernel_set.settings

    def restore(self, settings: Mapping[str, Any]) -> bool:
        """Take a kernel plan an earlier process settled (``tuned.KernelSet.restore``)."""
        return self.kernel_set.restore(settings)

    def compiler(self, backend: Any = "inductor") -> CompiledSlots:
        """Compiled forwards over this runner's KV slots (each shape compiled at its first
        use); only for a runner with slots."""
        body = self.view.body
        if self.slots is None or body is None:
            raise ValueError("compiled forwards run over KV slots; this runner has none")
        mask_dtype = self.view.mask_dtype
        if isinstance(mask_dtype, str):
            raise ValueError("compiled forwards need an attention that takes a custom mask")
        return CompiledSlots(
            body,
            self.slots,
            cache_kw=self.view.body_cache_kw,
            mask_dtype=mask_dtype,
            backend=backend,
        )

    # ------------------------------------------------------------------ sequences

    def new_cache(self) -> DynamicCache:
        """An empty cache: a slot of this runner's pool where it has one and a slot is free,
        else an ordinary cache."""
        return self.sequences.new()

    def reproducible(self, tokens: int) -> ModelRunner:
        """Itself: a call's KV (a slot, or a cache of its own) never shares memory with
        another call's, and a reproducible call's forwards run alone (``decoding.engine``)."""
        return self

    def adopt(self, cache: DynamicCache) -> DynamicCache:
        """``cache`` as the kind of cache this runner's calls use (``Sequences.adopt``)."""
        return self.sequences.adopt(cache)

    def kept(self, cache: DynamicCache, copied: bool) -> DynamicCache:
        """What the prefix cache keeps of ``cache`` (``Sequences.kept``)."""
        return self.sequences.kept(cache, copied)

    def keep_path(self, cache: DynamicCache, start: int, path: list[int]) -> None:
        """A token tree's accepted path kept (``Sequences.keep_path``)."""
        self.sequences.keep_path(cache, start, path)

    # ------------------------------------------------------------------- forwards

    def forward_batch(
        self,
        requests: Sequence[tuple[Tokens, DynamicCache]],
        keep: Sequence[int | None] | None = None,
        vocabs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Several calls' forwards in one model call (``batched.BatchedForwards``)."""
        return self.batched.forward_batch(requests, keep, vocabs)

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
        the head's rows (``vocab.CallVocabulary``; ignored without them)."""
        cache = cache_for(cache, len(input_ids))
        with serial_forwards(), self.batched.planned():
            if tree is not None:
                logits = tree_forward(self.view, token_list(input_ids), cache, tree)
                return self.head.masked(self.view.finished(logits), vocab)
            return self._forward(input_ids, cache, keep, vocab)

    def _planned_forward(
        self, input_ids: Tokens, cache: DynamicCache, keep: int | None, vocab: torch.Tensor | None
    ) -> torch.Tensor:
        """``_forward`` under the kernel plan: a prompt that runs alone in a batched round."""
        with self.batched.planned():
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
            return self.batched.slot_forward([(input_ids, cache)], [keep], [vocab])[0]
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
        view = self.view
        ids = token_rows([input_ids], len(input_ids), self.device)
        body = view.body if model is self.model else decoder_body(model)
        if self.head.rows is not None and body is not None:
            kw = {view.body_cache_kw: cache, "use_cache": True}
            hidden = body(input_ids=ids, **kw).last_hidden_state[0]
            if keep is not None:
                hidden = hidden[-keep:] if keep > 0 else hidden[:0]
            head = model.get_output_embeddings()
            restricted = self.head.restricted(head, hidden, [(hidden.shape[0], vocab)])
            return view.finished(restricted)
        kwargs: dict[str, Any] = {view.cache_kw: cache, "use_cache": True}
        if keep is not None and view.keeps_logits:
            kwargs["logits_to_keep"] = keep
        logits = model(input_ids=ids, **kwargs).logits[0]
        if keep is not None:
            logits = logits[-keep:] if keep > 0 else logits[:0]
        return view.finished(logits)

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
                new.keys[:, :, length:].to(self.view.dtype),
                new.values[:, :, length:].to(self.view.dtype),
                index,
            )
        return logits
