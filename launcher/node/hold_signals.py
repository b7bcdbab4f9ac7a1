"""The scheduler's signals held by the job's processes, acted on by poprun-lite alone,
while preemption is on (``--preemption``, launcher/slurm/preempt.py; docs/slurm.md).

Slurm signals the processes of a job, not only poprun-lite: ``scancel --signal=SIG
JOBID`` and ``sbatch --signal=SIG@SECONDS`` (no ``B:``) send SIG to every process of
every step (the MPI daemons it started on other nodes, the agents and the programs
there), a preemption with a ``GraceTime`` sends SIGTERM the same way, ``scancel --full``
and a cancel or a time limit reach the batch step too. Left alone, the MPI daemons
(Open MPI's ``prted``, MPICH's ``hydra_pmi_proxy``) and mpirun end the job on SIGTERM,
and forward SIGUSR1 to the agents, which die of it, so no checkpoint is saved. So with
preemption on, the **held signals** (:data:`ENV`: SIGTERM and the requeue signal,
SIGUSR1 by default) are:

* blocked in mpirun (:func:`block`, in its ``preexec_fn``); poprun-lite stops it with
  SIGINT instead (:data:`STOP_SIGNAL`);
* blocked in the MPI daemons on other nodes, which start through this file run as a
  script (:func:`daemon_command`: ``python -S hold_signals.py COMMAND...`` blocks them
  and execs COMMAND): Open MPI's ``prte_launch_agent``, MPICH's srun through
  :data:`~popdist_lite_launcher.slurm.launcher.SRUN_HELD` (its ``-launcher-exec``), which puts it before ``hydra_pmi_proxy``;
* waited for by each agent (launcher/node/agent.py, :class:`Watch`): SIGTERM from its parent
  (the MPI daemon ending the job) stops its program; any held signal from anyone else
  (Slurm, or any process of the job's user: docs/security.md) becomes a ``signalled``
  record, and poprun-lite decides, once for all the processes one signal reached
  (launcher/slurm/preempt.py);
* ignored by the program from its exec (:func:`ignore_in_child`), SIGINT too (MPICH's
  hydra sends it every process when it ends a job), until ``popdist_lite.init()``
  replaces each ignored disposition by a handler that does nothing
  (:func:`popdist_lite.held_signals.hold_signals`): a handler is reset to the default by
  ``exec``, and the library resets it after ``fork``, so the program's children start
  with default dispositions. The agent stops its program with SIGKILL, and Slurm's
  SIGKILL after ``KillWait`` ends everything in any case.

``srun`` (the one that runs the daemons, in the batch step) answers a SIGTERM with
"forcing job termination"; for a job Slurm is already ending (a cancel, a time limit)
that changes nothing before ``KillWait`` is over, as the Slurm tests show
(tests/slurm/test_slurm_preempt.py), and ``scancel --signal=TERM`` does not signal the
batch step at all. The srun that runs the daemons inherits mpirun's blocked signals and
forwards none.

A signal Slurm sends the job's steps reaches only the ranks that run in a step: under
Open MPI the ranks on the batch script's node are mpirun's own children, in the batch
step. So inside a Slurm job poprun-lite also runs a **watch step** on its node
(:func:`watch`, started by :meth:`popdist_lite_launcher.slurm.preempt.Preemption.watch_steps`):
one task that holds the signals and prints each one's name for poprun-lite.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from pathlib import Path

#: The held signals' names, comma-separated (``SIGTERM,SIGUSR1``), in the environment of
#: mpirun, the daemons, the agents and the programs: hold them (:class:`Watch`,
#: :func:`block`). The same name as :data:`popdist_lite.records.HOLD_ENV` (this file also
#: runs as a script under ``python -S``, without the package).
ENV = "POPRUN_LITE_HOLD_SIGNALS"
#: The python that runs this file on the nodes, for
#: :data:`~popdist_lite_launcher.slurm.launcher.SRUN_HELD`.
PYTHON_ENV = "POPRUN_LITE_HOLD_PYTHON"
#: What poprun-lite sends mpirun to stop a job whose processes hold SIGTERM.
STOP_SIGNAL = signal.SIGINT
#: The held signals when :data:`ENV` names none.
DEFAULT_HELD = (signal.SIGTERM, signal.SIGUSR1)
_THIS = str(Path(__file__).resolve())
_NEVER = {signal.SIGKILL, signal.SIGSTOP}


def die_with_parent() -> None:
    """In a child before its exec (``preexec_fn``): get SIGKILL when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``, Linux only; nothing elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - best effort, never fail the exec
        pass


def child_preexec(then=None):
    """A child's ``preexec_fn``: :func:`die_with_parent` (Linux), then ``then()`` when
    given (e.g. the signal state the new program starts with:
    :func:`block` for mpirun, :func:`ignore_in_child` for a program whose agent holds
    SIGTERM); None when there is nothing to do."""
    linux = sys.platform.startswith("linux")
    if then is None:
        return die_with_parent if linux else None

    def preexec() -> None:
        if linux:
            die_with_parent()
        then()
    return preexec


