"""The transformers engine: any Hugging Face causal LM as a torch module.

Its runner (``ModelRunner``) feeds new tokens after a call's transformers cache, one call or a
padded batch of calls per forward, and owns every trick that makes those forwards cheaper on
the machine at hand, each decided once and then fixed:

- ``precision``: the dtype each model runs in, measured at load (an int8-weight draft
  (``quantized``), a draft's long forwards through a twin in another dtype);
- ``head``: a draft's logits projected onto its head's frequent rows only;
- ``slots``: each call's KV in a slot of one preallocated pool, batched rounds in place;
- ``compiled``: few-token forwards compiled over the slots (CUDA graphs on CUDA), where
  measured faster;
- ``attention``: grouped-query attention under a mask without copying the KV per query head,
  where measured faster;
- ``kernels``: per forward length, torch's linear kernels, a transposed form or oneDNN-packed
  weights, chosen by the runner's first ``tune``.

``build_runner`` (``tuning``) makes a runner with its load-time decisions.
"""

from .runner import (
    ALONE_ROWS,
    ModelRunner,
    PrefillTwin,
    cache_keyword,
    decoder_body,
    early_exit_view,
)
from .tuning import build_runner

__all__ = [
    "ALONE_ROWS",
    "ModelRunner",
    "PrefillTwin",
    "build_runner",
    "cache_keyword",
    "decoder_body",
    "early_exit_view",
]
