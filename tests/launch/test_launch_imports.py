"""The package's import graph has no cycle: every ``import`` and ``from ... import`` of an
``ep_runtime`` module counts, wherever it is written (module level, inside a function, or under
``if TYPE_CHECKING:``), read from the source with ``ast``. A cycle is reported as its modules in
order, e.g. ``ep_runtime.launch.hf_run -> ep_runtime.launch.rank -> ... -> hf_run``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ep_runtime"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports: ``from a import b`` names ``a.b`` when that
    is a module, else ``a``; relative imports are resolved against the file's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return found & modules


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(paths)
    return {name: imported_modules(path, name, modules) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a closed path of modules, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert graph.get("ep_runtime.launch.rank")
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_finds_a_cycle_through_a_type_checking_import(tmp_path: Path) -> None:
    """Negative control: the shape of the launcher's old circle (a -> b at module level, b -> a
    under TYPE_CHECKING), in a scratch package."""
    package = tmp_path / "ep_runtime"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("from ep_runtime.sub.b import B\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\nB = 1\n"
    )
    graph = import_graph(package)
    assert graph["ep_runtime.sub.a"] == {"ep_runtime.sub.b"}
    assert graph["ep_runtime.sub.b"] == {"ep_runtime.sub.a"}
    assert find_cycle(graph) == ["ep_runtime.sub.a", "ep_runtime.sub.b", "ep_runtime.sub.a"]
