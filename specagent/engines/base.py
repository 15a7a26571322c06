"""The engine seam: what a model an engine loaded offers the runtime.

The decoding core asks a ``Runner`` for forwards (``decoding.engine``); the runtime asks the
model behind it for the facts it plans with and for its runners, through ``EngineModel``. Each
engine is a package under ``engines/`` that subclasses it (and loads its models, ``load``),
declaring what it can do in ``capabilities``; the runtime branches on those, never on an
engine's type, and reads nothing else of the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import torch

from ..machine import ProbeStore

T = TypeVar("T")

if TYPE_CHECKING:
    from ..decoding.engine import Runner

__all__ = ["Capabilities", "EngineModel", "LoadRequest", "Loaded", "Role", "RunnerNeeds"]

Role = Literal["target", "draft"]


@dataclass(frozen=True)
class Capabilities:
    """What an engine's models can do beyond forwards."""

    early_exit: bool = False
    """Runners over the first layers of the model (``early_exit`` drafting)."""
    shared_kv: bool = False
    """Every call's KV lives in one pool of fixed size (``EngineModel.kv_budget``): calls start
    only when what they may hold fits beside the running calls'."""
    devices: tuple[str, ...] = ("cpu", "cuda", "mps", "xpu")
    """Device types its models run on."""


@dataclass(frozen=True)
class RunnerNeeds:
    """What the runtime tells a model when it asks for a runner."""

    role: Role
    vocab_size: int | None
    """Columns of the logits the runner returns (a draft's: the target's vocabulary); None: the
    model's own."""
    eos_token_ids: Sequence[int] = ()
    """Tokens that end a call (a draft projecting onto part of its head keeps them)."""
    tokenizer: Any | None = None
    """The target's tokenizer (a draft's head rows are chosen from its vocabulary's order)."""
    store: ProbeStore | None = None
    """Where measurements of this machine are kept (compiled-step and kernel choices)."""


class EngineModel(ABC):
    """A model as its engine runs it: the facts the runtime plans with, and its runners.

    The engine's own knobs (how it compiles steps, which fast paths it proved, its KV layout)
    are given when the model is loaded or wrapped and stay inside the engine."""

    engine: ClassVar[str]
    """The engine's name (``transformers``, ``llama.cpp``)."""
    capabilities: ClassVar[Capabilities] = Capabilities()

    name: str
    """What the model is called in results, spans and the server's model list."""
    vocab_size: int
    """Columns of its logits."""
    context_window: int | None
    """The longest call it serves (None: its config does not say)."""
    num_layers: int
    """Decoder layers (0 where unknown)."""
    device: torch.device
    dtype: str | None = None
    """What its weights are held in, where one dtype says it (None: the engine's own format)."""

    @property
    @abstractmethod
    def model(self) -> Any:
        """What the engine runs (a torch module, a llama.cpp model): the object a caller passed
        in or ``from_pretrained`` loaded, as ``SpecRuntime.target`` shows it."""

    @abstractmethod
    def eos_token_ids(self) -> list[int]:
        """The model's own end-of-generation tokens (the runtime adds the tokenizer's)."""

    @abstractmethod
    def build_runner(self, needs: RunnerNeeds) -> tuple[Runner, Any | None]:
        """A runner over this model, and what the engine decided about its steps at load (a
        JSON-able object with ``to_json``, e.g. compiled steps; None where nothing)."""

    def placed(self, device: torch.device) -> EngineModel:
        """This model on ``device``; refused (``ValueError``) where its engine does not run
        there."""
        if device.type not in self.capabilities.devices or device.type != self.device.type:
            msg = f"the {self.engine} engine runs this model on {self.device}, not on {device}"
            raise ValueError(msg)
        return self

    def shallow_runner(self, layers: int, vocab_size: int) -> Runner:
        """A runner over the first ``layers`` layers (``capabilities.early_exit`` only)."""
        msg = (
            f"early_exit drafting cuts the target's layers, which the {self.engine} engine "
            "cannot do"
        )
        raise ValueError(msg)

    def kv_budget(self) -> int | None:
        """The KV positions all calls on this model may hold together where they share one
        pool (``capabilities.shared_kv``); None where each call's KV is its own."""
        return None

    def compute(self, work: Callable[[], T]) -> T:
        """Run ``work`` (a worker's round of steps: the forwards and the torch operations on
        their logits) where this engine computes best: inline here. llama.cpp runs every
        round of the process on one thread (``engines.llama_cpp.compute_thread``)."""
        return work()

    def compute_wanted(self) -> bool:
        """Whether other work waits to run where this model computes (another runtime's
        round on the shared llama.cpp thread): a worker running rounds back to back there
        hands the place back between two of them. Never, inline."""
        return False


@dataclass(frozen=True)
class LoadRequest:
    """What ``from_pretrained`` asks an engine to load (``engines.load_pair``): each engine's
    ``loading.load_pair`` reads what applies to it."""

    target: str
    """A local path, a hub id or a catalog name."""
    draft: str | None
    device: torch.device
    choice: dict[str, Any]
    """The engine chosen and why (``EngineChoice.to_json``), as ``Loaded.engine`` reports it."""
    dtype: str | torch.dtype = "auto"
    draft_dtype: str | torch.dtype = "auto"
    trust_remote_code: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    """The engine's own options (``engine_options``: transformers' ``TransformersOptions``
    fields, llama.cpp's ``LlamaCppModel`` keywords)."""


@dataclass
class Loaded:
    """What an engine loaded for a runtime (``engines.load_pair``)."""

    target: EngineModel
    """The target as its engine runs it."""
    draft: EngineModel | None
    tokenizer: Any
    draft_tokenizer: Any | None
    device: torch.device
    store: ProbeStore
    name: str
    """What the target is called (its file or directory name, or the catalog's)."""
    precision: dict[str, Any] = field(default_factory=dict)
    """Per role: the dtype chosen and why."""
    engine: dict[str, Any] = field(default_factory=dict)
    """The engine that runs the forwards and why (``EngineChoice.to_json``), with what it
    proved and turned off at load (``fast_paths`` per role, on llama.cpp)."""
