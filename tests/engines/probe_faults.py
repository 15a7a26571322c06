"""The probe's child (``specagent/engines/llama_cpp/probe_child.py``) with a planted fault, run
by the probe tests in its place: ``probe_faults.py FAULT PATH SHAPES SPEC``.

FAULT is ``none`` or ``KIND:PATH`` where KIND is ``signal`` (the child kills itself with
SIGSEGV), ``raise`` (a Python error) or ``noise`` (the logits come out as noise) and PATH the
fast path whose configurations fail (``repack``, ``flash_attention`` or ``safe``: the
configuration with every path off). Repacking is only pretended (the model loads without it,
whatever the configuration says), so that the outcome is the planted fault's on any CPU. The
fault strikes at the first ``llama_decode`` of two or
more tokens, as llama.cpp's AMX repacking does on the machines where it crashes. SHAPES is a
file that gets one line per ``llama_decode``: its token count and sequence count."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

CHILD = (
    Path(__file__).resolve().parents[2] / "specagent" / "engines" / "llama_cpp" / "probe_child.py"
)


def main() -> int:
    fault, shapes_file, spec = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    kind, _, target = fault.partition(":")
    loaded = importlib.util.spec_from_file_location("probe_child", CHILD)
    assert loaded is not None
    assert loaded.loader is not None
    child = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(child)
    import llama_cpp

    current: dict[str, bool] = {}
    real_run, real_decode, real_save = child.run_config, llama_cpp.llama_decode, np.save

    def faulty(config: dict[str, bool]) -> bool:
        if kind == "none":
            return False
        if target == "safe":
            return not any(config.values())
        return bool(config.get(target))

    def run_config(lib, spec, index, config):  # type: ignore[no-untyped-def]
        current.clear()
        current.update(config)
        # Weight repacking itself never runs here: what these tests decide must not depend
        # on what this CPU does with it (on a Xeon guest it dies by SIGILL).
        return real_run(lib, spec, index, {**config, "repack": False})

    def decode(ctx, batch):  # type: ignore[no-untyped-def]
        seqs = {batch.seq_id[i][0] for i in range(batch.n_tokens)}
        with shapes_file.open("a") as out:
            out.write(json.dumps([batch.n_tokens, len(seqs)]) + "\n")
        if batch.n_tokens >= 2 and faulty(current):
            if kind == "signal":
                os.kill(os.getpid(), signal.SIGSEGV)
            if kind == "raise":
                raise RuntimeError("planted fault")
        return real_decode(ctx, batch)

    def save(path, array):  # type: ignore[no-untyped-def]
        if kind == "noise" and faulty(current):
            array = np.random.default_rng(0).standard_normal(array.shape).astype(array.dtype)
        return real_save(path, array)

    child.run_config = run_config
    llama_cpp.llama_decode = decode
    child.np.save = save
    return int(child.main([str(CHILD), spec]))


if __name__ == "__main__":
    sys.exit(main())
