"""What is measured on the machine at hand (dtype, step costs, kernels), how it is kept across
runs, and what a result says about the machine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import PinnedCosts, make_model

from specagent import RuntimeOptions, SpecRuntime
from specagent.engines.transformers.keys import model_key
from specagent.engines.transformers.precision import (
    DtypeChoice,
    choose_dtype,
    speculative_cost_per_token,
)
from specagent.engines.transformers.quantized import has_int8_weights, int8_supported
from specagent.machine import ProbeStore, config_key, fingerprint, machine_info
from specagent.policy import Policy
from specagent.policy.schema import DraftModelConfig
from specagent.runtime.memory import costs as costs_module

DRAFTING = [
    Policy(
        name="drafting",
        description="test",
        mode="lossless",
        drafter=DraftModelConfig(num_speculative_tokens=4, adaptive=True),
    )
]


def test_machine_info_names_what_decides_speed() -> None:
    info = machine_info()
    for field in ("cpu", "isa_flags", "cpu_capability", "torch_threads", "blas", "torch"):
        assert field in info
    assert info["torch"] == torch.__version__
    assert len(fingerprint()) == 16
    assert fingerprint() == fingerprint()


def test_model_keys_follow_shape_and_dtype_not_weights() -> None:
    a, b = make_model(64, seed=0), make_model(64, seed=1)
    assert model_key(a) == model_key(b)  # other weights, same speed
    assert model_key(a) != model_key(make_model(64, hidden=32))
    assert model_key(a) != model_key(make_model(64).to(torch.bfloat16))
    assert config_key(a.config, 5) != config_key(a.config, 6)


def test_probe_store_round_trip_and_damaged_files(tmp_path: Path) -> None:
    store = ProbeStore(tmp_path / "probes")
    assert store.get("x") is None
    store.put("x", {"costs": [1.0, 1.1]})
    store.put("y", [1, 2])
    again = ProbeStore(tmp_path / "probes")
    assert again.get("x") == {"costs": [1.0, 1.1]}
    assert json.loads(again.path.read_text())["machine"]["cpu"] == machine_info()["cpu"]
    again.path.write_text("{not json")
    assert again.get("x") is None  # measured again, never a crash
    again.put("x", 3)
    assert again.get("x") == 3
    blocked = tmp_path / "file"
    blocked.write_text("")
    ProbeStore(blocked / "probes").put("x", 1)  # cannot write: only costs a re-measurement


def test_probe_store_keeps_its_newest_entries_within_its_bound(tmp_path: Path) -> None:
    """Every model file and setting keys entries of its own: the store drops the least
    recently written beyond its bound instead of growing with every model ever loaded."""
    store = ProbeStore(tmp_path, max_entries=3)
    for key in "abcd":
        store.put(key, key)
    assert set(store.entries()) == {"b", "c", "d"}
    store.put("b", "again")  # written again: the newest now
    store.put("e", "e")
    assert store.entries() == {"d": "d", "b": "again", "e": "e"}
    assert list(ProbeStore(tmp_path).entries()) == ["d", "b", "e"]  # oldest first, on disk
    with pytest.raises(ValueError, match="max_entries"):
        ProbeStore(tmp_path, max_entries=0)


def test_target_dtype_is_judged_per_speculative_token() -> None:
    """A dtype fast at one row but dear per extra row loses to one that verifies cheaply."""
    cheap_single = {1: 0.33, 4: 0.91, 8: 1.59}  # bf16 without native support (measured)
    flat = {1: 0.73, 4: 0.78, 8: 1.10}  # float32 with the transposed kernels (measured)
    assert speculative_cost_per_token(flat) < speculative_cost_per_token(cheap_single)
    assert speculative_cost_per_token({1: 1.0}) == 1.0


def test_dtype_is_measured_once_per_machine_and_shape(tmp_path: Path) -> None:
    store = ProbeStore(tmp_path)
    loads: list[torch.dtype] = []

    def load(dtype: torch.dtype) -> torch.nn.Module:
        loads.append(dtype)
        return make_model(64, layers=2).to(dtype)

    model, choice = choose_dtype(load, "target", torch.device("cpu"), key="tiny", store=store)
    assert loads == [torch.float32, torch.bfloat16]  # both measured
    assert choice.dtype in (torch.float32, torch.bfloat16)
    assert next(model.parameters()).dtype == choice.dtype
    assert set(choice.seconds) == {"float32", "bfloat16"}
    assert set(choice.seconds["float32"]) == {1, 4, 8}
    assert "bf16" in choice.reason
    loads.clear()
    model, again = choose_dtype(load, "target", torch.device("cpu"), key="tiny", store=store)
    assert loads == [choice.dtype]  # loaded once, in the stored choice, not measured
    assert again.dtype == choice.dtype
    assert "measured earlier" in again.reason
    _, draft_choice = choose_dtype(load, "draft", torch.device("cpu"), key="tiny", store=store)
    # A draft is judged by one forward; its prefill lengths say whether float32 prefills it.
    assert set(draft_choice.seconds["float32"]) == {1, 16, 64}


def test_float32_is_kept_unless_bf16_is_clearly_faster(tmp_path: Path, monkeypatch) -> None:
    import specagent.engines.transformers.precision as precision

    def timed(model: torch.nn.Module, lengths: tuple[int, ...]) -> dict[int, float]:
        low = next(model.parameters()).dtype == torch.bfloat16
        return {n: (0.95 if low else 1.0) * n for n in lengths}  # bf16 5% faster: a tie

    monkeypatch.setattr(precision, "_time", timed)
    load = lambda dtype: make_model(64).to(dtype)  # noqa: E731
    _, choice = choose_dtype(load, "draft", torch.device("cpu"), key="tie")
    assert choice.dtype == torch.float32
    monkeypatch.setattr(
        precision,
        "_time",
        lambda m, n: {1: 0.4 if next(m.parameters()).dtype != torch.float32 else 1.0},
    )
    _, choice = choose_dtype(load, "draft", torch.device("cpu"), key="fast")
    assert choice.dtype == torch.bfloat16
    assert choice.to_json()["dtype"] == "bfloat16"


def test_a_draft_tied_on_single_tokens_takes_the_dtype_faster_on_long_forwards(
    monkeypatch,
) -> None:
    """As measured on a 2-core Xeon with AMX: one token costs the same in either dtype, 64
    cost half as much in bf16; the draft catches up on long stretches, so bf16 it is. Where
    float32 clearly wins the single token, it stays, with a bf16 copy for long forwards."""
    import specagent.engines.transformers.precision as precision

    def amx(model: torch.nn.Module, lengths: tuple[int, ...]) -> dict[int, float]:
        low = next(model.parameters()).dtype == torch.bfloat16
        table = {1: 0.161, 16: 0.160, 64: 0.317} if low else {1: 0.150, 16: 0.284, 64: 0.653}
        return {n: table[n] for n in lengths}

    monkeypatch.setattr(precision, "_time", amx)
    load = lambda dtype: make_model(64).to(dtype)  # noqa: E731
    _, choice = choose_dtype(load, "draft", torch.device("cpu"), key="amx")
    assert choice.dtype == torch.bfloat16
    assert choice.prefill_dtype is None  # bf16 is the faster one on long forwards already
    assert "over 64 tokens" in choice.reason

    def single_float32(model: torch.nn.Module, lengths: tuple[int, ...]) -> dict[int, float]:
        low = next(model.parameters()).dtype == torch.bfloat16
        table = {1: 0.30, 16: 0.30, 64: 0.5} if low else {1: 0.15, 16: 0.6, 64: 1.2}
        return {n: table[n] for n in lengths}

    monkeypatch.setattr(precision, "_time", single_float32)
    _, choice = choose_dtype(load, "draft", torch.device("cpu"), key="f32")
    assert choice.dtype == torch.float32
    assert (choice.prefill_dtype, choice.prefill_from) == (torch.bfloat16, 16)
    assert "run in bfloat16" in choice.reason


@pytest.mark.skipif(not int8_supported(torch.device("cpu")), reason="no CPU int8 weight kernel")
def test_int8_weights_are_kept_only_where_clearly_cheaper_per_draft_token(
    tmp_path: Path, monkeypatch
) -> None:
    """As measured on a 2-core Xeon with AMX (Qwen2.5 0.5B): int8 0.074 s a token against
    bf16 0.174 and float32 0.176, but 0.29 s over 16 tokens against bf16's 0.16, so int8 with
    a bf16 copy for long forwards. On a 2-core AMD EPYC int8 measured level with bf16 (0.095
    vs 0.092 s): bf16 stays. The choice is stored and loaded again with int8 weights."""
    import specagent.engines.transformers.precision as precision

    def timings(int8: dict[int, float], bf16: dict[int, float], f32: dict[int, float]):
        def timed(model: torch.nn.Module, lengths: tuple[int, ...]) -> dict[int, float]:
            if has_int8_weights(model):
                return int8
            return bf16 if next(model.parameters()).dtype == torch.bfloat16 else f32

        return timed

    xeon = timings(
        {1: 0.074, 16: 0.293, 64: 0.993},
        {1: 0.174, 16: 0.164, 64: 0.344},
        {1: 0.176, 16: 0.347, 64: 0.839},
    )
    monkeypatch.setattr(precision, "_time", xeon)
    load = lambda dtype: make_model(64).to(dtype)  # noqa: E731
    store = ProbeStore(tmp_path)
    model, choice = choose_dtype(load, "draft", torch.device("cpu"), key="amx", store=store)
    assert choice.int8_weights
    assert choice.dtype == torch.bfloat16
    assert has_int8_weights(model)
    assert (choice.prefill_dtype, choice.prefill_from) == (torch.bfloat16, 16)
    assert "int8 weights are faster" in choice.reason
    assert "run in bfloat16" in choice.reason
    assert choice.to_json()["weights"] == "int8"
    model, again = choose_dtype(load, "draft", torch.device("cpu"), key="amx", store=store)
    assert again.int8_weights
    assert has_int8_weights(model)
    assert again.prefill_dtype == torch.bfloat16

    epyc = timings(
        {1: 0.095, 16: 0.30, 64: 1.0}, {1: 0.092, 16: 0.13, 64: 0.3}, {1: 0.26, 16: 0.6, 64: 1.1}
    )
    monkeypatch.setattr(precision, "_time", epyc)
    model, choice = choose_dtype(load, "draft", torch.device("cpu"), key="epyc")
    assert not choice.int8_weights
    assert choice.dtype == torch.bfloat16
    assert not has_int8_weights(model)
    assert "weights" not in choice.to_json()


def test_int8_is_for_a_draft_only_and_says_so(tokenizer, tmp_path: Path) -> None:
    from specagent.errors import ModelLoadError

    make_model(len(tokenizer)).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    with pytest.raises(ModelLoadError, match="for a draft only"):
        SpecRuntime.from_pretrained(str(tmp_path / "target"), device="cpu", dtype="int8")


@pytest.mark.skipif(not int8_supported(torch.device("cpu")), reason="no CPU int8 weight kernel")
def test_a_draft_asked_for_in_int8_runs_quantized(tokenizer, tmp_path: Path, monkeypatch) -> None:
    # Its own cache: costs this machine stored for these shapes earlier (where a draft as
    # large as its target does not pay) must not turn drafting off; pinned costs make it pay.
    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path / "cache"))
    for name, seed in (("target", 0), ("draft", 1)):
        make_model(len(tokenizer), seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    runtime = SpecRuntime.from_pretrained(
        str(tmp_path / "target"),
        draft=str(tmp_path / "draft"),
        device="cpu",
        dtype="float32",
        draft_dtype="int8",
        policies=DRAFTING,
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    assert runtime.draft is not None
    assert has_int8_weights(runtime.draft)
    assert runtime.precision["draft"]["weights"] == "int8"
    alone = Policy(name="drafting", description="plain", mode="lossless", drafter={"kind": "none"})
    plain = SpecRuntime.from_pretrained(
        str(tmp_path / "target"), device="cpu", dtype="float32", policies=[alone]
    )
    prompt = "Hello there, hello there"
    want = plain.generate_sync(prompt, max_new_tokens=12).text
    result = runtime.generate_sync(prompt, max_new_tokens=12)
    assert result.text == want  # greedy: the int8 draft changes the speed, not the output
    assert result.stats.num_draft_tokens > 0
    runtime.close()
    plain.close()


def test_runtime_reuses_costs_and_kernels_measured_on_this_machine(
    target, draft, tokenizer, tmp_path: Path, monkeypatch
) -> None:
    store = ProbeStore(tmp_path)
    first = SpecRuntime(
        target, draft, tokenizer, DRAFTING, "cpu", options=RuntimeOptions(probe_store=store)
    )
    costs = first.step_costs("drafting")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("costs were measured again")

    monkeypatch.setattr(costs_module, "measure_steps", refuse)
    second = SpecRuntime(
        target, draft, tokenizer, DRAFTING, "cpu", options=RuntimeOptions(probe_store=store)
    )
    assert second.step_costs("drafting") == costs
    # Each engine's own choices come back with the costs (packed weights are built again).
    assert second.tuning == first.tuning
    assert set(first.tuning) == {"target", "draft"}


def test_from_pretrained_auto_measures_dtype_for_target_and_draft(
    tokenizer, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path / "cache"))
    for name, seed in (("target", 0), ("draft", 1)):
        make_model(len(tokenizer), seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    runtime = SpecRuntime.from_pretrained(
        str(tmp_path / "target"), draft=str(tmp_path / "draft"), device="cpu"
    )
    assert set(runtime.precision) == {"target", "draft"}
    for role, model in (("target", runtime.target), ("draft", runtime.draft)):
        assert model is not None
        assert runtime.precision[role]["dtype"] == str(next(model.parameters()).dtype)[6:]
        assert runtime.precision[role]["seconds"]
    assert list((tmp_path / "cache" / "probes").glob("machine-*.json"))
    result = runtime.generate_sync("Hello", max_new_tokens=4)
    assert result.usage.output_tokens >= 1
    runtime.close()
    fixed = SpecRuntime.from_pretrained(str(tmp_path / "target"), device="cpu", dtype="float32")
    assert fixed.precision["target"] == DtypeChoice(torch.float32, "asked for").to_json()


def test_unknown_dtype_names_what_is_accepted(tmp_path: Path) -> None:
    from specagent.engines.transformers.checkpoint import resolve_dtype
    from specagent.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="expected 'auto' or one of"):
        resolve_dtype("float8", torch.device("cpu"))


def test_cli_models_info_says_which_dtype_and_why(
    tokenizer, tmp_path: Path, monkeypatch, capsys
) -> None:
    from specagent.cli import main

    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path / "cache"))
    make_model(len(tokenizer)).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    assert main(["models", "info", str(tmp_path / "target")]) == 0
    out = capsys.readouterr().out
    assert '"cpu"' in out
    assert "target: " in out
    assert "s per token at acceptance 0.8" in out


@pytest.mark.slow  # compiles with inductor
def test_cli_models_info_says_whether_steps_run_compiled(
    tokenizer, tmp_path: Path, monkeypatch, capsys
) -> None:
    """``--compile-steps on`` measures compiled against eager steps and keeps the decision for
    this machine; the default reads it back instead of compiling again."""
    from specagent.cli import main

    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path / "cache"))
    make_model(len(tokenizer)).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    target = str(tmp_path / "target")
    assert main(["models", "info", target, "--compile-steps", "on"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"target steps: (compiled|eager) \(compiled step .* vs eager", out)
    assert main(["models", "info", target]) == 0
    assert "(measured earlier on this machine)" in capsys.readouterr().out.split("target steps")[1]
    assert main(["models", "info", target, "--compile-steps", "off"]) == 0
    assert "target steps" not in capsys.readouterr().out


def test_where_measurements_are_kept_is_the_callers_choice(
    tokenizer, tmp_path: Path, monkeypatch
) -> None:
    """``from_pretrained`` keeps them in this machine's store by default; ``probe_store=None``
    keeps them nowhere (measured in the process); models passed in keep none by default."""
    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path / "cache"))
    make_model(len(tokenizer)).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    source = str(tmp_path / "target")
    kept = SpecRuntime.from_pretrained(source, device="cpu", dtype="float32")
    assert isinstance(kept.probe_store, ProbeStore)
    assert kept.with_policies([]).probe_store is kept.probe_store
    nowhere = SpecRuntime.from_pretrained(
        source, device="cpu", dtype="float32", options=RuntimeOptions(probe_store=None)
    )
    assert nowhere.probe_store is None
    assert SpecRuntime(kept.target, tokenizer=tokenizer, device="cpu").probe_store is None
    for runtime in (kept, nowhere):
        runtime.close()
