"""Linear-layer kernels chosen by measurement, per forward length.

A decoder step is a series of products ``x @ W.T`` over a handful of rows: one in plain decoding,
k + 1 in a verification. Matrix libraries pick a kernel by shape, and the pick for few rows
differs between machines of one kind. Measured on a 2-core AMD EPYC (AVX2, MKL 2024.2, fp32),
a 1536 -> 8960 projection as ``F.linear`` took 4.7 ms for 1 row, 10.2 for 2, 13.4 for 4 and
40 for 16: the weights are read again for every row, so verifying draft tokens costs what
decoding them would, and speculation cannot pay. The same product written as ``(W @ x.T).T``
reaches another kernel that reads the weights once: 4.6, 4.6, 5.0 and 10.2 ms. On the whole
Qwen2.5 1.5B target that made a 4-token verification 0.78 s instead of 2.35 s (1 token: 0.65 s).
Elsewhere ``F.linear`` is the faster one, so nothing is assumed: ``choose_kernels`` times whole
forwards of the model both ways at each length (the cost measurement of ``costs.measure_costs``
does this) and keeps the transposed form at the lengths where it is clearly faster. Whole
forwards, not one layer in a loop: a layer timed alone keeps its weights in the CPU's cache and
measures arithmetic, while a real forward streams every weight from memory.

The plan applies inside ``LinearPlan.active()`` only, and only in the thread that entered it:
the caller's own use of the model and the baselines a benchmark runs beside specagent keep
torch's kernels. Given the model's linear modules (a runner always gives them), their forwards
are rerouted for the context's duration, one Python call per product; otherwise a
``TorchFunctionMode`` reroutes ``F.linear``, but a mode sees every torch call of the forward
(norms, rotations, attention): on the 2-core Zen 4 EPYC that cost a bf16 Qwen2.5 1.5B forward
of 1 or 6 rows 3-13% of its 0.18-0.23 s (interleaved passes). Both forms compute the same
products; only the order of the additions, and so the last bits of rounding, differ.

A third form keeps a copy of every weight in the layout oneDNN's matrix kernels read best
(``PackedWeights``; the one torch's own compiler uses for frozen CPU models), so no call
re-packs the weights on the way. On the 2-core AVX2 EPYC, Qwen2.5 1.5B in float32, in one
probe: a single-token forward 0.50 s instead of 0.58 (torch) and 0.59 (transposed); 2 to 8
tokens 0.57-0.78 s instead of 0.56-0.99 (transposed). The copy costs the weights' size in memory
again, so it is made only where that much memory is free (``PACK_HEADROOM``), kept only at the
lengths where it measures clearly faster, and dropped when it wins at none.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import types
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "LinearPlan",
    "PackedWeights",
    "choose_kernels",
    "kernel_choice_steps",
    "transposed_linear",
]

log = logging.getLogger(__name__)

MIN_GAIN = 0.92
"""Another form is kept only where it takes less than this share of torch's time: a tie keeps
torch's own kernels."""

PACK_HEADROOM = 1.5
"""Weights are packed only where the memory the machine has available is at least this many
times the packed copy's size: the copy doubles the weights' memory, and the rest of the
process (caches, the draft, the prompts) needs room too."""


@dataclass(frozen=True)
class LinearPlan:
    """The row counts at which every ``F.linear`` is computed as ``(W @ x.T).T``
    (``transposed_rows``) or from the runner's packed weights (``packed_rows``)."""

    transposed_rows: frozenset[int] = frozenset()
    packed_rows: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.transposed_rows or self.packed_rows)

    @contextlib.contextmanager
    def active(
        self,
        packed: PackedWeights | None = None,
        linears: Sequence[torch.nn.Linear] | None = None,
    ) -> Iterator[None]:
        """Run the forwards inside with this plan (a no-op when it changes nothing). Its packed
        rows apply where ``packed`` holds the weight; elsewhere torch's kernels run.

        ``linears``: the modules whose products the plan covers (their forwards are rerouted
        while the context lasts, for this thread only); None: every ``F.linear`` call made
        inside, through a ``TorchFunctionMode``."""
        if not self.transposed_rows and not (self.packed_rows and packed):
            yield
            return
        route = _Route(self.transposed_rows, self.packed_rows, packed)
        if linears is None:
            with _PlannedLinears(route):
                yield
            return
        routes = _thread_routes()
        outer = [(m, routes.get(id(m))) for m in linears]
        _install(linears)
        try:
            for module, _ in outer:
                routes[id(module)] = route
            yield
        finally:
            for module, before in outer:
                if before is None:
                    routes.pop(id(module), None)
                else:
                    routes[id(module)] = before
            _uninstall(linears)


