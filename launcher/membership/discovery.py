"""Host discovery for elastic jobs: ``--host-discovery-script PATH`` (Horovod Elastic's
contract, ``horovodrun --host-discovery-script``).

The script is run without arguments and with an empty standard input, at the job's
start, before every attempt and every ``--discovery-interval`` seconds during a run. It
prints the hosts available now, one per line, in the hostfile grammar of
:mod:`popdist_lite_launcher.core.hosts` (``host:slots`` as Horovod's scripts print, or Open
MPI's ``host slots=N``; ``#`` comments and blank lines are ignored); a host without slots
holds one replica (with its feeders). It exits with code 0; printing no host means none
is available now. Its output is untrusted input: every host name must pass
:func:`popdist_lite_launcher.core.hosts.check_host` (so none can be taken for an option), a host
may be listed once, and at most :data:`MAX_OUTPUT_BYTES` are read.

A script that fails (exit code, cannot be run), hangs (still running after
:data:`DISCOVERY_TIMEOUT_SECONDS`: its whole process group is killed) or prints
something that is not a host line raises :class:`DiscoveryError`, naming the script and
the line or the exit code and the end of its stderr. What the launcher does with that
(stop at the start, retry later) is in :mod:`popdist_lite_launcher.membership.elastic`.
"""

from __future__ import annotations

from ..core import hosts
from ..core.api import LauncherError
from ..launch import children

#: Seconds a discovery script may run before it is killed and the discovery fails.
DISCOVERY_TIMEOUT_SECONDS = 10.0
#: Most bytes of a discovery script's output read (stdout; stderr's end is kept).
MAX_OUTPUT_BYTES = 1 << 20
#: Most hosts a discovery script may list: an attempt probes only as many of them, in
#: order, as it needs, but a longer list is refused as a runaway script.
MAX_HOSTS = 1024
_STDERR_TAIL_BYTES = 2000


class DiscoveryError(LauncherError):
    """The discovery script failed, hung or printed something that is not a host line."""


def parse(text: bytes, script: str) -> list[tuple[str, int | None]]:
    """``(host, slots or None)`` for every host line of a discovery script's output.

    Raises:
        DiscoveryError: naming ``script`` and the line: a bad line, text that is not
            UTF-8, a host listed twice, or more than :data:`MAX_HOSTS` hosts.
    """
    found: list[tuple[str, int | None]] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.split(b"\n"), 1):
        try:
            host = hosts.parse_hostfile_line(raw.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError too
            problem = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc
            raise DiscoveryError(f"host discovery script {script}, line {number}: {problem}") from None
        if host is None:
            continue
        key = hosts.host_key(host[0])  # Node1 is node1
        if key in first_line:
            raise DiscoveryError(f"host discovery script {script}, line {number}: host {host[0]} "
                                 f"listed again (first on line {first_line[key]})")
        if len(found) == MAX_HOSTS:
            raise DiscoveryError(f"host discovery script {script}, line {number}: more than "
                                 f"{MAX_HOSTS} hosts listed (the most poprun-lite takes)")
        first_line[key] = number
        found.append(host)
    return found


def discover(script: str, timeout: float = DISCOVERY_TIMEOUT_SECONDS) -> list[tuple[str, int | None]]:
    """Run the discovery ``script`` and return its hosts, in the order printed. The
    script runs in its own session (:mod:`popdist_lite_launcher.launch.children`); its process
    group is SIGKILLed when it ends, however it ends, and by
    :func:`children.kill_all <popdist_lite_launcher.launch.children.kill_all>`.

    Raises:
        DiscoveryError: the script cannot be run, exits with another code than 0, is
            still running after ``timeout`` seconds, prints more than
            :data:`MAX_OUTPUT_BYTES` or a line that is not a host (:func:`parse`).
    """
    try:
        done, problem = children.run_bounded([script], timeout=timeout, max_bytes=MAX_OUTPUT_BYTES,
                                             tail_bytes=_STDERR_TAIL_BYTES)
    except OSError as exc:
        raise DiscoveryError(f"host discovery script {script} cannot be run: {exc}") from None
    out, err, code = done.stdout, done.stderr, done.returncode
    said = err.decode("utf-8", "replace").strip().splitlines()[-3:]
    said = ": " + " / ".join(said) if said else ""
    if problem is not None:
        raise DiscoveryError(f"host discovery script {script}: {problem}{said}")
    if code != 0:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise DiscoveryError(f"host discovery script {script} {how}{said}")
    return parse(out, script)