def env_value(signals) -> str:
    """:data:`ENV`'s value for ``signals`` (numbers)."""
    return ",".join(signal.Signals(s).name for s in signals)


def held(environ=None) -> tuple[int, ...]:
    """The held signals :data:`ENV` names in ``environ`` (default ``os.environ``), SIGTERM
    always among them; :data:`DEFAULT_HELD` when it names none. Names that are not
    signals, or that cannot be held (SIGKILL, SIGSTOP), are left out."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    found = []
    for name in text.split(","):
        try:
            signum = signal.Signals[name.strip()]
        except KeyError:
            continue
        if signum not in _NEVER and signum not in found:
            found.append(signum)
    if not found:
        return tuple(int(s) for s in DEFAULT_HELD)
    return tuple(int(s) for s in dict.fromkeys([signal.SIGTERM, *found]))


def block(signals=None) -> None:
    """Block ``signals`` (default :func:`held`) in the calling thread (a ``preexec_fn``:
    in the child before its exec, whose mask the new program keeps)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(held() if signals is None else signals))


def ignore_in_child(signals=None) -> None:
    """In a child before its exec (``preexec_fn``): ``signals`` (default :func:`held`) and
    SIGINT unblocked and ignored, as the new program then starts (an ignored signal stays
    ignored across exec, and Python then installs no KeyboardInterrupt handler): Slurm's
    signals and the SIGINT MPICH's hydra sends every process when it ends a job pass the
    program by until ``popdist_lite.init()`` holds them itself; its agent ends it with
    SIGKILL."""
    signals = {*(held() if signals is None else signals), signal.SIGINT}
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def daemon_command(command: str) -> str | None:
    """``command`` (one word, e.g. ``prted``) run through this file by this python, as one
    space-separated string (Open MPI's ``prte_launch_agent``), or None when a path has a
    space (the string is split on spaces). The daemon holds the signals of :data:`ENV`
    in its environment."""
    words = [sys.executable, "-S", _THIS, command]
    return None if any(" " in word for word in words) else " ".join(words)


class Watch:
    """An agent's held signals (``signals``), waited for: :meth:`start` blocks them in the
    calling thread (call it before any other thread starts, so that every thread blocks
    them) and waits for them in a thread of its own (``sigwaitinfo``): SIGTERM from
    ``parent`` (the pid of the MPI daemon that started the agent) calls ``on_parent()``;
    another held signal from the parent is dropped (the daemons hold them: one that
    reaches the agent through its parent would be a second copy of a signal Slurm sent
    the agent too); any held signal from anyone else calls ``on_other(signum, pid)``."""

    def __init__(self, parent: int, on_parent, on_other, signals=None):
        self.parent, self.on_parent, self.on_other = parent, on_parent, on_other
        self.signals = set(held() if signals is None else signals)

    def start(self) -> "Watch":
        block(self.signals)
        threading.Thread(target=self._wait, daemon=True, name="poprun-lite held signals").start()
        return self

    def _wait(self) -> None:
        while True:
            info = signal.sigwaitinfo(self.signals)
            if info.si_pid == self.parent:
                if info.si_signo == signal.SIGTERM:
                    self.on_parent()
            else:
                self.on_other(info.si_signo, info.si_pid)


def watch() -> None:
    """``python -S hold_signals.py --watch``: block the held signals (:func:`held`) and print
    the name of each one that comes, a line each, until standard input ends (poprun-lite's
    watch step, :meth:`popdist_lite_launcher.slurm.preempt.Preemption.watch_steps`)."""
    signals = set(held())
    block(signals)  # before the thread: every thread blocks them

    def report() -> None:
        while True:
            signum = signal.sigwaitinfo(signals).si_signo
            try:
                print(signal.Signals(signum).name, flush=True)
            except (OSError, ValueError):  # poprun-lite is gone
                os._exit(0)
    threading.Thread(target=report, daemon=True).start()
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)


def main(argv: list[str]) -> None:
    """``python -S hold_signals.py COMMAND [ARGS...]``: exec COMMAND with the held signals
    (:func:`held`) blocked; ``python -S hold_signals.py --srun ARGS...``: exec ``srun ARGS``
    with this file put before the argument that names ``hydra_pmi_proxy`` (and the step
    named for the proxy, not for python); ``--watch``: :func:`watch`."""
    if argv == ["--watch"]:
        watch()
    if argv[:1] == ["--srun"]:
        args = argv[1:]
        at = next((i for i, arg in enumerate(args) if os.path.basename(arg) == "hydra_pmi_proxy"), None)
        if at is not None:
            args[at:at] = [sys.executable, "-S", _THIS]
        argv = ["srun", "--job-name=hydra_pmi_proxy", *args]  # the step's name in sacct
    else:
        block()
    if not argv:
        print("usage: hold_signals.py COMMAND [ARGS...] | --srun ARGS...", file=sys.stderr)
        sys.exit(2)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"hold_signals: cannot run {argv[0]!r}: {exc}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
