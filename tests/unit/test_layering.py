"""The package's layering: its import graph has no cycle, and the math (``ops``) and
planning (``plan``) modules import nothing from the runtime, the optimizer or the adapters.

Read from the source (every ``import`` statement, also those under ``TYPE_CHECKING`` and
inside functions), so no module is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dmuon_titan"
#: the modules that only stand in for a moved one (``sys.modules`` aliases)
ALIASES = {
    "dmuon_titan.fused",
    "dmuon_titan.muon",
    "dmuon_titan.naive",
    "dmuon_titan.newton_schulz",
    "dmuon_titan.plan.cost",
    "dmuon_titan.step_graph",
    "dmuon_titan.symmetric",
    "dmuon_titan.update",
}
#: pure layers and the packages they must not reach
PURE = {
    "dmuon_titan.ops": ("dmuon_titan.runtime", "dmuon_titan.optim", "dmuon_titan.titan"),
    "dmuon_titan.plan": ("dmuon_titan.runtime", "dmuon_titan.optim", "dmuon_titan.titan"),
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module of the package under ``root`` → the package's modules it imports."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets.add(stem)
                targets.update(f"{stem}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if (cycle := visit(name)) is not None:
            return cycle
    return None


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exports its modules, which import siblings through
    it (``from . import x``): edges into a package's own ``__init__`` from inside it are
    that, not layering."""
    return {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph.items()
    }


def test_the_import_graph_has_no_cycle():
    graph = _without_package_inits(import_graph())
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_math_and_planning_import_no_runtime_optimizer_or_adapter():
    graph = import_graph()
    for name, targets in graph.items():
        for layer, forbidden in PURE.items():
            if name == layer or name.startswith(layer + "."):
                bad = sorted(t for t in targets if t.startswith(forbidden))
                assert not bad, f"{name} imports {bad}"


def test_the_aliases_are_the_moved_modules():
    import importlib

    for name in sorted(ALIASES):
        module = importlib.import_module(name)
        assert module.__name__ != name, name  # (the moved module itself, not a copy)


@pytest.mark.parametrize("kind", ["cycle", "pure"])
def test_the_checks_fail_on_a_bad_import(tmp_path, kind):
    """A package with an added cycle, or a math module importing the runtime, is caught."""
    root = tmp_path / "dmuon_titan"
    for sub in ("ops", "runtime"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "runtime" / "state.py").write_text("from ..ops import kernel\n")
    (root / "runtime" / "hooks.py").write_text("from .state import x\n")
    bad = "from ..runtime import state\n" if kind == "pure" else ""
    (root / "ops" / "kernel.py").write_text(bad)
    if kind == "cycle":
        (root / "runtime" / "state.py").write_text("from . import hooks\n")
    graph = import_graph(root)
    if kind == "cycle":
        assert find_cycle(_without_package_inits(graph)) is not None
    else:
        assert "dmuon_titan.runtime.state" in graph["dmuon_titan.ops.kernel"]
