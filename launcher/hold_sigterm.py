"""SIGTERM held by the job's processes, acted on by poprun-lite alone, while preemption is
on (``--preemption``, launcher/preempt.py; docs/slurm.md).

Slurm signals the processes of a job, not only poprun-lite: ``scancel --signal=TERM
JOBID`` and a preemption with a ``GraceTime`` send SIGTERM to every process of every
step (the MPI daemons it started on other nodes, the agents and the programs there),
and a cancel or a time limit sends it to the batch step too. Left alone, the MPI
daemons (Open MPI's ``prted``, MPICH's ``hydra_pmi_proxy``) and mpirun end the job on
it at once, and no checkpoint is saved. So with preemption on:

* mpirun starts with SIGTERM blocked (:func:`block`, in its ``preexec_fn``), and
  poprun-lite stops it with SIGINT instead (:data:`STOP_SIGNAL`);
* the MPI daemons on other nodes start through this file run as a script
  (:func:`daemon_command`: ``python -S hold_sigterm.py COMMAND...`` blocks SIGTERM and
  execs COMMAND): Open MPI's ``prte_launch_agent``, MPICH's srun through
  :data:`SRUN_HELD` (its ``-launcher-exec``), which puts it before ``hydra_pmi_proxy``;
* each agent (launcher/agent.py, :class:`Watch`) blocks SIGTERM and waits for it: from
  its parent (the MPI daemon ending the job) it stops its program; from anyone else
  (Slurm) it tells poprun-lite with a ``signalled`` record, and poprun-lite asks every
  replica for a checkpoint at its next step boundary, as on its own SIGTERM;
* the program starts with SIGTERM and SIGINT ignored (:func:`ignore_in_child`); its agent
  stops it with SIGKILL, and Slurm's SIGKILL after ``KillWait`` ends everything in any
  case.

``srun`` (the one that runs the daemons, in the batch step) answers a SIGTERM with
"forcing job termination"; for a job Slurm is already ending (a cancel, a time limit)
that changes nothing before ``KillWait`` is over, as the Slurm tests show
(tests/slurm/test_slurm_preempt.py), and ``scancel --signal=TERM`` does not signal the
batch step at all.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

#: "1" in an agent's environment: hold SIGTERM (:class:`Watch`).
ENV = "POPRUN_LITE_HOLD_SIGTERM"
#: The python that runs this file on the nodes, for :data:`SRUN_HELD`.
PYTHON_ENV = "POPRUN_LITE_HOLD_PYTHON"
#: What poprun-lite sends mpirun to stop a job whose processes hold SIGTERM.
STOP_SIGNAL = signal.SIGINT
#: MPICH's srun (``-launcher-exec``): srun with ``hydra_pmi_proxy`` started through this file.
SRUN_HELD = str(Path(__file__).with_name("srun-held"))
_THIS = str(Path(__file__).resolve())


def block() -> None:
    """Block SIGTERM in the calling thread (a ``preexec_fn``: in the child before its
    exec, whose mask the new program keeps)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def ignore_in_child() -> None:
    """In a child before its exec (``preexec_fn``): SIGTERM and SIGINT unblocked and
    ignored, as the new program then starts (an ignored signal stays ignored across exec,
    and Python then installs no KeyboardInterrupt handler): Slurm's SIGTERM and the
    SIGINT MPICH's hydra sends every process when it ends a job pass the program by; its
    agent ends it with SIGKILL."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def daemon_command(command: str) -> str | None:
    """``command`` (one word, e.g. ``prted``) run through this file by this python, as one
    space-separated string (Open MPI's ``prte_launch_agent``), or None when a path has a
    space (the string is split on spaces)."""
    words = [sys.executable, "-S", _THIS, command]
    return None if any(" " in word for word in words) else " ".join(words)


class Watch:
    """An agent's SIGTERM, held: :meth:`start` blocks it in the calling thread (call it
    before any other thread starts, so that every thread blocks it) and waits for it in
    a thread of its own (``sigwaitinfo``): a SIGTERM from ``parent`` (the pid of the MPI
    daemon that started the agent) calls ``on_parent()``, any other ``on_other(pid)``."""

    def __init__(self, parent: int, on_parent, on_other):
        self.parent, self.on_parent, self.on_other = parent, on_parent, on_other

    def start(self) -> "Watch":
        block()
        threading.Thread(target=self._wait, daemon=True, name="poprun-lite SIGTERM").start()
        return self

    def _wait(self) -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == self.parent:
                self.on_parent()
            else:
                self.on_other(info.si_pid)


def main(argv: list[str]) -> None:
    """``python -S hold_sigterm.py COMMAND [ARGS...]``: exec COMMAND with SIGTERM blocked;
    ``python -S hold_sigterm.py --srun ARGS...``: exec ``srun ARGS`` with this file put
    before the argument that names ``hydra_pmi_proxy`` (and the step named for the proxy,
    not for python)."""
    if argv[:1] == ["--srun"]:
        args = argv[1:]
        at = next((i for i, arg in enumerate(args) if os.path.basename(arg) == "hydra_pmi_proxy"), None)
        if at is not None:
            args[at:at] = [sys.executable, "-S", _THIS]
        argv = ["srun", "--job-name=hydra_pmi_proxy", *args]  # the step's name in sacct
    else:
        block()
    if not argv:
        print("usage: hold_sigterm.py COMMAND [ARGS...] | --srun ARGS...", file=sys.stderr)
        sys.exit(2)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"hold_sigterm: cannot run {argv[0]!r}: {exc}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
