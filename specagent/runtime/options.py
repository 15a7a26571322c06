"""``RuntimeOptions``: how a runtime serves its calls, one object beside the models it runs (the
engine's own options go to the engine: ``engine_options``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..machine import ProbeStore

__all__ = ["RuntimeOptions"]


@dataclass(frozen=True)
class RuntimeOptions:
    """How a ``SpecRuntime`` serves its calls (``SpecRuntime(..., options=RuntimeOptions(...))``
    and ``from_pretrained`` alike)."""

    max_active: int = 64
    """Calls decoded at once (one decoding slot each); the others wait in the queue."""
    max_queue: int = 256
    """Calls waiting for a slot; one more is refused (``RuntimeOverloadedError``)."""
    batching: bool = True
    """Batch concurrent calls' forwards, one per model per round (else each runs alone)."""
    admission_workers: int = 2
    """Threads that admit calls (render, tokenize, compile a grammar) off the event loop."""
    prefix_cache_tokens: int = 65536
    """KV of recent prompt prefixes kept for later calls of the same tenant (0: none); on an
    engine whose calls share one KV pool (llama.cpp) at most the pool's size, since each kept
    token is a copy of a cell's KV in host memory."""
    history_tokens: int = 32768
    """Earlier calls' text that ``suffix``/``auto`` policies draft from, per scope and tenant
    (0: none)."""
    tracer_provider: Any | None = None
    """The OpenTelemetry tracer provider of the calls' spans (None: the global one)."""
    meter_provider: Any | None = None
    """The OpenTelemetry meter provider of the runtime's metrics (None: the global one)."""
    probe_store: ProbeStore | Literal["machine"] | None = "machine"
    """Where step costs and kernel choices measured on this machine are kept across runs:
    ``"machine"`` (the default) this machine's store in the cache directory when
    ``from_pretrained`` loads the models, and none for models passed in; a store of your own;
    None: measured in this process, kept nowhere."""

    def __post_init__(self) -> None:
        if self.max_active < 1 or self.max_queue < 0:
            raise ValueError("max_active must be >= 1 and max_queue >= 0")
        if self.admission_workers < 1:
            raise ValueError("admission_workers must be >= 1")
        if self.prefix_cache_tokens < 0 or self.history_tokens < 0:
            raise ValueError("prefix_cache_tokens and history_tokens must be >= 0")
