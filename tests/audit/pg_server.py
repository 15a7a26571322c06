"""A real PostgreSQL server for the tests, started from the installed binaries (Debian's
``postgresql`` package; ``.ci/run`` installs it): ``initdb`` into a temporary folder, then
``pg_ctl`` on a free local port. Stopped and started again by the outage tests. As root (CI),
the server runs as the ``postgres`` user: PostgreSQL refuses to run as root."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["PostgresServer", "postgres_binaries"]


def postgres_binaries() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl`` (None: PostgreSQL is not installed)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    def __init__(self, folder: Path) -> None:
        binaries = postgres_binaries()
        assert binaries is not None
        self.bin = binaries
        self.data = folder / "data"
        self.log = folder / "server.log"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(folder, "postgres", "postgres")
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust"])
        self.start()
        self._run([str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                   "-U", "postgres", "audit"])  # fmt: skip
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/audit"

    def _run(self, command: list[str]) -> None:
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data}"
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                   "-o", options, "-w", "start"])  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"PostgreSQL did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"])
