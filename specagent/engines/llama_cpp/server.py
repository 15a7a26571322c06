"""llama.cpp's own server (``llama-server``) as a benchmark baseline: what Ollama and llama-server
users run, on the same GGUF file with the same threads and the same fast paths the runtime's
llama.cpp engine proved on this machine (``--no-repack`` where weight repacking is off).

One server per mode, each with one slot and its prompt cache on, as an agent's process would
run it (each turn starts from the KV the last one left in the slot), but without its host-memory
cache of earlier prompts (``--cache-ram 0``): the benchmarks start every method's episode or
prompt cold (specagent's prefix cache is cleared), and a second round would otherwise find the
whole prefills of the first kept there. Each round starts on new servers (``new_round``, which
the benches call before a round, untimed): ``ngram-mod`` keeps its n-gram table across requests,
and would draft a second round's replies from the first's, where specagent's history is cleared
every round.

Modes: ``plain`` greedy decoding, and the n-gram speculative modes ``ngram-mod`` (drafts of 48 to
64 tokens from a 24-token match) and ``ngram-cache``. A call is one ``POST /completion`` with the
prompt as token ids, greedy, returning the generated token ids; the time is the client's.

The binary comes from ``$SPECAGENT_LLAMA_SERVER`` or the ``PATH``; ``benchmarks/llama_server.py
build`` builds it from the llama.cpp that the installed llama-cpp-python vendors (same sources
as the engine's)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..tools import Method, OtherPrograms

__all__ = ["MODES", "LlamaServer", "find_llama_server", "llama_server_methods"]

MODES: dict[str, list[str]] = {
    "llama_server": [],
    "llama_server_ngram_mod": ["--spec-type", "ngram-mod"],
    "llama_server_ngram_cache": ["--spec-type", "ngram-cache"],
}
"""Each baseline's name and the flags of its mode."""


def find_llama_server() -> str | None:
    """``$SPECAGENT_LLAMA_SERVER``, else ``llama-server`` on the ``PATH`` (None: neither)."""
    named = os.environ.get("SPECAGENT_LLAMA_SERVER")
    if named:
        return named if Path(named).is_file() else None
    return shutil.which("llama-server")


@functools.lru_cache(maxsize=8)
def _flags(binary: str) -> str:
    """The binary's ``--help`` text (an older build lacks some flags)."""
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LlamaServer:
    """A ``llama-server`` process serving one GGUF on a local port until ``close``."""

    def __init__(
        self,
        binary: str,
        model: Path,
        *,
        threads: int,
        context_tokens: int,
        batch_tokens: int,
        repack: bool,
        flash_attention: bool,
        extra: list[str],
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            binary,
            "-m", str(model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "-t", str(threads),
            "-tb", str(threads),
            "-c", str(context_tokens),
            "-b", str(batch_tokens),
            "-ub", str(batch_tokens),
            "-np", "1",
            "-fa", "on" if flash_attention else "off",
            *([] if repack else ["--no-repack"]),
            *(["--cache-ram", "0"] if "--cache-ram" in _flags(binary) else []),
            *extra,
        ]  # fmt: skip
        self.command = command
        self._start()

    def _start(self) -> None:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def restart(self) -> None:
        """A new process with the same command: nothing of earlier requests kept."""
        self.close()
        self._start()

    def _wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({self.process.returncode}):\n{self.log()}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not become ready in {timeout:.0f} s")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-3000:]

    def complete(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``ids`` (up to ``max_new_tokens``; stops at end of text)."""
        body = {
            "prompt": ids,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": True,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            f"{self.url}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        return [int(t) for t in answer.get("tokens", [])]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


@contextlib.contextmanager
def llama_server_methods(
    runtime: Any, max_new_tokens: int, binary: str | None = None
) -> Iterator[OtherPrograms]:
    """A method per mode of ``MODES`` (``engines.tools.Method``) over the runtime's llama.cpp
    target, each on its own server, for the duration of the block, and what restarts them all
    (``new_round``); none where no binary."""
    binary = binary or find_llama_server()
    if binary is None:
        yield OtherPrograms.none()
        return
    model = runtime.target
    servers: dict[str, LlamaServer] = {}
    try:
        for name, extra in MODES.items():
            servers[name] = LlamaServer(
                binary,
                model.path,
                threads=model.threads,
                context_tokens=min(model.context_tokens, 16384),
                batch_tokens=model.batch_tokens,
                repack=model.fast_paths.enabled("repack"),
                flash_attention=model.flash_attention,
                extra=extra,
            )
        eos = set(runtime.eos_token_ids)

        def method(server: LlamaServer) -> Method:
            def run(ids: list[int], seed: int) -> tuple[list[int], Any]:
                tokens = server.complete(ids, max_new_tokens)
                return [t for t in tokens if t not in eos], None

            return run

        def new_round() -> None:
            for server in servers.values():
                server.restart()

        yield OtherPrograms({name: method(s) for name, s in servers.items()}, new_round)
    finally:
        for server in servers.values():
            server.close()
