"""What the README and docs/*.md name exists: every ``poprun-lite`` flag they show (in
poprun-lite command lines, in code blocks and in inline code, and in the table columns
headed ``option`` or ``poprun-lite``) is an option of the launcher's parser, and every public name they
reference as ``pl.NAME``, ``popdist_lite.NAME`` (dotted paths too, e.g.
``popdist_lite.torch.HostEmbedding``) or, in the bindings' documents, ``pt.NAME`` /
``plj.NAME`` resolves in the library. Single process; the markdown is parsed with
regular expressions."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from popdist_lite_launcher.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Aliases the documents import the library under (``import popdist_lite.torch as pt``).
ALIASES = {"pl": "popdist_lite", "popdist_lite": "popdist_lite", "pt": "popdist_lite.torch",
           "plj": "popdist_lite.jax"}
#: A flag: -X or --word-word, not inside a word (``-np``, ``--num-replicas``).
FLAG = re.compile(r"(?<![\w.-])(--?[A-Za-z][\w-]*)")
NAME = re.compile(r"(?<![\w.])(pl|popdist_lite|pt|plj)((?:\.[A-Za-z_]\w*)+)")


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)


def _commands(text: str) -> list[str]:
    """The poprun-lite command lines of a document: in code blocks (continuation lines
    joined) and inline code that starts with ``poprun-lite``."""
    found = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("poprun-lite "):
                found.append(line)
    found += [m for m in re.findall(r"`(poprun-lite [^`]+)`", text)]
    return found


def _option_cells(text: str) -> list[str]:
    """The cells of the launcher's columns of tables: a column headed ``option`` or
    ``poprun-lite``."""
    cells, columns = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        row = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if columns is None:  # a header
            columns = [i for i, head in enumerate(row) if head in ("option", "poprun-lite")]
        elif not all(set(cell) <= set("-: ") for cell in row):
            cells += [row[i] for i in columns if i < len(row)]
    return cells


def _parser_options():
    parser = build_parser()
    return parser, parser._option_string_actions  # option string -> action


def _flags_of_command(line: str, actions) -> list[str]:
    """The launcher's flags in one command line: the options before the program (an
    option's value is skipped; the program's own options are not the launcher's)."""
    try:
        words = shlex.split(line)[1:]
    except ValueError:  # an unbalanced quote in prose
        words = line.split()[1:]
    flags, i = [], 0
    while i < len(words):
        word = words[i]
        if word.startswith("[") or word in ("...",):  # [options], placeholders
            i += 1
            continue
        if not word.startswith("-"):
            break  # the program
        flag = word.split("=", 1)[0]
        flags.append(flag)
        action = actions.get(flag)
        i += 2 if action is not None and action.nargs != 0 and "=" not in word else 1
    return flags


def test_the_parsers_view_of_a_command_line():
    _, actions = _parser_options()
    assert _flags_of_command("poprun-lite --num-replicas 2 -v --timeline t.json python3 train.py --steps 3",
                             actions) == ["--num-replicas", "-v", "--timeline"]
    assert _flags_of_command("poprun-lite [options] program [args...]", actions) == []
    table = "| option | meaning |\n|---|---|\n| `-H/--host h0,h1`, `--hostfile F` | hosts |\n"
    assert [FLAG.findall(cell) for cell in _option_cells(table)] == [["-H", "--host", "--hostfile"]]


def _documented_flags() -> dict[str, list[str]]:
    """flag -> where it is shown (``file:what``)."""
    _, actions = _parser_options()
    shown: dict[str, list[str]] = {}
    for path in DOCS:
        text = path.read_text()
        for line in _commands(text):
            for flag in _flags_of_command(line, actions):
                shown.setdefault(flag, []).append(f"{path.relative_to(ROOT)}: {line}")
        for cell in _option_cells(text):
            for flag in FLAG.findall(cell):
                shown.setdefault(flag, []).append(f"{path.relative_to(ROOT)}: | {cell} |")
    return shown


def test_every_documented_poprun_lite_flag_exists():
    _, actions = _parser_options()
    shown = _documented_flags()
    assert {"--num-replicas", "--timeline", "--feeders-per-replica", "-H", "--max-restarts"} <= set(shown)
    # another launcher's option, refused with a hint, is hidden from --help: not poprun-lite's
    missing = {flag: where[:2] for flag, where in shown.items()
               if flag not in actions or actions[flag].help == argparse.SUPPRESS}
    assert not missing, f"flags the docs show that poprun-lite does not have: {missing}"


def _resolve(dotted: str):
    """The object a dotted path names: attributes, or submodules where an attribute is
    missing (``popdist_lite.infeed`` is a function, ``popdist_lite.infeed.receiver`` a
    module). Raises AttributeError or ImportError."""
    parts = dotted.split(".")
    path, obj = parts[0], importlib.import_module(parts[0])
    for part in parts[1:]:
        path = f"{path}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(path)
    return obj


def _documented_names() -> dict[str, list[str]]:
    """dotted name (with the alias expanded) -> where it is referenced."""
    names: dict[str, list[str]] = {}
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for alias, rest in NAME.findall(line):
                if alias in ("pt", "plj") and path.name not in ("torch.md", "jax.md"):
                    continue  # the bindings' aliases, where their documents define them
                dotted = ALIASES[alias] + rest
                if rest.split(".")[-1] in ("py", "md", "json"):  # a file: popdist_lite/records.py
                    continue
                names.setdefault(dotted, []).append(f"{path.relative_to(ROOT)}:{n}")
    return names


def test_every_documented_public_name_exists():
    names = _documented_names()
    assert {"popdist_lite.init", "popdist_lite.all_gather", "popdist_lite.timeline.span"} <= set(names)
    missing = {}
    for dotted, where in sorted(names.items()):
        if dotted.startswith("popdist_lite.torch"):
            pytest.importorskip("torch")
        if dotted.startswith("popdist_lite.jax"):
            pytest.importorskip("jax")
        try:
            _resolve(dotted)
        except (AttributeError, ImportError) as exc:
            missing[dotted] = (where[:3], f"{type(exc).__name__}: {exc}")
    assert not missing, f"names the docs reference that do not exist: {missing}"
