"""The package's shape: no source file over 800 lines and no import cycle.

Both are read from the source, not from an import: a file's physical lines (docstrings
included, as ``wc -l`` counts them), and every ``import`` / ``from ... import`` statement of
every module, those inside functions included (an import moved into a function still ties
the two modules together) and those under ``if TYPE_CHECKING:`` left out (they never run).
Function complexity is the linter's part: ruff's C901 at max-complexity 15 (pyproject.toml).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "functopt"
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, outside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                pending.extend(getattr(child, "orelse", []))
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            else:
                pending.append(child)
    return out


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. ``from a.b import c`` names ``a.b.c``
    when that is a module, else ``a.b``."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [owner(f"{base}.{a.name}") if f"{base}.{a.name}" in modules
                           else owner(base) for a in node.names]
            edges[name].update(t for t in targets if t is not None and t != name)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_source_file_is_over_the_limit() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_no_import_cycle() -> None:
    cycles = _cycles(_edges(_modules()))
    assert not cycles, f"modules that import each other (directly or around a cycle): {cycles}"


def test_the_cycle_finder_sees_a_cycle_and_a_function_level_import(tmp_path: Path) -> None:
    # the checks above prove nothing if the finder misses what it looks for: a two-module
    # cycle closed by an import inside a function, and one hidden under TYPE_CHECKING only
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from pkg import d\n")
    (package / "d.py").write_text("from . import c\n")
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    assert _cycles(_edges(modules)) == [["pkg.a", "pkg.b"]]
