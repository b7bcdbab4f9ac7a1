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
    rm -f "$mpich_stamp"
    if { "$MPICH_VENV/bin/python" -m pip install --editable "$ROOT[mpich]" pytest pytest-mpi pytest-timeout \
         && "$MPICH_VENV/bin/python" -c "import popdist_lite, mpi4py.MPI"; } > "$MPICH_VENV/pip-install.log" 2>&1; then
        echo "$mpich_want" > "$mpich_stamp"
    else
        tail -n 20 "$MPICH_VENV/pip-install.log" >&2
        echo "popdist-lite: MPICH environment failed; its tests will be skipped" >&2
    fi
fi
if [ -f "$mpich_stamp" ]; then
    export POPDIST_LITE_MPICH_PYTHON="$MPICH_VENV/bin/python"
fi
