"""The import layers: no module of ``specagent.decoding`` imports another that imports it back
(at import time or inside a function), and the core never imports an engine, the runtime, a
front door (``specagent.errors``, the package's leaf of error types, excepted) or transformers.
The engines sit above the core's runner seam (``decoding.engine``); the runtime and the front
doors reach them through the engine seam only (``specagent.engines``: its package and
``engines.base``), and nothing on a call's path imports the measuring tools."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specagent"
DECODING = PACKAGE / "decoding"


def _runtime_imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """``specagent.*`` modules ``path`` (under the package directory ``root``) imports when it
    runs (``if TYPE_CHECKING:`` blocks never run and are left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            found.update(n for n in names if n.startswith("specagent"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("specagent"))
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


CORE = sorted(DECODING.rglob("*.py"))


def _decoding_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in CORE}
    return {
        name: {m for m in _runtime_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_no_import_cycle_in_the_decoding_core() -> None:
    graph = _decoding_graph()
    assert len(graph) > 10  # the walk found the modules
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("path", CORE, ids=_module_name)
def test_the_core_imports_no_engine_runtime_or_front_door(path: Path) -> None:
    outside = {
        m
        for m in _runtime_imports(path)
        if not m.startswith("specagent.decoding") and m not in ("specagent", "specagent.errors")
    }
    assert not outside, f"{path.name} imports {sorted(outside)}"


@pytest.mark.parametrize("path", sorted(DECODING.glob("*.py")), ids=lambda p: p.stem)
def test_the_core_touches_no_transformers_class(path: Path) -> None:
    """The core talks to engines through the seam only: no transformers cache class, model
    class or helper (they belong to ``engines.transformers``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {m for m in imported if m.split(".")[0] == "transformers"}, path.name


def test_the_walk_finds_imports_at_import_time_and_inside_functions(tmp_path: Path) -> None:
    """The checker itself: a planted pair of modules importing each other (one of them inside
    a function) is seen both ways."""
    planted = tmp_path / "specagent" / "decoding"
    planted.mkdir(parents=True)
    (planted / "a.py").write_text("from .b import x\n")
    (planted / "b.py").write_text("def f():\n    from .a import y\n")
    imports = {p.stem: _runtime_imports(p, tmp_path / "specagent") for p in planted.glob("*")}
    assert imports == {"a": {"specagent.decoding.b"}, "b": {"specagent.decoding.a"}}


CALL_PATH = sorted(
    [
        *(PACKAGE / "runtime").rglob("*.py"),
        *(PACKAGE / "server").rglob("*.py"),
        *(PACKAGE / name for name in ("calls.py", "call.py", "backend.py", "machine.py")),
    ]
)


@pytest.mark.parametrize("path", CALL_PATH, ids=_module_name)
def test_the_runtime_and_front_doors_reach_engines_through_their_seam(path: Path) -> None:
    """No engine's internals (``specagent.engines.transformers``, ``engines.llama_cpp``) and no
    measuring tool on a call's path: a new engine is one package and one registry line."""
    seam = ("specagent.engines", "specagent.engines.base", "specagent.engines.tools")
    reached = {
        m
        for m in _runtime_imports(path)
        if (m.startswith("specagent.engines.") and m not in seam)
        or m.startswith("specagent.measuring")
    }
    assert not reached, f"{path.name} imports {sorted(reached)}"


OUTSIDE_ENGINES = sorted(p for p in PACKAGE.rglob("*.py") if "engines" not in p.parts)
ENGINE_NAMES = {"transformers", "llama.cpp"}


@pytest.mark.parametrize("path", OUTSIDE_ENGINES, ids=_module_name)
def test_nothing_outside_the_engines_reaches_into_one_or_branches_on_its_name(path: Path) -> None:
    """The doctor, the benchmarks and the command line too: what differs by engine is the
    engine's to say (``engines.tools.EngineTools``, ``EngineModel.capabilities``), never an
    ``if engine == "..."`` nor an import of an engine's own modules."""
    seam = ("specagent.engines", "specagent.engines.base", "specagent.engines.tools")
    internals = {
        m for m in _runtime_imports(path) if m.startswith("specagent.engines.") and m not in seam
    }
    assert not internals, f"{path.name} imports {sorted(internals)}"
    branches = [
        ast.unparse(node)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Compare)
        and any(
            isinstance(side, ast.Constant) and side.value in ENGINE_NAMES
            for side in [node.left, *node.comparators]
        )
    ]
    assert not branches, f"{path.name} branches on an engine's name: {branches}"


@pytest.mark.parametrize("engine", sorted(ENGINE_NAMES))
def test_each_engines_tools_are_the_seams(engine: str) -> None:
    """Each engine's ``tools`` module has every member of ``EngineTools``, with its
    parameters."""
    import inspect

    from specagent.engines.tools import EngineTools, engine_tools

    tools = engine_tools(engine)
    for name, member in inspect.getmembers(EngineTools, inspect.isfunction):
        if name.startswith("_"):
            continue
        wanted = [p for p in inspect.signature(member).parameters if p != "self"]
        assert list(inspect.signature(getattr(tools, name)).parameters) == wanted, name


@pytest.mark.parametrize("path", CORE, ids=_module_name)
def test_the_core_holds_no_lock_and_touches_no_file(path: Path) -> None:
    """What is kept between calls, under locks, budgets and tenants, is the runtime's
    (``runtime.memory``); the core reaches it through a protocol or a plain value."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert not imported & {"threading", "pathlib", "os", "shutil", "tempfile"}, path.name
    opened = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "open"
    ]
    assert not opened, path.name
    assert not {m for m in _runtime_imports(path) if m.startswith("specagent.tenants")}, path.name
