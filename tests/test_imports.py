"""``import popdist_lite`` starts nothing: no MPI, no exit handler, no thread; the
launcher and its agents import the record format and progress slot without MPI; no
module of the library or the launcher imports itself through others (the import graph,
read with :mod:`ast`, counting imports inside functions and in ``TYPE_CHECKING``
blocks); and the launcher's parts import only the parts they stand on (``ALLOWED``:
core imports no other part, ssh and slurm never each other, nothing imports testing)."""

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


def imports_of(source: str, name: str, modules, is_package: bool = False) -> set[str]:
    """The modules of ``modules`` that module ``name`` (a package when ``is_package``) of
    text ``source`` imports, wherever the import statement is: at module level, in a
    function or a method, in a ``TYPE_CHECKING`` block (an import cycle through one is
    still a circle of the design); relative or absolute. ``from P import n`` is an edge
    to ``P.n`` when that is a module, else to ``P``; ``import P.Q`` is an edge to ``P.Q``."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the packages it imports (:func:`imports_of`)."""
    modules = _modules()
    return {name: imports_of(path.read_text(), name, modules, path.name == "__init__.py")
            for name, path in modules.items()}


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


def test_import_graph_sees_function_level_relative_and_type_checking_imports():
    graph = import_graph()
    assert "popdist_lite.services" in graph["popdist_lite.topology"]  # inside init()
    assert "popdist_lite.collectives.agreement" in graph["popdist_lite.collectives._common"]
    assert "popdist_lite.progress" in graph["popdist_lite_launcher.node.rank_progress"]  # absolute, across packages
    assert "popdist_lite_launcher.core.channel" in graph["popdist_lite_launcher.node.link"]  # from ..core import channel
    modules = {"p", "p.a", "p.b", "p.c", "p.d"}
    source = textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .b import Thing
        def later():
            from . import c
        class K:
            def method(self):
                import p.d
    """)
    assert imports_of(source, "p.a", modules) == {"p.b", "p.c", "p.d"}


def test_no_import_cycle():
    """No module imports itself through others, counting imports inside functions and in
    ``TYPE_CHECKING`` blocks (a cycle works today only by the order of first calls, and
    breaks when it changes; one through type hints is a circle of the design all the
    same)."""
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# ---------------------------------------------------------------- the launcher's parts

LAUNCHER = "popdist_lite_launcher"
#: The launcher's parts (its subpackages, and its top-level modules) and the parts each may
#: import (docs/launcher.md, "The parts"): core is the vocabulary and imports no other
#: part; what runs on a rank's host (node) and what watches the job (supervise) stand on
#: core alone; the mpirun launch (launch) on those three; the backends ssh and slurm on
#: launch and never on each other; the membership policies on launch and supervise;
#: testing is imported by nothing of the launcher.
ALLOWED = {
    "core": set(),
    "node": {"core"},
    "supervise": {"core"},
    "launch": {"core", "node", "supervise"},
    "membership": {"core", "launch", "supervise"},
    "ssh": {"core", "launch"},
    "slurm": {"core", "node", "supervise", "launch", "membership"},
    "attempts": {"core", "launch", "supervise"},
    "cli": {"core", "node", "supervise", "launch", "membership", "ssh", "slurm", "attempts", LAUNCHER},
    "__main__": {"cli"},
    LAUNCHER: set(),
    "testing": {"core", "node", "supervise", "launch", "membership", "ssh", "slurm", "attempts", "cli"},
}


def part(module: str) -> str:
    """The part of the launcher ``module`` belongs to: ``popdist_lite_launcher.launch.base``
    -> ``launch``, ``popdist_lite_launcher.cli`` -> ``cli``, the package itself ->
    ``popdist_lite_launcher``."""
    return module.split(".")[1] if "." in module else module


def edges_between_parts() -> dict[tuple[str, str], list[str]]:
    """(part, part it imports) -> the imports that make that edge (``module -> module``)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, imported in import_graph().items():
        for target in imported:
            if module.startswith(LAUNCHER) and target.startswith(LAUNCHER) and part(module) != part(target):
                edges.setdefault((part(module), part(target)), []).append(f"{module} -> {target}")
    return edges


def _shown(edges) -> str:
    return "\n".join(f"  {a} imports {b}: " + ", ".join(sorted(edges[a, b])) for a, b in sorted(edges))


def test_every_part_is_placed():
    """Every subpackage and top-level module of the launcher has its line in ALLOWED: a new
    part says where it stands."""
    parts = {part(module) for module in _modules() if module.startswith(LAUNCHER)}
    assert parts == set(ALLOWED), f"parts not in ALLOWED: {sorted(parts - set(ALLOWED))}; " \
                                  f"in ALLOWED, not in launcher/: {sorted(set(ALLOWED) - parts)}"


def test_each_part_imports_only_what_it_stands_on():
    wrong = {(a, b): found for (a, b), found in edges_between_parts().items() if b not in ALLOWED.get(a, set())}
    assert not wrong, "imports across the parts that ALLOWED does not allow:\n" + _shown(wrong)


def test_core_imports_nothing_else_of_the_launcher():
    found = {edge: modules for edge, modules in edges_between_parts().items() if edge[0] == "core"}
    assert not found, "core imports other parts of the launcher:\n" + _shown(found)


def test_ssh_and_slurm_never_import_each_other():
    found = {edge: modules for edge, modules in edges_between_parts().items()
             if set(edge) == {"ssh", "slurm"}}
    assert not found, "the backends import each other:\n" + _shown(found)


def test_production_never_imports_testing():
    found = {edge: modules for edge, modules in edges_between_parts().items()
             if edge[1] == "testing" and edge[0] != "testing"}
    assert not found, "production code imports the test infrastructure:\n" + _shown(found)
