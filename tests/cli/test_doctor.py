"""``specagent doctor``: the machine, each engine proven in child processes, what was recorded,
and an exit status that says whether any engine runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specagent.cli.doctor import run_doctor


@pytest.mark.slow  # a child per engine proves it
def test_doctor_reports_the_machine_and_proves_each_engine(tmp_path) -> None:
    env = {**os.environ, "SPECAGENT_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "specagent.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    machine = report["machine"]
    for field in ("cpu", "isa_flags", "usable_cores", "memory_gib", "accelerator", "torch"):
        assert field in machine
    transformers = report["engines"]["transformers"]
    assert transformers["runs"], transformers
    assert "float32 and bfloat16" in transformers["detail"]
    llama = report["engines"]["llama.cpp"]
    if machine["llama_cpp_python"]:
        assert llama["runs"], llama
        assert llama["system_info"]
        # Every fast path was proven or turned off, with the reason.
        for choice in llama["fast_paths"].values():
            assert ("proven on this CPU" in choice["reason"]) == choice["enabled"]
    assert report["recorded"]["file"].startswith(str(tmp_path))

    text = subprocess.run(
        [sys.executable, "-m", "specagent.cli", "doctor"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert text.returncode == 0
    assert "transformers: runs" in text.stdout
    assert "nothing yet" in text.stdout  # a fresh cache: nothing measured on it


def test_doctor_exits_non_zero_when_no_engine_runs(capsys) -> None:
    dead = {"runs": False, "detail": "crashed in float32 forwards (signal 4, SIGILL)"}
    assert run_doctor(checks={"transformers": lambda: dead, "llama.cpp": lambda: dead}) == 1
    out = capsys.readouterr()
    assert "transformers: DOES NOT RUN: crashed in float32 forwards (signal 4, SIGILL)" in out.out
    assert "no engine runs on this machine" in out.err
    alive = {"runs": True, "detail": "ok"}
    assert run_doctor(checks={"transformers": lambda: dead, "llama.cpp": lambda: alive}) == 0
