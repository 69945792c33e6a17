"""The house rules that the layer contracts (pyproject.toml, `lint-imports`) do not state:
no import circle, one name for one thing, and no module over 300 lines outside the models,
the kernels and the benchmark runners."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import grimp

PACKAGE = Path(__file__).resolve().parents[1] / "pagedserve"
MAX_LINES = 300
# where long modules are allowed: a model, a kernel, a benchmark runner
LONG_ALLOWED = ("plugins/models/", "kernels/", "bench/")


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
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    """Imports under TYPE_CHECKING count too: a circle there is still a circle to a reader."""
    graph = grimp.build_graph("pagedserve")
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i.startswith("pagedserve")}
             for m in graph.modules}
    assert _cycles(edges) == []


def test_one_name_for_one_thing():
    """No two modules of the package share a file name (besides __init__ and main)."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            by_name[path.name].append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


def test_no_long_module_outside_models_kernels_and_benchmarks():
    long = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(LONG_ALLOWED):
            continue
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[relative] = lines
    assert long == {}
