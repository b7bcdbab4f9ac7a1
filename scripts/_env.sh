# Sourced by scripts/demo and scripts/test: make (or reuse) the virtual environment
# with popdist-lite and its test extras (mpi4py, numpy, the Open MPI wheel, pytest).
# VENV overrides where it lives (default: .venv in the project root); PYTHON picks
# the interpreter that creates it (default: python3, 3.10 or newer);
# POPDIST_LITE_EXTRAS the extras installed (default: test; scripts/test adds torch and jax);
# POPDIST_LITE_TORCHREC=1 adds TorchRec (ensure_torchrec; scripts/test sets it).
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

# ensure_torchrec DIR: TorchRec into the venv DIR beside its torch: the pins of
# pyproject.toml's [tool.popdist-lite] torchrec-no-deps, installed with --no-deps (the
# reason is there), then `import torchrec` and its DistributedModelParallel checked; a stamp
# as ensure_venv's (the pins and torch's version). On failure, prints why, leaves the
# reason in DIR/torchrec-unavailable.txt for the tests' skip messages (tests/helpers.py),
# uninstalls torchrec and fbgemm-gpu-cpu (nothing half-installed gets imported) and returns 1.
ensure_torchrec() {
    local dir="$1" py="$1/bin/python" log="$1/torchrec-install.log" note="$1/torchrec-unavailable.txt"
    local stamp="$1/.popdist-lite-torchrec" want pins torch_version reason
    # "PINS... torch VERSION" (torch's version from its metadata: importing it takes seconds)
    want="$("$py" - "$ROOT/pyproject.toml" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    import tomllib
except ImportError:  # Python 3.10: the TOML parser pip carries
    from pip._vendor import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    pins = tomllib.load(f)["tool"]["popdist-lite"]["torchrec-no-deps"]
try:
    torch = version("torch")
except PackageNotFoundError:
    torch = ""
print(" ".join(pins), "torch", torch)
PY
)"
    pins="${want% torch *}" torch_version="${want##* torch }"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    rm -f "$stamp"
    if [ -z "$pins" ]; then
        reason="no torchrec-no-deps pins in $ROOT/pyproject.toml's [tool.popdist-lite]"
    elif [ -z "$torch_version" ]; then
        reason="no torch in $dir (TorchRec needs the [torch] extra)"
    else
        echo "popdist-lite: installing TorchRec into $dir (pip install --no-deps $pins)" >&2
        if { "$py" -m pip install --no-deps --retries 2 --timeout 60 $pins \
             && "$py" -c "import torchrec, torchrec.models.dlrm
from torchrec.distributed.model_parallel import DistributedModelParallel"; } > "$log" 2>&1; then
            echo "$want" > "$stamp"
            rm -f "$note"
            return 0
        fi
        "$py" -m pip uninstall -y torchrec fbgemm-gpu-cpu >> "$log" 2>&1 || true
        reason="$(grep -E '^(ERROR: |[A-Za-z.]*(Error|Exception): )' "$log" | tail -n 1)"
        reason="${reason:-$(tail -n 1 "$log")} (log: $log)"
    fi
    echo "popdist-lite: no TorchRec: $reason; the tests that need it will be skipped" >&2
    echo "$reason" > "$note"
    return 1
}

ensure_venv "$VENV" --editable "$ROOT[${POPDIST_LITE_EXTRAS:-test}]" || exit 1
# POPDIST_LITE_TORCHREC=1 (scripts/test sets it): TorchRec too, for the tests and the
# benchmark against it; without it they are skipped, and the rest runs as before.
if [ "${POPDIST_LITE_TORCHREC:-0}" = 1 ]; then
    ensure_torchrec "$VENV" || true
fi
export PATH="$VENV/bin:$PATH"
export VENV ROOT
cd "$ROOT"