_installed_lock = threading.Lock()
_installed: dict[int, tuple[int, Any]] = {}
"""Per module (by ``id``): how many plans running now rerouted it, on any thread, and the
``forward`` its instance held before the first (None: the class's). Runtimes over one model
object step on threads of their own; the rerouted ``forward`` stays until the last of them
leaves, and only then is the module given back what it had."""


def _install(linears: Sequence[torch.nn.Linear]) -> None:
    with _installed_lock:
        for module in linears:
            count, before = _installed.get(id(module), (0, None))
            if count == 0:
                before = module.__dict__.get("forward")
                module.forward = types.MethodType(_routed_linear, module)  # type: ignore[method-assign]
            _installed[id(module)] = (count + 1, before)


def _uninstall(linears: Sequence[torch.nn.Linear]) -> None:
    with _installed_lock:
        for module in linears:
            count, before = _installed.pop(id(module), (1, None))
            if count > 1:
                _installed[id(module)] = (count - 1, before)
            elif before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before  # type: ignore[method-assign]


class PackedWeights:
    """A copy of a model's float linear weights in oneDNN's prepacked layout
    (``torch.ops.mkldnn._reorder_linear_weight``), looked up by the weight tensor itself.

    Built with ``PackedWeights.of(model)``, which answers None where the CPU's oneDNN cannot pack
    the weights' dtype (bf16 without native support), where there is no weight to pack, or where
    the memory for the copy is not free. The model is not changed. A weight changed in place
    after packing (its ``_version`` moved on) is no longer held: its products go back to torch's
    kernels, so a stale copy never computes them."""

    def __init__(
        self, packed: dict[int, tuple[torch.Tensor, torch.Tensor, int]], nbytes: int
    ) -> None:
        # id(weight) -> (weight, packed copy, the weight's version when packed); the weight
        # itself is kept so that its id stays its own.
        self._packed = packed
        self.nbytes = nbytes
        """Memory the packed copy takes (the weights' own size)."""

    def __len__(self) -> int:
        return len(self._packed)

    def __contains__(self, weight: torch.Tensor) -> bool:
        entry = self._packed.get(id(weight))
        return entry is not None and entry[0] is weight and entry[2] == weight._version

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` computed from the packed copy of ``weight``."""
        packed = self._packed[id(weight)][1]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    @classmethod
    def of(cls, model: torch.nn.Module) -> PackedWeights | None:
        """Pack every 2-D float32/bf16 ``nn.Linear`` weight of ``model`` on the CPU (shared
        weights once), or None (see the class)."""
        weights = {
            id(module.weight): module.weight
            for module in model.modules()
            if isinstance(module, torch.nn.Linear)
            and module.weight.dim() == 2
            and module.weight.device.type == "cpu"
            and module.weight.dtype in (torch.float32, torch.bfloat16)
        }
        if not weights or not torch.backends.mkldnn.is_available():
            return None
        nbytes = sum(w.numel() * w.element_size() for w in weights.values())
        free = available_memory()
        if free is None or free < PACK_HEADROOM * nbytes:
            log.info(
                "linear weights not packed: %.1f GB needed, %s available",
                nbytes / 1e9,
                "unknown" if free is None else f"{free / 1e9:.1f} GB",
            )
            return None
        packed: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        try:
            with torch.inference_mode():
                for key, weight in weights.items():
                    copy = torch.ops.mkldnn._reorder_linear_weight(weight)
                    packed[key] = (weight, copy, weight._version)
        except RuntimeError as error:  # e.g. bf16 on a CPU without native bf16
            log.info("linear weights not packed: %s", error)
            return None
        return cls(packed, nbytes)


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``); None where
    unknown."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def transposed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x.T).T``.

    A single row is fed as two copies of itself: ``weight @ x.T`` over one column is a
    matrix-vector product, which torch sends to the same kernel as ``F.linear``, while two
    columns reach the matrix-matrix kernel. On a 2-core Xeon with AMX (bf16), that made the Qwen
    1.5B target's single-token step 0.14 s instead of 0.18 s (the 0.5B draft's: 0.062 s
    instead of 0.079 s); whether it pays is measured per machine like every other length."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    columns = flat.repeat(2, 1) if rows == 1 else flat
    out = torch.mm(weight, columns.t()).t()[:rows]  # [rows, out_features]
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class _Route:
    """Where one product ``F.linear(x, weight, bias)`` runs under a plan: ``__call__`` answers
    the product, or None for torch's own kernel."""

    def __init__(
        self,
        transposed: frozenset[int],
        packed_rows: frozenset[int],
        packed: PackedWeights | None,
    ) -> None:
        self._transposed = transposed
        self._packed_rows = packed_rows if packed else frozenset()
        self._packed = packed

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        if weight.dim() != 2 or not rows:
            return None
        if rows in self._packed_rows and self._packed is not None and weight in self._packed:
            return self._packed.linear(x, weight, bias)
        if rows in self._transposed:
            return transposed_linear(x, weight, bias)
        return None


_routing = threading.local()


def _thread_routes() -> dict[int, _Route]:
    """This thread's routes, by ``id`` of the module they were given for."""
    routes: dict[int, _Route] | None = getattr(_routing, "routes", None)
    if routes is None:
        routes = _routing.routes = {}
    return routes


def _routed_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``, computed by the route this thread gave this module, if any. A
    method bound to the module, not a closure over it: a copy made meanwhile
    (``copy.deepcopy`` binds it to the copy) finds no route and computes its own product,
    and another thread's call finds none either."""
    route = _thread_routes().get(id(self))
    if route is not None:
        out = route(x, self.weight, self.bias)
        if out is not None:
            return out
    return F.linear(x, self.weight, self.bias)


class _PlannedLinears(TorchFunctionMode):
    def __init__(self, route: _Route) -> None:
        super().__init__()
        self._route = route

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = self._route(args[0], args[1], bias)
            if out is not None:
                return out
        return func(*args, **kwargs)


def choose_kernels(
    time_forward: Callable[[int, LinearPlan], float],
    lengths: Sequence[int],
    *,
    packed: bool = False,
) -> tuple[LinearPlan, dict[int, float]]:
    """Per length n (rows fed to one forward): time it with torch's kernels, with the
    transposed form and (``packed``: the runner has packed weights) with the packed weights
    (``time_forward(n, plan)``, seconds), and keep the form that two of up to three passes
    found clearly fastest (``MIN_GAIN``; torch's kernels on a tie or a split). Lengths between
    two timed ones follow the timed one below. Returns the plan and each timed length's time
    under it (the kept form's fastest reading)."""
    steps = kernel_choice_steps(time_forward, lengths, packed=packed)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def kernel_choice_steps(
    time_forward: Callable[[int, LinearPlan], float],
    lengths: Sequence[int],
    *,
    packed: bool = False,
) -> Generator[None, None, tuple[LinearPlan, dict[int, float]]]:
    """``choose_kernels`` one timing at a time: yields after each ``time_forward`` call, so a
    worker can interleave the measurement with the calls it serves."""
    timed = sorted(set(lengths))
    chosen: dict[int, str] = {}  # length -> "transposed" | "packed"
    times: dict[int, float] = {}
    for n in timed:
        forms = {"torch": LinearPlan(), "transposed": LinearPlan(transposed_rows=frozenset({n}))}
        if packed:
            forms["packed"] = LinearPlan(packed_rows=frozenset({n}))
        readings: dict[str, list[float]] = {name: [] for name in forms}
        votes: list[str] = []
        # Every form is timed once per pass, the passes in alternating order, and each pass
        # votes for its clearly fastest form (torch's on a tie). Two passes that agree decide;
        # a third settles a split. A 2-core machine shares memory bandwidth with its
        # neighbours: one timing that caught them busy once kept a bf16 target's single-token
        # step 6% slower, and on a Zen 4 EPYC bursts kept torch's kernels at 2, 3, 7 and 8
        # rows where the packed weights were 15-40% faster. A vote compares timings taken
        # seconds apart, under the same neighbours; a burst sways one pass, not two.
        for order in (1, -1, 1):
            if len(votes) == 2 and votes[0] == votes[1]:
                break
            seconds: dict[str, float] = {}
            for name in list(forms)[::order]:
                seconds[name] = time_forward(n, forms[name])
                readings[name].append(seconds[name])
                yield
            best = min((name for name in seconds if name != "torch"), key=seconds.__getitem__)
            votes.append(best if seconds[best] < MIN_GAIN * seconds["torch"] else "torch")
        winner, count = collections.Counter(votes).most_common(1)[0]
        if count >= 2 and winner != "torch":
            chosen[n] = winner
        times[n] = min(readings[chosen.get(n, "torch")])
    for lower, upper in itertools.pairwise(timed):
        if lower in chosen:
            chosen.update(dict.fromkeys(range(lower + 1, upper), chosen[lower]))
    return (
        LinearPlan(
            transposed_rows=frozenset(n for n, form in chosen.items() if form == "transposed"),
            packed_rows=frozenset(n for n, form in chosen.items() if form == "packed"),
        ),
        times,
    )
