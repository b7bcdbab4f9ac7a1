"""POPDIST_LITE_STALL_TIMEOUT under plain mpirun (no poprun-lite): a replica that has
waited that long inside one collective prints its replica, operation, call number and
stack, and ends the job (long before the other replica would have entered it). Runs
under a timeout."""

import subprocess
import sys
import textwrap
from helpers import run_mpi, timeout_for

pytestmark = timeout_for(1)

PROG = textwrap.dedent("""
    import time
    import numpy as np
    import popdist_lite as pl

    def sleep_before_all_reduce():
        time.sleep(3600)

    pl.init()
    x = np.ones(3)
    pl.all_reduce(x)
    if pl.replica_id() == 1:
        sleep_before_all_reduce()
    pl.all_gather(x)
    print("finished", flush=True)
""")


def test_stall_timeout_under_plain_mpirun(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    proc = run_mpi(2, [sys.executable, str(prog)], env={"POPDIST_LITE_STALL_TIMEOUT": "3"})
    assert proc.returncode != 0
    assert "finished" not in proc.stdout
    err = proc.stderr
    assert "popdist-lite: stall timeout: replica 0 (" in err, err
    assert "in all_gather (collective call #1), which another replica has not entered " \
           "(POPDIST_LITE_STALL_TIMEOUT=3)" in err
    stack = err[err.index("Python stack of replica 0:"):]
    assert "in all_gather" in stack and "<module>" in stack


def test_work_outside_collectives_is_not_a_stall(tmp_path):
    # 3 s of work outside any collective, longer than the 1 s timeout: not a stall
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent("""
        import time
        import numpy as np
        import popdist_lite as pl
        pl.init()
        pl.all_reduce(np.ones(2))
        time.sleep(3)
        pl.all_reduce(np.ones(2))
        print("finished", flush=True)
    """))
    proc = run_mpi(1, [sys.executable, str(prog)], env={"POPDIST_LITE_STALL_TIMEOUT": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "finished" in proc.stdout and "stall timeout" not in proc.stderr
