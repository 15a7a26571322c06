"""llama-cpp-python's low-level API, loaded once: its log routed to nowhere but errors, the
backend initialised, and what identifies the build (for keying what was proven on it)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from ...errors import ModelLoadError

__all__ = ["available", "build_info", "default_threads", "library"]


def available() -> bool:
    """Whether llama-cpp-python is installed (the ``gguf`` extra)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def library() -> Any:
    """The ``llama_cpp`` module, quiet and initialised; a clear error where it is missing."""
    try:
        import llama_cpp
    except ImportError as exc:
        msg = 'the llama.cpp engine needs llama-cpp-python: pip install "specagent[gguf]"'
        raise ModelLoadError(msg) from exc
    _quiet(llama_cpp)
    return llama_cpp


_LOG_LOCK = threading.Lock()
_LOG_CALLBACK: Any = None


def _quiet(lib: Any) -> None:
    """Route llama.cpp's own log lines (hundreds per load) to nowhere but errors: once."""
    global _LOG_CALLBACK
    with _LOG_LOCK:
        if _LOG_CALLBACK is not None:
            return

        def log(level: int, text: bytes, _user: Any) -> None:
            if level == 4 and text:  # GGML_LOG_LEVEL_ERROR
                os.write(2, b"llama.cpp: " + text)

        _LOG_CALLBACK = lib.llama_log_callback(log)
        lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        lib.llama_backend_init()


def default_threads() -> int:
    """llama.cpp's own default: the physical cores this process may use (at least one)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return max(1, usable)


@lru_cache(maxsize=1)
def build_info() -> dict[str, str]:
    """What this llama.cpp build is: llama-cpp-python's version, the CPU features ggml was
    compiled for (``llama_print_system_info``) and a digest of the native libraries' sizes and
    dates (a rebuild with other flags, same version, is another build)."""
    lib = library()
    folder = Path(lib.__file__).parent / "lib"
    files = (
        sorted(folder.glob("*.so*")) + sorted(folder.glob("*.dylib")) + sorted(folder.glob("*.dll"))
    )
    digest = hashlib.sha256()
    for path in files:
        if path.is_symlink():
            continue
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    system = lib.llama_print_system_info()
    return {
        "llama_cpp_python": str(getattr(lib, "__version__", "?")),
        "system_info": system.decode("utf-8", "replace").strip() if system else "",
        "libraries": digest.hexdigest()[:16],
    }
