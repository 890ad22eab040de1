"""The package's import graph has no cycle, function-local and TYPE_CHECKING imports included.

A cycle hidden behind a function-local import still couples two modules both ways: neither
can be read, tested or replaced alone. This test parses every module of ``tdckpt`` (no
import is executed) and computes the strongly connected components of the graph of
``import`` / ``from ... import`` statements anywhere in a module.

``KNOWN_CYCLES`` is empty: the storage seam (issue 21) removed the last cycle (the manager,
the object-storage manager, the sharded save/restore and the restore engine importing each
other). The test fails when a cycle appears, and when a layer below the manager (the store,
sharding, the pipelines) reaches up to it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tdckpt"

KNOWN_CYCLES: list[frozenset[str]] = []

#: The layers below the manager (see docs/architecture in the README): none of them may
#: import ``tdckpt.manager`` or the CLI, directly or through another module.
BELOW_THE_MANAGER = (
    "tdckpt._store",
    "tdckpt._shard",
    "tdckpt._state",
    "tdckpt._upgrade",
    "tdckpt._restore",
    "tdckpt._write",
    "tdckpt._read",
    "tdckpt._remote",
    "tdckpt._manage",
)


def _modules(package: Path) -> dict[str, Path]:
    mods = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body)."""
    mods = _modules(package)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{alias.name}" for alias in node.names]
                found = [sub for sub in subs if sub in mods]
                if len(found) < len(subs):  # a name from the module itself
                    found.append(target)
            elif isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(f for f in found if f in mods and f != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_local_and_type_checking_imports_count(tmp_path: Path) -> None:
    # The graph sees imports inside a function body or under TYPE_CHECKING: the two ways the
    # old cycles hid.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n"
    )
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.sub.b"})]


def test_no_import_cycle_beyond_the_known_one() -> None:
    found = sorted(cycles(import_graph()), key=sorted)
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not new, f"new import cycle(s), function-local imports included: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"a known cycle changed or is gone; update KNOWN_CYCLES: {gone}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = [start]
    while stack:
        for dep in graph[stack.pop()]:
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


def test_no_layer_below_the_manager_imports_it() -> None:
    graph = import_graph()
    assert any(m.startswith("tdckpt._store.") for m in graph)  # the store layer exists
    upward = {
        name: sorted(
            module
            for module in _reachable(graph, name)
            if module in ("tdckpt.manager", "tdckpt.cli") or module.startswith("tdckpt._cli")
        )
        for name in graph
        if name.startswith(BELOW_THE_MANAGER)
    }
    assert not {k: v for k, v in upward.items() if v}, upward
