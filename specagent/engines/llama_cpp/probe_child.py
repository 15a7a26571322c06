"""The child process of ``probe``: load a GGUF under each configuration it is given, run the
forwards the engine runs (a prompt, a batch of 2 and 16 new tokens over two sequences, a
one-token step) and save their logits.

It runs as a script (``python probe_child.py SPEC``), importing nothing of specagent: it must
start fast, and whatever llama.cpp does to it (a segmentation fault, an illegal instruction)
ends this process only. Before each configuration and each forward it prints one JSON line on
stdout, so the parent knows how far it got when it died.

SPEC is a JSON object: ``path`` (the GGUF), ``threads``, ``batch_tokens``, ``out`` (a folder for
the logits, one ``.npy`` file per configuration) and ``configs``, a list of
``{"repack": bool, "flash_attention": bool}``.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

PROMPT_TOKENS = 40
"""A prompt longer than a tile of 32 rows, so that prompt kernels run over whole and partial
tiles."""

STEPS: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = (
    (f"a {PROMPT_TOKENS}-token prompt", ((0, PROMPT_TOKENS),)),
    ("a batch of 2 and 16 tokens over two sequences", ((0, 2), (1, 16))),
    ("a 1-token step", ((1, 1),)),
)
"""The forwards, in order: a name (for the parent's messages) and per sequence how many new
tokens it gets. The engine's own shapes: a prefill, a verification batched with other calls'
(a short and a long draft), a plain step."""


ERRORS: list[str] = []
"""llama.cpp's error log lines so far (its failures say why there, not in a return value)."""


def failed(what: str) -> RuntimeError:
    last = ERRORS[-1].strip() if ERRORS else "no log line"
    return RuntimeError(f"{what}: {last}")


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


TEXT = (
    "The customer asked where order A-10234 is. def total(items):\n    return sum(i.price "
    "for i in items)\nThe parcel left the warehouse on Monday and should arrive by Friday; "
    "we will refund the shipping fee if it is late. Summary of the meeting: the team agreed "
    "to ship the release after the tests pass on every machine."
)
"""Ordinary text and code: logits over real tokens, as the engine computes them (ids picked
at random give activations no prompt gives, where kernels' rounding differs more)."""


def text_tokens(lib: Any, vocab: Any, count: int) -> list[int]:
    """``count`` tokens of ``TEXT`` (repeated as needed) in the model's own vocabulary."""
    raw = TEXT.encode()
    buffer = (lib.llama_token * (len(raw) + 8))()
    n = lib.llama_tokenize(vocab, raw, len(raw), buffer, len(buffer), False, False)
    ids = list(buffer[: max(n, 0)]) or [0]
    return [ids[i % len(ids)] for i in range(count)]


def run_config(lib: Any, spec: dict[str, Any], index: int, config: dict[str, bool]) -> None:
    say({"config": index, "stage": "loading the model"})
    params = lib.llama_model_default_params()
    params.use_extra_bufts = bool(config["repack"])
    model = lib.llama_model_load_from_file(str(spec["path"]).encode(), params)
    if not model:
        raise failed("llama.cpp could not load the model")
    batch_tokens = int(spec["batch_tokens"])
    ctx_params = lib.llama_context_default_params()
    ctx_params.n_ctx = 256
    ctx_params.n_batch = batch_tokens
    ctx_params.n_ubatch = batch_tokens
    ctx_params.n_seq_max = 4
    ctx_params.n_outputs_max = max(batch_tokens, 4)
    ctx_params.n_outputs_max_per_seq = batch_tokens
    ctx_params.n_threads = int(spec["threads"])
    ctx_params.n_threads_batch = int(spec["threads"])
    ctx_params.kv_unified = True
    ctx_params.flash_attn_type = (
        lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if config["flash_attention"]
        else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    ctx_params.no_perf = True
    say({"config": index, "stage": "creating a context"})
    ctx = lib.llama_init_from_model(model, ctx_params)
    if not ctx:
        raise failed("llama.cpp could not create a context")
    vocab_handle = lib.llama_model_get_vocab(model)
    vocab = int(lib.llama_vocab_n_tokens(vocab_handle))
    text = text_tokens(lib, vocab_handle, sum(n for _, feeds in STEPS for _, n in feeds))
    batch = lib.llama_batch_init(batch_tokens, 0, 1)
    lengths = [0, 0]
    rows: list[np.ndarray] = []
    for name, feeds in STEPS:
        say({"config": index, "stage": name})
        feed = [(seq, text.pop(0)) for seq, new in feeds for _ in range(new)]
        # Split as the engine splits a forward longer than its batch.
        for start in range(0, len(feed), batch_tokens):
            chunk = feed[start : start + batch_tokens]
            for row, (seq, token) in enumerate(chunk):
                batch.token[row] = token
                batch.pos[row] = lengths[seq]
                batch.n_seq_id[row] = 1
                batch.seq_id[row][0] = seq
                batch.logits[row] = True
                lengths[seq] += 1
            batch.n_tokens = len(chunk)
            status = lib.llama_decode(ctx, batch)
            if status != 0:
                raise failed(f"llama_decode returned {status} for {name}")
            pointer = lib.llama_get_logits(ctx)
            rows.append(np.ctypeslib.as_array(pointer, shape=(len(chunk), vocab)).copy())
    np.save(Path(spec["out"]) / f"{index}.npy", np.concatenate(rows))
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
    say({"config": index, "done": True})


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    import llama_cpp as lib

    @lib.llama_log_callback
    def quiet(level: int, text: bytes, _user: Any) -> None:
        if level == 4 and text:  # errors only: to stderr, and into the failure's message
            line = text.decode("utf-8", "replace")
            if line.strip():
                ERRORS.append(line)
            sys.stderr.write(line)

    lib.llama_log_set(quiet, ctypes.c_void_p(0))
    lib.llama_backend_init()
    for index, config in enumerate(spec["configs"]):
        run_config(lib, spec, index, config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
