"""Slurm's own commands, run and read as hostile input: the job id from the environment
(:func:`job_id`, :data:`JOB_ID`), one runner for ``scontrol``/``squeue``/``sinfo`` whose
output is read as it comes and stopped at a limit (:func:`query`; :func:`run` for
``scontrol`` itself, which must succeed), Slurm's host lists (:data:`NODELIST`,
:func:`expand_nodelist` through ``scontrol show hostnames``, checked name by name with
the grammar of :mod:`popdist_lite_launcher.core.hosts`), and a node's address in Slurm
(:func:`node_address`, its ``NodeAddr``, for nodes whose names do not resolve:
:func:`node_addresses`, the lookup the launcher's address takes inside an allocation).
Every Slurm command gets :data:`SCONTROL_TIMEOUT_SECONDS`."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from ..core.api import LauncherError
from ..core.hosts import MAX_HOSTNAME_CHARS, check_host
from ..core.text import clipped, shown
from ..launch import children
from ..launch.address import NodeAddress, resolve

#: Seconds a Slurm command (``scontrol``, ``squeue``, ``sinfo``) may take.
SCONTROL_TIMEOUT_SECONDS = 30.0
#: Most bytes read from ``scontrol show node``.
MAX_NODE_OUTPUT_BYTES = 1 << 16
#: Most bytes read from any other query (``squeue``, ``sinfo``, ``scontrol show job``,
#: ``scontrol show config``): a query stopped past it has failed.
MAX_OUTPUT_BYTES = 1 << 20
#: Longest node list and tasks-per-node text accepted.
MAX_TEXT_CHARS = 65536
#: Most nodes of an allocation: ``scontrol show hostnames`` is stopped at the name after.
MAX_NODES = 65536
#: A Slurm job id.
JOB_ID = re.compile(r"[0-9]{1,20}")
#: A Slurm host list (``node[1-3,5],gpu07``): letters, digits, ``.``, ``-``, ``,`` and
#: brackets, starting with a letter or digit (so never an option of ``scontrol``).
NODELIST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.,\[\]-]*")


def job_id(environ) -> str | None:
    """The allocation's job id (``SLURM_JOB_ID``, else ``SLURM_JOBID``), None outside one.

    Raises:
        LauncherError: it is set but not a job id (digits).
    """
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        value = environ.get(name)
        if value is not None:
            if not JOB_ID.fullmatch(value):
                raise LauncherError(f"${name} is not a Slurm job id (digits): {shown(value)}")
            return value
    return None


def query(argv: list[str], *, max_bytes: int, max_lines: int | None = None, lines_are: str = "lines",
          timeout: float = SCONTROL_TIMEOUT_SECONDS) -> subprocess.CompletedProcess:
    """Run one of Slurm's commands (``argv[0]`` a path, or a name found on PATH) with
    its output read as it comes and stopped at ``max_bytes`` bytes or ``max_lines``
    lines (``lines_are``: what a line is, for the message)
    (:func:`popdist_lite_launcher.launch.children.run_bounded`): its exit code, stdout
    (text, undecodable bytes replaced) and the end of its stderr.

    Raises:
        LauncherError: naming the command: not found, cannot be run, still running
            after ``timeout`` seconds, or printing more than a limit (killed).
    """
    shown = clipped(" ".join([Path(argv[0]).name, *argv[1:]]))
    tool = shutil.which(argv[0])
    if tool is None:
        raise LauncherError(f"cannot run `{shown}`: {argv[0]} not found" + ("" if "/" in argv[0] else " on PATH"))
    try:
        done, problem = children.run_bounded([tool, *argv[1:]], timeout=timeout, max_bytes=max_bytes,
                                             max_lines=max_lines, lines_are=lines_are, tail_bytes=600)
    except OSError as exc:
        raise LauncherError(f"cannot run `{shown}`: {exc}") from None
    if problem is not None:
        raise LauncherError(f"`{shown}` {problem}")
    return subprocess.CompletedProcess(argv, done.returncode, done.stdout.decode("utf-8", "replace"),
                                       done.stderr.decode("utf-8", "replace"))


def run(args: list[str], *, command: str | None = None, max_bytes: int = MAX_OUTPUT_BYTES,
        max_lines: int | None = None, lines_are: str = "lines") -> str:
    """``scontrol ARGS`` (``command``: the scontrol to run, default from PATH) through
    :func:`query`: its standard output.

    Raises:
        LauncherError: as :func:`query`, or the command (in backquotes) ``exited with
            N:`` and the end of what it printed.
    """
    proc = query([command or "scontrol", *args], max_bytes=max_bytes, max_lines=max_lines, lines_are=lines_are)
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip())[-300:]
        raise LauncherError(f"`{clipped(' '.join(['scontrol', *args]))}` exited with {proc.returncode}: {said}")
    return proc.stdout


def check_nodelist(text: str, name: str = "SLURM_JOB_NODELIST") -> str:
    """``text`` itself if it is a Slurm host list (:data:`NODELIST`) of at most
    :data:`MAX_TEXT_CHARS` characters.

    Raises:
        LauncherError: naming ``name`` and the value.
    """
    if not text or len(text) > MAX_TEXT_CHARS or not NODELIST.fullmatch(text):
        raise LauncherError(f"${name} is not a Slurm host list (node[1-3],other): {shown(text)}")
    return text


def parse_hostnames(output: str, name: str = "scontrol show hostnames") -> list[str]:
    """The node names ``scontrol show hostnames`` printed, one a line, each checked
    with :func:`popdist_lite_launcher.core.hosts.check_host`.

    Raises:
        LauncherError: a bad name (naming it), a name twice, no names, or more than
            :data:`MAX_NODES`.
    """
    nodes = [line.strip() for line in output.splitlines() if line.strip()]
    if not nodes:
        raise LauncherError(f"`{name}` printed no node names")
    if len(nodes) > MAX_NODES:
        raise LauncherError(f"`{name}` printed more than {MAX_NODES} node names")
    for node in nodes:
        try:
            check_host(node)
        except ValueError as exc:
            raise LauncherError(f"`{name}`: {exc}") from None
    if len(set(nodes)) != len(nodes):
        raise LauncherError(f"`{name}` printed a node name more than once")
    return nodes


def expand_nodelist(nodelist: str, scontrol: str | None = None) -> list[str]:
    """The nodes of a Slurm host list, in order, as ``scontrol show hostnames`` expands
    it: read as it prints them and stopped at the name after :data:`MAX_NODES` (a list
    of a few thousand characters can name millions), then checked by
    :func:`parse_hostnames`.

    Raises:
        LauncherError: a bad list, no ``scontrol``, or it failed, printed more than
            :data:`MAX_NODES` names or bad names.
    """
    check_nodelist(nodelist)
    scontrol = scontrol or shutil.which("scontrol")
    if not scontrol:
        raise LauncherError("inside a Slurm allocation, but `scontrol` is not on PATH (needed to "
                            "expand $SLURM_JOB_NODELIST); pass -H/--hostfile and --launcher ssh")
    return parse_hostnames(run(["show", "hostnames", nodelist], command=scontrol, max_lines=MAX_NODES,
                               lines_are="node names", max_bytes=MAX_NODES * (MAX_HOSTNAME_CHARS + 1)))


def node_address(node: str, scontrol: str | None = None) -> str:
    """The address Slurm reaches ``node`` at: its ``NodeAddr`` in ``scontrol -o show node
    NODE`` (the first, in the line of ``NodeName=NODE``; the fields after it hold free
    text), checked with :func:`popdist_lite_launcher.core.hosts.check_host`. It is the node's
    name itself where ``slurm.conf`` gives no other.

    Raises:
        LauncherError: ``node`` is not a host name, ``scontrol`` cannot be run or failed,
            or it printed no ``NodeAddr`` for ``node`` or a bad one.
    """
    try:
        check_host(node)
    except ValueError as exc:
        raise LauncherError(f"Slurm node {exc}") from None
    shown_node = run(["-o", "show", "node", node], command=scontrol, max_bytes=MAX_NODE_OUTPUT_BYTES)
    for line in shown_node.splitlines():
        if line.startswith(f"NodeName={node} "):
            found = re.search(r" NodeAddr=(\S*)", line)
            if found:
                try:
                    return check_host(found[1])
                except ValueError as exc:
                    raise LauncherError(f"`scontrol show node {node}`: NodeAddr {exc}") from None
    raise LauncherError(f"`scontrol show node {node}` printed no NodeAddr for {node}")


def route_to_node(node: str) -> str:
    """The IPv4 address of Slurm node ``node``, whose name does not resolve here: its
    ``NodeAddr`` (:func:`node_address`), itself resolved when a name.

    Raises:
        LauncherError: ``nor has Slurm an address for it: ...`` (:func:`node_address`'s
            error) or ``its NodeAddr in Slurm, ADDRESS: ...`` (it does not resolve).
    """
    try:
        address = node_address(node)
    except LauncherError as exc:
        raise LauncherError(f"nor has Slurm an address for it: {exc}") from None
    try:
        return resolve(address)
    except OSError as exc:
        raise LauncherError(f"its NodeAddr in Slurm, {address}: {exc}") from None


def node_addresses(environ) -> NodeAddress | None:
    """Inside a Slurm allocation (``environ`` holds its job id, :func:`job_id`),
    :func:`route_to_node`: where the launcher routes to a node whose name does not
    resolve here (:func:`popdist_lite_launcher.launch.address.launcher_address`, under
    either launcher); None outside one (Slurm is not asked).

    Raises:
        LauncherError: as :func:`job_id`.
    """
    return route_to_node if job_id(environ) is not None else None
