"""What each engine lends the tools around the runtime (``specagent doctor``, the benchmarks),
so that none of them branches on an engine's name or reaches into an engine's modules.

An engine's package has a ``tools`` module that is an ``EngineTools``: how to prove the engine
runs on this machine, what its users would run instead (the benchmarks' baselines, and other
programs on the same model files), and, where it has one, a float32 reference of its model to
tell a rounding tie from a bug. ``engine_tools`` finds it by the engine's name
(``engines.LOADERS``' packages)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol, cast

import torch

__all__ = ["EngineTools", "Float32Reference", "Method", "OtherPrograms", "engine_tools"]

Method = Callable[[list[int], int], tuple[list[int], Any]]
"""A decoding method a benchmark times: prompt ids and a round's seed -> output ids and stats."""


class OtherPrograms(NamedTuple):
    """Methods of other programs on the same model files, and what starts each of them afresh
    (nothing kept of earlier requests), which a benchmark calls before each round, untimed."""

    methods: dict[str, Method]
    new_round: Callable[[], None]

    @classmethod
    def none(cls) -> OtherPrograms:
        return cls({}, lambda: None)


Float32Reference = Callable[[list[int], list[int]], tuple[torch.Tensor, torch.Tensor]]
"""For a prompt and the tokens plain greedy decoding generated after it: the next token's
logits as plain decoding computed them (the prompt in one forward, then a forward per token, in
the runtime's dtype) and as the model computes them in float32 (over the whole prefix)."""


class EngineTools(Protocol):
    """An engine's ``tools`` module."""

    def check(self) -> dict[str, Any]:
        """Whether the engine runs here, proved in a child process (a native crash is reported,
        never suffered): ``runs``, ``detail`` and what is installed, for ``specagent doctor``."""
        ...

    def baselines(self, runtime: Any, max_new_tokens: int) -> dict[str, Method]:
        """What a user of this engine runs instead, on the runtime's own model: ``plain``
        greedy decoding first, then the engine's own speculative modes."""
        ...

    def other_programs(
        self, runtime: Any, max_new_tokens: int, binary: str | None
    ) -> AbstractContextManager[OtherPrograms]:
        """Methods of other programs on the same model files, for the block's duration (none
        where the engine has none or ``binary`` is not found)."""
        ...

    def float32_reference(self, runtime: Any) -> Float32Reference | None:
        """The model's float32 reference (None: the engine runs its weights as shipped, and a
        difference is judged by the engine's own logits along two paths)."""
        ...


def engine_tools(engine: str) -> EngineTools:
    """The ``tools`` module of ``engine`` (imported on first use: an engine's tools import what
    only they need)."""
    from . import LOADERS

    package = LOADERS[engine].rsplit(".", 1)[0]
    return cast(EngineTools, importlib.import_module(f"{package}.tools"))
