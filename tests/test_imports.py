"""``import popdist_lite`` starts nothing: no MPI, no exit handler, no thread; the
launcher and its agents import the record format and progress slot without MPI; no
module of the library or the launcher imports itself through others (the import graph,
read with :mod:`ast`, counting imports inside functions)."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import JOB_SECONDS


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=JOB_SECONDS)


@pytest.mark.parametrize("module", ["popdist_lite", "popdist_lite.records", "popdist_lite.progress"])
def test_import_starts_nothing(module):
    proc = run(f"""
        import atexit, sys, threading
        before = atexit._ncallbacks()
        import {module}
        assert "mpi4py.MPI" not in sys.modules, "imported mpi4py.MPI"
        optional = set(sys.modules).intersection(["torch", "jax", "flax", "matplotlib"])
        assert not optional, f"imported the optional {{optional}}"
        assert atexit._ncallbacks() == before, "registered an exit handler"
        assert threading.active_count() == 1, "started a thread"
        print("clean")
    """)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


@pytest.mark.parametrize("module", ["popdist_lite_launcher.cli", "popdist_lite_launcher.node.agent"])
def test_launcher_imports_no_mpi(module):
    proc = run(f"""
        import sys
        import {module}
        assert "mpi4py.MPI" not in sys.modules, "imported mpi4py.MPI"
        print("clean")
    """)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


def test_names_load_on_first_use_and_infeed_stays_the_function():
    proc = run("""
        import sys
        import popdist_lite as pl
        import popdist_lite.infeed.structure   # a submodule of the infeed package
        assert callable(pl.infeed) and pl.infeed.__name__ == "infeed", pl.infeed
        assert "mpi4py.MPI" not in sys.modules
        pl.init()                                  # MPI starts here
        assert "mpi4py.MPI" in sys.modules
        import numpy as np
        assert pl.all_reduce(np.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
        assert pl.wait_checkpoint is pl.checkpoint.wait
        missing = [name for name in pl.__all__ if not hasattr(pl, name)]
        assert not missing, missing
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.parametrize("binding, framework, extra", [("popdist_lite.torch", "torch", "torch"),
                                                      ("popdist_lite.jax", "jax", "jax")])
def test_a_binding_without_its_framework_names_the_extra(binding, framework, extra):
    proc = run(f"""
        import sys
        sys.modules["{framework}"] = None   # as if it were not installed: import raises ModuleNotFoundError
        try:
            import {binding}
        except ImportError as exc:
            print(f"{{type(exc).__name__}}: {{exc}}")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"ImportError: {binding} needs ") and f"pip install 'popdist-lite[{extra}]'" \
        in proc.stdout, proc.stdout


# ---------------------------------------------------------------- the import graph

ROOT = Path(__file__).resolve().parents[1]
#: package directory -> the name it is imported by (the launcher installs as popdist_lite_launcher).
PACKAGES = {"popdist_lite": "popdist_lite", "launcher": "popdist_lite_launcher"}


def _modules() -> dict[str, Path]:
    """Every module of the packages by its dotted name (a package by its own name)."""
    found = {}
    for directory, name in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the packages it imports, wherever the import statement is
    (module level, in a function or a method; relative or absolute), ``TYPE_CHECKING``
    blocks aside. ``from P import n`` is an edge to ``P.n`` when that is a module, else
    to ``P``; ``import P.Q`` is an edge to ``P.Q``."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module (Tarjan's algorithm, then a shortest cycle through
    the component's first module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        members, start = set(component), component[0]
        previous: dict[str, str | None] = {start: None}
        frontier = [start]
        while frontier:  # breadth first inside the component, from start
            reached = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w not in previous:
                        previous[w] = v
                        reached.append(w)
            frontier = reached
        last = min((v for v in previous if start in graph[v]), key=lambda v: (_depth(previous, v), v))
        path = [last]
        while previous[path[-1]] is not None:
            path.append(previous[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def _depth(previous: dict, v: str) -> int:
    depth = 0
    while previous[v] is not None:
        v, depth = previous[v], depth + 1
    return depth


def test_find_cycles_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "popdist_lite.services" in graph["popdist_lite.topology"]  # inside init()
    assert "popdist_lite.collectives.agreement" in graph["popdist_lite.collectives._common"]
    assert "popdist_lite.progress" in graph["popdist_lite_launcher.node.rank_progress"]  # absolute, across packages
    assert "popdist_lite_launcher.core.channel" in graph["popdist_lite_launcher.node.link"]  # from ..core import channel


def test_no_import_cycle():
    """No module imports itself through others, counting imports inside functions (a
    cycle works today only by the order of first calls, and breaks when it changes)."""
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
