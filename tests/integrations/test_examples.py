"""Every example runs, as a user runs it, on the real small model of ``capable.py`` (the
catalog's Qwen2.5-Coder-0.5B-Instruct by default), and shows what it is for."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from capable import CAPABLE_ENGINES, CAPABLE_MODEL, NO_CAPABLE_MODEL, capable_runtime

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(NO_CAPABLE_MODEL, reason="SPECAGENT_TEST_MODEL=none"),
]


@pytest.fixture(params=CAPABLE_ENGINES)
def engine(request) -> str:
    """Each example runs on every engine (``--engine``)."""
    return str(request.param)


def run_example(name: str, engine: str, *args: str) -> str:
    capable_runtime(engine)  # fetched (and converted) once, before the example loads it
    command = [
        sys.executable,
        str(ROOT / "examples" / name),
        "--target",
        CAPABLE_MODEL,
        "--engine",
        engine,
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_langchain_agent_example(engine) -> None:
    out = run_example("langchain_agent.py", engine)
    assert "calls [('order_status', {'order_id': 'A-10234'})]" in out
    answer = [line for line in out.splitlines() if line.startswith("   ai: ")][-1]
    assert "Thursday" in answer or "depot" in answer
    assert "filed: Ticket(order_id='A-10234'" in out


def test_support_agent_example(engine) -> None:
    out = run_example("support_agent.py", engine)
    assert "tool lookup_order({'order_id': 'A-10234'})" in out
    assert "customer answer (lossless)" in out
    assert "internal summary (relaxed" in out


def test_async_service_example(engine) -> None:
    out = run_example("async_service.py", engine, "--calls", "4")
    assert "a cancelled call freed its slot" in out
    assert "4 concurrent calls in" in out
    assert len(re.findall(r"^call \d: ", out, flags=re.M)) == 4  # answered, refused or timed out
    assert re.search(r"^call \d: .* tok/s", out, flags=re.M)


def test_tracing_example_traces_calls_that_produced_text(engine) -> None:
    out = run_example("tracing.py", engine)
    spans = [json.loads(s) for s in re.findall(r"^\{\n.*?^\}$", out, flags=re.S | re.M)]
    spans = [s for s in spans if "context" in s]  # the console prints metrics as JSON too
    calls = [s for s in spans if s["name"].startswith("chat ")]
    assert len(calls) == 2
    assert all(s["attributes"]["gen_ai.usage.output_tokens"] > 0 for s in calls)
    parent = next(s for s in spans if s["name"] == "handle ticket")
    assert all(s["parent_id"] == parent["context"]["span_id"] for s in calls)
    assert {s["attributes"]["specagent.mode"] for s in calls} == {"lossless", "relaxed"}


def test_the_demo_runs_and_its_checks_pass() -> None:
    """``specagent demo``, the README's main command, on its default model."""
    from specagent.cli.parser import DEFAULT_MODEL

    if CAPABLE_MODEL != DEFAULT_MODEL:
        pytest.skip(f"the demo runs {DEFAULT_MODEL}; SPECAGENT_TEST_MODEL names another")
    capable_runtime()  # fetched once into the cache the demo loads from
    done = subprocess.run(
        [sys.executable, "-m", "specagent.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "checks passed" in done.stdout
    assert "customer-reply" in done.stdout  # the table of calls
    assert "internal-summary" in done.stdout
    # Two jobs, two texts: the team's case note is not the customer's answer again.
    answer = done.stdout.split("[customer answer, lossless]")[1].split("\n\n")[0].strip()
    note = done.stdout.split("[case note for the support team, relaxed]")[1].split("\n\n")[0]
    assert note.strip()
    assert note.strip() != answer
