# Sourced by scripts/demo and scripts/test: make (or reuse) the virtual environment
# with popdist-lite and its test extras (mpi4py, numpy, the Open MPI wheel, pytest).
# VENV overrides where it lives (default: .venv in the project root); PYTHON picks
# the interpreter that creates it (default: python3, 3.10 or newer).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "popdist-lite: creating $VENV" >&2
    "${PYTHON:-python3}" -m venv "$VENV"
fi
stamp="$VENV/.popdist-lite-installed"
want="$(cksum < "$ROOT/pyproject.toml") $ROOT"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "popdist-lite: installing .[test] into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
    "$VENV/bin/python" -m pip install --quiet --editable "$ROOT[test]" 2>&1 | grep -v "is ignored" >&2 || true
    "$VENV/bin/python" -c "import popdist_lite, popdist_lite_launcher, mpi4py, pytest" \
        || { echo "popdist-lite: installation into $VENV failed" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export VENV ROOT
cd "$ROOT"
