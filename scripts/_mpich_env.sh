# Sourced by scripts/test: a second environment with the MPICH wheel instead of Open MPI,
# so the suite also runs poprun-lite and the collectives under MPICH's mpiexec (hydra).
# Exports POPDIST_LITE_MPICH_PYTHON; set POPDIST_LITE_SKIP_MPICH=1 to skip.
MPICH_VENV="${VENV}-mpich"
if [ ! -x "$MPICH_VENV/bin/python" ]; then
    echo "popdist-lite: creating $MPICH_VENV (MPICH)" >&2
    "${PYTHON:-python3}" -m venv "$MPICH_VENV"
fi
mpich_stamp="$MPICH_VENV/.popdist-lite-installed"
mpich_want="$(cksum < "$ROOT/pyproject.toml") $ROOT"
if [ ! -f "$mpich_stamp" ] || [ "$(cat "$mpich_stamp")" != "$mpich_want" ]; then
    echo "popdist-lite: installing .[mpich] into $MPICH_VENV" >&2
    "$MPICH_VENV/bin/python" -m pip install --quiet --editable "$ROOT[mpich]" pytest pytest-mpi pytest-timeout \
        2>&1 | grep -v "is ignored" >&2 || true
    "$MPICH_VENV/bin/python" -c "import popdist_lite, mpi4py.MPI" && echo "$mpich_want" > "$mpich_stamp"
fi
[ -f "$mpich_stamp" ] && export POPDIST_LITE_MPICH_PYTHON="$MPICH_VENV/bin/python"
