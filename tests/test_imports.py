"""specpass's own import graph: no circles, and nothing from the model zoo.

Every `import` statement counts, those under `if TYPE_CHECKING:` and inside functions too: a
circle deferred to call time is still a circle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specpass

ROOT = Path(specpass.__file__).parent


def modules() -> dict[str, Path]:
    """'specpass.a.b' -> its file, for every module of the package."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if path.name == "__init__.py" else parts)] = path
    return found


def imported(name: str, path: Path) -> set[str]:
    """Every module name `name` imports, absolute (relative imports resolved), submodules included."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            out |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return out


def graph() -> dict[str, set[str]]:
    """module -> the specpass modules it imports. A submodule importing its own package's __init__
    (e.g. for a name the package re-exports) is not an edge: that is how packages load."""
    mods = modules()

    def owner(name: str) -> str | None:  # the longest specpass module a dotted name is in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, path in mods.items():
        targets = {owner(n) for n in imported(name, path)} - {None, name}
        edges[name] = {t for t in targets if not (name.startswith(t + ".") and mods[t].name == "__init__.py")}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_relative_and_deferred_imports(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("from . import sibling\nfrom .pkg import name\ndef f():\n    import specpass.late\n")
    assert imported("specpass.sub.mod", path) == {
        "specpass.sub", "specpass.sub.sibling", "specpass.sub.pkg", "specpass.sub.pkg.name", "specpass.late"}


def test_specpass_has_no_import_circle():
    edges = graph()
    assert len(edges) > 30  # the walk found the package
    assert circles(edges) == []


def test_specpass_never_imports_the_model_zoo():
    zoo = {name: sorted(n for n in imported(name, path) if n == "models" or n.startswith("models."))
           for name, path in modules().items()}
    assert {name: found for name, found in zoo.items() if found} == {}
