"""``specagent serve`` as a process: it refuses to start without keys, serves a model saved on
disk with keys from the environment, and on SIGTERM lets the call in flight finish, then exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import make_model, make_tokenizer
from live_server import free_port, wait_until_up

KEY = "env-key-0123456789abcdefghij"


@pytest.mark.slow  # server processes
def test_serve_refuses_to_start_without_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPECAGENT_API_KEYS"}
    done = subprocess.run(
        [sys.executable, "-m", "specagent.cli", "serve", "--target", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no API keys configured" in done.stderr


@pytest.mark.slow  # a server process
def test_serve_drains_on_sigterm(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny"
    model = make_model(len(make_tokenizer()), seed=4, max_positions=4096)
    model.generation_config.eos_token_id = None  # nothing but the budget ends a call: the
    model.config.eos_token_id = None  # call below is surely in flight at SIGTERM
    model.save_pretrained(model_dir)
    no_eos = make_tokenizer()
    no_eos.eos_token = None
    no_eos.save_pretrained(model_dir)
    port = free_port()
    env = {**os.environ, "SPECAGENT_API_KEYS": f"ci={KEY}", "SPECAGENT_CACHE": str(tmp_path)}
    command = [sys.executable, "-m", "specagent.cli", "serve", "--target", str(model_dir)]
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        [*command, "--port", str(port), "--drain-seconds", "60"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        wait_until_up(process, url, tmp_path / "server.log")
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=5).json()
        assert "tiny:customer-reply" in {m["id"] for m in models["data"]}  # shipped policies

        events: list[dict] = []
        first = threading.Event()

        def stream() -> None:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Hello world"}],
                "max_tokens": 4000,
                "stream": True,
            }
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
            ) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    events.append({"done": True} if data == "[DONE]" else json.loads(data))
                    first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60), "no first chunk"
        process.send_signal(signal.SIGTERM)
        reader.join(120)
        assert not reader.is_alive()
        assert events[-1] == {"done": True}  # the call in flight was not cut
        finishing = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
        assert finishing[0]["choices"][0]["finish_reason"] == "length"
        server_log = (tmp_path / "server.log").read_text()
        # The call was in flight when the drain began (what happened, not how long it took).
        assert "calls in flight, which finish first: 1" in server_log, server_log
        try:  # after SIGTERM: 503 on a connection still open, or no longer listening
            late = httpx.get(f"{url}/ready", timeout=2)
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        assert process.wait(90) == 0
    finally:
        log.close()
        if process.poll() is None:
            process.kill()
            process.wait(10)
            pytest.fail("the server did not exit after SIGTERM")
