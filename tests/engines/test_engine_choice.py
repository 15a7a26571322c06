"""Which engine a source gets, and loading a GGUF file through ``from_pretrained``."""

from __future__ import annotations

import pytest
import torch
from tiny_gguf import make_qwen2, write_gguf

from specagent import SpecRuntime
from specagent.engines import EngineModel, choose_engine
from specagent.errors import ModelLoadError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_takes_llama_cpp_for_gguf_on_a_cpu_when_installed(monkeypatch) -> None:
    import specagent.engines.llama_cpp as llama

    monkeypatch.setattr(llama, "available", lambda: True)
    assert choose_engine("auto", "model.gguf", CPU).engine == "llama.cpp"
    assert choose_engine("auto", "qwen2.5-coder-0.5b-instruct", CPU).engine == "llama.cpp"
    assert choose_engine("auto", "/models/Qwen2.5-1.5B", CPU).engine == "transformers"
    on_gpu = choose_engine("auto", "model.gguf", CUDA)
    assert on_gpu.engine == "transformers"
    assert "cuda" in on_gpu.reason
    monkeypatch.setattr(llama, "available", lambda: False)
    missing = choose_engine("auto", "model.gguf", CPU)
    assert missing.engine == "transformers"
    assert "not installed" in missing.reason


def test_asking_for_an_engine_that_cannot_run_the_source_fails_clearly(monkeypatch) -> None:
    import specagent.engines.llama_cpp as llama

    with pytest.raises(ModelLoadError, match="unknown engine 'vllm'"):
        choose_engine("vllm", "model.gguf", CPU)
    with pytest.raises(ModelLoadError, match="runs GGUF files"):
        choose_engine("llama.cpp", "/models/Qwen2.5-1.5B", CPU)
    monkeypatch.setattr(llama, "available", lambda: False)
    with pytest.raises(ModelLoadError, match=r"specagent\[gguf\]"):
        choose_engine("llama.cpp", "model.gguf", CPU)
    assert choose_engine("transformers", "model.gguf", CPU).reason == "asked for"


def test_from_pretrained_runs_a_local_gguf_on_llama_cpp(tokenizer, tmp_path, monkeypatch) -> None:
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path / "cache"))
    # transformers' Qwen2 tokenizer adds <|endoftext|> where a vocabulary lacks it: the GGUF
    # has it, as every Qwen GGUF does.
    model = make_qwen2(len(tokenizer) + 1, seed=5)
    path = write_gguf(model, tokenizer, tmp_path / "tiny.gguf", extra=("<|endoftext|>",))
    runtime = SpecRuntime.from_pretrained(str(path), engine_options={"threads": 1})
    try:
        assert isinstance(runtime.target, EngineModel)
        assert runtime.engine_choice["engine"] == "llama.cpp"
        assert runtime.precision["target"]["dtype"] == "gguf"
        assert runtime.model_name == "tiny"
        # The tokenizer came out of the GGUF (ids and chat template as written there).
        assert runtime.tokenizer.get_vocab() == {**tokenizer.get_vocab(), "<|endoftext|>": 320}
        # Another engine's option is refused, naming the ones this engine takes.
        with pytest.raises(ValueError, match=r"llama.cpp engine takes \[.*'threads'.*\], not "):
            SpecRuntime.from_pretrained(str(path), engine_options={"compile_steps": True})
        messages = [{"role": "user", "content": "Hello world"}]
        result = runtime.generate_sync(messages, max_new_tokens=8, temperature=0.0)
        assert result.usage.output_tokens == len(result.token_ids) > 0
        assert (tmp_path / "cache" / "tokenizers").is_dir()  # converted once, kept
    finally:
        runtime.close()


# ------------------------------------------------------------------ the engine seam


def test_a_torch_module_is_the_transformers_engines_model(target, draft, tokenizer) -> None:
    from specagent.engines import engine_model

    seen = engine_model(target, {"kv_slots": False})
    assert seen.engine == "transformers"
    assert seen.model is target
    assert seen.capabilities.early_exit
    assert not seen.capabilities.shared_kv
    assert seen.vocab_size == target.get_output_embeddings().weight.shape[0]
    assert seen.num_layers == target.config.num_hidden_layers
    assert seen.kv_budget() is None  # each call's KV is its own
    runtime = SpecRuntime(
        target, draft, tokenizer, device="cpu", engine_options={"draft_head_rows": None}
    )
    assert runtime.engine == "transformers"
    assert runtime.target is target  # as passed in
    assert runtime.draft is draft
    runtime.close()


def test_what_no_engine_runs_is_refused_by_name() -> None:
    from specagent.engines import engine_model

    with pytest.raises(TypeError, match=r"torch module .* or an engine's model .* not dict"):
        engine_model({"weights": []})


def test_the_transformers_options_are_checked_when_given(target, tokenizer) -> None:
    with pytest.raises(ValueError, match="draft_head_rows must be 'auto', None or a positive"):
        SpecRuntime(
            target, tokenizer=tokenizer, device="cpu", engine_options={"draft_head_rows": 0}
        )


def test_an_option_the_transformers_engine_does_not_take_is_refused_by_name(
    target, tokenizer
) -> None:
    with pytest.raises(ValueError, match=r"takes \['compile_steps', .*\], not \['threads'\]"):
        SpecRuntime(target, tokenizer=tokenizer, device="cpu", engine_options={"threads": 2})


def test_runtime_options_out_of_bounds_are_refused() -> None:
    from specagent import RuntimeOptions

    for bad in ({"max_active": 0}, {"max_queue": -1}, {"admission_workers": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RuntimeOptions(**bad)
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        RuntimeOptions(prefix_cache_tokens=-1)
