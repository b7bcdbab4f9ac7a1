# Sourced by scripts/test after _env.sh: a second environment with the MPICH wheel instead
# of Open MPI, so the suite also runs poprun-lite and the collectives under MPICH's mpiexec
# (hydra). Exports POPDIST_LITE_MPICH_PYTHON; set POPDIST_LITE_SKIP_MPICH=1 to skip.
if ensure_venv "${VENV}-mpich" --editable "$ROOT[mpich]" pytest pytest-mpi pytest-timeout; then
    export POPDIST_LITE_MPICH_PYTHON="${VENV}-mpich/bin/python"
else
    echo "popdist-lite: no MPICH environment; its tests will be skipped" >&2
fi
