"""No function of the launcher (launcher/, every part, the test infrastructure too) runs
past MAX_LINES lines, from its ``def`` to its last line (nested functions count within
theirs): a longer one does several things, and reads better as several functions. Read
with :mod:`ast`; no code runs."""

import ast

from helpers import ROOT

#: The most lines a function may take.
MAX_LINES = 80


def long_functions(source: str, name: str, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for each function or method of ``source`` (the file
    ``name``) longer than ``limit`` lines."""
    return [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_long_functions_are_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(4))
    source = f"def short():\n{body}\nclass K:\n    def method(self):\n{body.replace('    ', '        ')}"
    assert long_functions(source, "m.py", limit=5) == []
    assert long_functions(source, "m.py", limit=4) == ["m.py:1 short (5 lines)", "m.py:8 method (5 lines)"]


def test_no_launcher_function_is_longer_than_max_lines():
    found = [line for path in sorted((ROOT / "launcher").rglob("*.py"))
             for line in long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, f"functions over {MAX_LINES} lines:\n" + "\n".join(found)
