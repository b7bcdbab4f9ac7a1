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
    log="$VENV/pip-install.log"
    if ! { "$VENV/bin/python" -m pip install --upgrade pip \
           && "$VENV/bin/python" -m pip install --editable "$ROOT[test]" \
           && "$VENV/bin/python" -c "import popdist_lite, popdist_lite_launcher, mpi4py, pytest"; } > "$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "popdist-lite: installation into $VENV failed (full log: $log)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export VENV ROOT
cd "$ROOT"
