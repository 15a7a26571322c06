"""Build llama.cpp's own server from the llama.cpp that the installed llama-cpp-python vendors,
so that ``specagent bench`` compares against llama-server built from the very sources the
llama.cpp engine runs (same kernels, same version), with the same native flags.

    python benchmarks/llama_server.py build       # prints the binary's path (minutes, once)
    SPECAGENT_LLAMA_SERVER=$(python benchmarks/llama_server.py path) \\
        specagent bench --workload agent --target qwen2.5-coder-1.5b-instruct

The source distribution comes from the package index (``pip download --no-binary``); cmake and
a C++ compiler must be installed. The build lands in the cache directory
(``$SPECAGENT_CACHE/llama-server/<version>``) and is reused.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent.catalog import cache_dir


def binary_path() -> Path:
    version = metadata.version("llama-cpp-python")
    return cache_dir() / "llama-server" / version / "llama-server"


def build() -> Path:
    binary = binary_path()
    if binary.is_file():
        return binary
    version = binary.parent.name
    with tempfile.TemporaryDirectory(prefix="specagent-llama-server-") as folder:
        work = Path(folder)
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                "-q", "-d", str(work), f"llama-cpp-python=={version}",
            ],
            check=True,
        )  # fmt: skip
        archive = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as sdist:
            sdist.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        build_dir = work / "build"
        subprocess.run(
            [
                "cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
            ],
            check=True,
        )  # fmt: skip
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j"], check=True
        )
        binary.parent.mkdir(parents=True, exist_ok=True)
        (build_dir / "bin" / "llama-server").replace(binary)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["build", "path"])
    args = parser.parse_args()
    print(build() if args.action == "build" else binary_path())


if __name__ == "__main__":
    main()
