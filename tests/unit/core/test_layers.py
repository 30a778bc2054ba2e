"""The import graph of asyncrl/, agents/, transfer_queue/, checkpoint_engine/, plane_common/ against docs/layers.md.

Built with `ast` (imports inside functions count; `if TYPE_CHECKING:` blocks do not), so nothing is
imported. Asserts: no import cycle and no import of a module above its layer, except the entries
the page lists as known, each of which must still exist (the list only shrinks).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("asyncrl", "agents", "transfer_queue", "checkpoint_engine", "plane_common")


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip.update(id(x) for b in n.body for x in ast.walk(b))
    return skip


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:  # the longest known module a dotted name starts with
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        pkg = mod if is_pkg else mod.rpartition(".")[0]
        out: set[str] = set()
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.Import):
                out.update(r for a in n.names if (r := resolve(a.name)))
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                    base = ".".join(parts + ([n.module] if n.module else []))
                out.update(r for a in n.names if (r := resolve(f"{base}.{a.name}")))
        out.discard(mod)
        graph[mod] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.add(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(scc)
    return found


def _block(name: str) -> list[str]:
    page = (ROOT / "docs" / "layers.md").read_text()
    m = re.search(rf"```{name}\n(.*?)```", page, re.S)
    assert m, f"docs/layers.md has no ```{name} block"
    return [line.split() for line in m.group(1).splitlines() if line.strip()]


def layer_table() -> dict[str, int]:
    return {prefix: int(row[0]) for row in _block("layers") for prefix in row[1:]}


def known() -> tuple[list[set[str]], set[tuple[str, str]]]:
    rows = _block("known")
    return ([set(r[1:]) for r in rows if r[0] == "cycle"],
            {(r[1], r[3]) for r in rows if r[0] == "upward"})


def layer_of(mod: str, table: dict[str, int]) -> int:
    parts = mod.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in table:
            return table[".".join(parts[:n])]
    raise AssertionError(f"{mod} is in no row of docs/layers.md: add its package or module there")


def upward_imports(graph: dict[str, set[str]], table: dict[str, int]) -> set[tuple[str, str]]:
    return {(m, w) for m, out in graph.items() for w in out if layer_of(w, table) > layer_of(m, table)}


@pytest.mark.timeout(30)
def test_the_graph_builder_sees_lazy_and_relative_imports_and_finds_a_loop(tmp_path):
    graph = import_graph()
    assert "asyncrl.trainer.advantages" in graph["asyncrl.trainer.synthetic"]  # an import inside a function
    assert "checkpoint_engine.backends.base" in graph["checkpoint_engine.backends.local"]
    assert "asyncrl.trainer.engine" not in graph["asyncrl.trainer.checkpoint"]  # under TYPE_CHECKING only
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.timeout(30)
def test_no_import_cycle_but_the_known_ones():
    known_cycles, _ = known()
    found = cycles(import_graph())
    new = [sorted(c) for c in found if not any(c <= k for k in known_cycles)]
    assert not new, f"import cycles (re-seat or invert them; docs/layers.md): {new}"
    gone = [sorted(k) for k in known_cycles if not any(c & k for c in found)]
    assert not gone, f"fixed: delete these `cycle` lines from docs/layers.md: {gone}"


@pytest.mark.timeout(30)
def test_no_module_imports_one_above_its_layer():
    table = layer_table()
    _, known_up = known()
    up = upward_imports(import_graph(), table)
    new = sorted(up - known_up)
    assert not new, "imports of a module above its layer (docs/layers.md): " + ", ".join(
        f"{m} ({layer_of(m, table)}) -> {w} ({layer_of(w, table)})" for m, w in new)
    gone = sorted(known_up - up)
    assert not gone, f"fixed: delete these `upward` lines from docs/layers.md: {gone}"


@pytest.mark.timeout(30)
def test_the_planes_import_nothing_above_them_and_agents_only_small_types():
    graph = import_graph()
    assert "plane_common.curve" in graph["plane_common.listener"]  # the graph covers the shared bottom package
    for mod, out in graph.items():
        top = mod.split(".")[0]
        if top in ("transfer_queue", "checkpoint_engine"):  # their own package and what both share
            assert all(w.split(".")[0] in (top, "plane_common") for w in out), (mod, sorted(out))
        if top == "plane_common":
            assert all(w.split(".")[0] == top for w in out), (mod, sorted(out))
    allowed = {"asyncrl.engines.base", "asyncrl.engines.sample", "asyncrl.types", "asyncrl.registry"}
    for mod, out in graph.items():
        if mod.startswith("agents"):
            assert {w for w in out if w.startswith("asyncrl")} <= allowed, (mod, sorted(out))
