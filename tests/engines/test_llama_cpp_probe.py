"""llama.cpp's optional fast paths are proven in a child process before the engine uses them:
a path whose child dies by a signal, raises, or computes other logits stays off and says why;
the verdict is kept per machine, build and model file; ``repack`` and ``flash_attention``
override it; and a model whose weights llama.cpp repacks (a quantized GGUF written here) runs
its batched forwards in this process whatever this CPU does with repacking."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specagent.engines import describe
from specagent.errors import ModelLoadError
from specagent.machine import ProbeStore

pytest.importorskip("llama_cpp")

from specagent.engines.llama_cpp import LlamaCppModel
from specagent.engines.llama_cpp.probe import choose_fast_paths
from specagent.engines.llama_cpp.sample import write_sample_gguf

FAULTS = Path(__file__).with_name("probe_faults.py")


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """A Q8_0 GGUF: its matrices are what llama.cpp repacks (AMX tiles, AVX-512 layouts)."""
    return write_sample_gguf(tmp_path_factory.mktemp("sample") / "sample-q8.gguf", "Q8_0")


def faulty_child(fault: str, shapes: Path) -> list[str]:
    return [sys.executable, str(FAULTS), fault, str(shapes)]


def prove(path: Path, child: list[str] | None = None, store=None, **asked):
    return choose_fast_paths(path, asked, threads=1, batch_tokens=512, store=store, child=child)


def test_a_quantized_model_runs_batched_forwards_in_this_process(sample, tmp_path) -> None:
    """On a Xeon whose AMX tiles fault, repacking would kill this process at the first forward
    of two tokens; the probe turns it off there, proves it elsewhere."""
    model = LlamaCppModel(
        sample, context_tokens=512, max_sequences=4, threads=2, probe_store=ProbeStore(tmp_path)
    )
    paths = model.fast_paths.choices
    for name, choice in paths.items():
        assert ("proven on this CPU" in choice.reason) == choice.enabled, (name, choice)
    a, b = model.sequence(), model.sequence()
    prompt = model.decode([(a, list(range(40)), 1)])
    batch = model.decode([(a, [5, 6], 2), (b, list(range(16, 32)), 16)])
    step = model.decode([(b, [7], 1)])
    assert [r.shape[0] for r in (*prompt, *batch, *step)] == [1, 2, 16, 1]
    assert model.fast_paths.probe_s is not None


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        (
            "signal:repack",
            "weight repacking crashed in a 40-token prompt (signal 11, SIGSEGV) on this CPU: "
            "loaded without it",
        ),
        (
            "raise:repack",
            "weight repacking failed in a 40-token prompt (RuntimeError: planted fault) on "
            "this CPU: loaded without it",
        ),
        ("noise:repack", "weight repacking gave other logits than the safe configuration"),
    ],
)
def test_a_path_whose_child_dies_raises_or_miscomputes_stays_off(
    sample, tmp_path, fault, says
) -> None:
    shapes = tmp_path / "shapes.jsonl"
    paths = prove(sample, faulty_child(fault, shapes))
    assert not paths.enabled("repack")
    assert says in paths.choices["repack"].reason
    assert paths.enabled("flash_attention"), paths.choices["flash_attention"]
    assert any(
        says in line
        for line in describe(
            {"engine": "llama.cpp", "reason": "test", "fast_paths": {"target": paths.to_json()}}
        )
    )


def test_the_probe_runs_the_engines_batched_shapes(sample, tmp_path) -> None:
    """A fault that strikes only forwards of two or more tokens (as AMX's did) is caught: the
    probe runs a prompt, a batch of several sequences' drafts, and a one-token step."""
    shapes_file = tmp_path / "shapes.jsonl"
    prove(sample, faulty_child("none", shapes_file))
    shapes = {tuple(json.loads(line)) for line in shapes_file.read_text().splitlines()}
    assert (18, 2) in shapes  # 2 + 16 new tokens over two sequences, one llama_decode
    assert (1, 1) in shapes
    assert any(n >= 32 and seqs == 1 for n, seqs in shapes)  # a prompt over whole tiles


def test_a_machine_where_even_the_safe_configuration_dies_is_an_error(sample, tmp_path) -> None:
    with pytest.raises(
        ModelLoadError,
        match=r"crashed .*signal 11.* even with weight repacking "
        r"and flash attention off.*engine='transformers'",
    ):
        prove(sample, faulty_child("signal:safe", tmp_path / "shapes.jsonl"))


def test_two_paths_that_pass_alone_but_fail_together_keep_the_first(sample, tmp_path) -> None:
    """The planted fault strikes a configuration with both paths on only."""
    child = [sys.executable, "-c", _BOTH_FAIL, str(FAULTS), str(tmp_path / "s.jsonl")]
    paths = prove(sample, child)
    assert paths.enabled("repack")
    assert not paths.enabled("flash_attention")
    assert "passed alone but not together with weight repacking" in (
        paths.choices["flash_attention"].reason
    )


_BOTH_FAIL = """
import runpy, sys, json
spec = json.loads(sys.argv[-1])
both = all(all(c.values()) for c in spec["configs"])
fault = "signal:repack" if both else "none"
sys.argv = [sys.argv[1], fault, sys.argv[2], sys.argv[-1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_verdict_is_kept_and_later_loads_run_no_child(sample, tmp_path) -> None:
    store = ProbeStore(tmp_path / "probes")
    first = prove(sample, faulty_child("signal:repack", tmp_path / "s.jsonl"), store=store)
    assert not first.stored
    assert first.probe_s is not None
    dead = [sys.executable, "-c", "import sys; sys.exit(3)"]  # would fail every path
    again = prove(sample, dead, store=store)
    assert again.stored
    assert again.probe_s is None
    assert again.choices == first.choices
    # Another model file is proven anew.
    other = write_sample_gguf(tmp_path / "other.gguf", "Q4_0")
    with pytest.raises(ModelLoadError, match="exit status 3"):
        prove(other, dead, store=store)


def test_options_override_the_probe(sample, tmp_path) -> None:
    dead = [sys.executable, "-c", "import sys; sys.exit(3)"]
    both = prove(sample, dead, repack=False, flash_attention=True)  # no child runs
    assert not both.enabled("repack")
    assert both.enabled("flash_attention")
    assert both.choices["repack"].reason == "weight repacking off: asked for"
    assert both.probe_s is None
    # One path asked for, the other proven: the proof runs with the asked one as it was set.
    shapes = tmp_path / "s.jsonl"
    mixed = prove(sample, faulty_child("signal:flash_attention", shapes), repack=True)
    assert mixed.choices["repack"].reason == "weight repacking on: asked for"
    assert not mixed.enabled("flash_attention")
    with pytest.raises(ModelLoadError, match="expected 'auto', True or False"):
        prove(sample, dead, repack="yes")
