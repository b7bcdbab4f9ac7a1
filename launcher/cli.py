"""``poprun-lite``: its options (:func:`build_parser`, :func:`parse_args`, which returns
them typed, :class:`~popdist_lite_launcher.core.options.Options`) and ``main``, the one
place that wires the launcher's parts together: the options, a membership policy
(:func:`make_policy`), a launcher backend (:func:`make_launcher`: ssh or Slurm), the
preemption, and the attempts loop (:mod:`popdist_lite_launcher.attempts`).

The job is planned as a list of :class:`~popdist_lite_launcher.core.plan.RankSpec` by
:func:`~popdist_lite_launcher.core.plan.plan_ranks`;
:func:`~popdist_lite_launcher.launch.command.build_command` turns that list into the MPMD
mpirun command. New kinds of ranks (e.g. host feeders) only need new specs in
``plan_ranks`` and new options in :func:`build_parser` and ``Options``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys

from . import __version__
from .attempts import AttemptsLoop
from .core import hosts
from .core.api import LauncherError, MembershipPolicy
from .core.options import END_MARGIN_SECONDS, NUM_REPLICAS_ALIASES, REFUSED_OPTIONS, Options
from .launch import children
from .launch.address import NodeAddress
from .launch.base import MpirunLauncher
from .launch.command import check_program, detect_implementation, find_mpirun
from .launch.mpirun import kill_sessions
from .membership import elastic
from .membership.policies import ElasticPolicy, FixedPolicy
from .slurm import allocation, nodes, preempt, scontrol
from .slurm.launcher import SlurmLauncher
from .ssh.launcher import SshLauncher
from .supervise import report

EPILOG = """\
examples:
  poprun-lite --num-replicas 4 python3 train.py --epochs 2
      4 replicas, one MPI rank each, on this machine
  poprun-lite --num-replicas 4 -H host0,host1 python3 train.py
      2 instances (replicas) on each host
  poprun-lite --num-replicas 2 --mpi-global-args="--mca btl_tcp_if_include eth0" \\
      --mpi-local-args="-x MY_VAR" python3 train.py
  poprun-lite --num-replicas 4 --only-output-from-instance 0 --print-topology python3 train.py
  poprun-lite -v --timeout 600 --num-replicas 2 python3 train.py
  poprun-lite --num-replicas 2 --timeline trace.json python3 train.py
      one Chrome-trace file with a track per replica (open in ui.perfetto.dev)
  poprun-lite --num-replicas 2 --feeders-per-replica 2 --print-topology python3 train.py
      2 replicas, each fed by 2 host feed processes (popdist_lite.infeed)
  poprun-lite --num-replicas 8 -H node0:4,node1:4 --network-interface 10.1.0.0/16 python3 train.py
      4 replicas on each host, traffic on 10.1.0.0/16; every host is checked first: a probe
      started with `ssh -- HOST` must reach poprun-lite over that network (--launch-agent
      replaces ssh, --no-host-check skips the check)
  poprun-lite --num-replicas 4 --min-replicas 2 --host-discovery-script ./hosts.sh \\
      python3 train.py --checkpoint-dir ckpt --resume
      an elastic job: 2 to 4 replicas on the hosts ./hosts.sh prints (host:slots lines);
      it shrinks when a host is lost and grows when one comes back (docs/elastic.md)
  poprun-lite --print-topology python3 train.py        (in an sbatch script, no -H)
      hosts, slots and replicas from the Slurm allocation; processes on other nodes start
      through Slurm, so scancel ends them all (--launcher; docs/slurm.md)
      SIGUSR1 (sbatch --signal=B:USR1@120) or SIGTERM to poprun-lite there: the replicas
      checkpoint at their next step boundary (popdist_lite.should_checkpoint()); after
      SIGUSR1 the job is requeued (scontrol requeue) (--preemption, --requeue-signal,
      --no-requeue, --grace-period)

Each rank gets POPDIST_NUM_TOTAL_REPLICAS, POPDIST_NUM_IPUS_PER_REPLICA,
POPDIST_NUM_LOCAL_REPLICAS=1, POPDIST_UNIFORM_REPLICAS_PER_INSTANCE=1,
POPDIST_REPLICA_INDEX_OFFSET, POPDIST_LOCAL_INSTANCE_INDEX, POPDIST_LITE_ROLE,
POPRUN_LITE_COLLECTOR (where its agent sends records), POPDIST_LITE_FEEDERS_PER_REPLICA (and
POPDIST_LITE_TIMELINE with --timeline). The agents also get the job's key (a new one for
every attempt) in a file of their own on their host, named by POPRUN_LITE_KEY_FILE and
removed before the program starts: it is on no command line and in no environment. Feeders (ranks after the replicas, on their replica's host) get their
replica's variables plus POPDIST_LITE_ROLE=feeder, POPDIST_LITE_FEEDER_OF and
POPDIST_LITE_FEEDER_INDEX. OMP_NUM_THREADS and the BLAS thread variables default to 1.
Replicas also get torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
and MASTER_PORT (rank 0's host and a port reserved there), so that
torch.distributed.init_process_group("gloo") works unchanged; when poprun-lite's stdout is
a terminal, every rank gets its size in COLUMNS and LINES (and its pty that size). A
variable of these already in poprun-lite's environment is passed on as it is.
-np N (horovodrun's, mpirun's) is --num-replicas N; torchrun's, horovodrun's and PopRun's
options that mean nothing here are refused with what to use instead (docs/migration.md).
mpirun: --mpirun, $POPRUN_LITE_MPIRUN, mpirun/mpiexec on PATH, or next to Python.
"""


def _number(parse, minimum, what: str):
    """An argparse ``type``: ``parse(text)`` (int or float) that is at least ``minimum``."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {parse.__name__} value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value:g}")
        return value
    return convert


#: Default of ``--stall-timeout``; under plain mpirun each rank reads it itself.
STALL_TIMEOUT_ENV = "POPDIST_LITE_STALL_TIMEOUT"

_positive_int = _number(int, 1, "at least 1")
_non_negative_int = _number(int, 0, "0 or more")
_non_negative_float = _number(float, 0, "0 or more")


def _host_list(text: str) -> list[tuple[str, int | None]]:
    try:
        return hosts.parse_host_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _instance_args(text: str) -> tuple[int, list[str]]:
    index, sep, args = text.partition(":")
    if not sep or not index.strip().isdecimal():
        raise argparse.ArgumentTypeError(f"expected IDX:\"ARGS\", got {text!r}")
    return int(index), shlex.split(args)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, ``poprun-lite: error: ...`` (the
    usage of some forty options would bury it; ``--help`` lists them)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments"):
            message += " (poprun-lite --help lists the options)"
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Refused(argparse.Action):
    """An option of torchrun, horovodrun or PopRun that means nothing here
    (:data:`~popdist_lite_launcher.core.options.REFUSED_OPTIONS`): refused with its
    hint, ``--nproc-per-node 2: ... use --num-replicas 2 ...``."""

    def __init__(self, option_strings, dest, hint: str, **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        value = values if isinstance(values, str) and self.nargs != "?" else ""  # "?": maybe the program
        given = f"{option_string} {value}" if value else option_string
        parser.error(f"{given}: {self.hint.format(value=value or 'N')}")


def _refused_options(parser: argparse.ArgumentParser) -> None:
    """Other launchers' options, each refused with what to use instead (hidden from --help)."""
    for flags, value, hint in REFUSED_OPTIONS:
        nargs = "?" if value == "?" else None if value else 0
        parser.add_argument(*flags, action=_Refused, nargs=nargs, hint=hint,
                            dest=f"refused_{flags[0].lstrip('-')}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``poprun-lite`` (options in groups, easy to extend)."""
    parser = _Parser(
        prog="poprun-lite", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] program [args...]",
        allow_abbrev=False,  # never take a program option (e.g. --mpi) for one of ours
        description="Launch a replicated program with MPI: one MPI rank (instance) per\n"
                    "replica, the PopDist environment in every rank, and a failure report\n"
                    "naming the root cause.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _topology_options(parser)
    _host_options(parser)
    _mpirun_options(parser)
    _output_options(parser)
    _recovery_options(parser)
    _preemption_options(parser)
    _elastic_options(parser)
    _refused_options(parser)
    parser.add_argument("program", help="the program to run in every instance")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")
    return parser


def _topology_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``--num-replicas`` and where the replicas run."""
    topo = parser.add_argument_group("topology")
    topo.add_argument("--num-replicas", *NUM_REPLICAS_ALIASES, type=_positive_int, default=None,
                      metavar="N", help="number of replicas (default 1; inside a Slurm allocation "
                                        "without -H/--hostfile, the allocation's task count)")
    topo.add_argument("--num-instances", type=_positive_int, default=None, metavar="N",
                      help="number of instances; must equal --num-replicas (each instance "
                           "drives exactly one replica)")
    topo.add_argument("--feeders-per-replica", type=_non_negative_int, default=0, metavar="F",
                      help="host feed processes per replica, extra MPI ranks that run the "
                           "dataset given to popdist_lite.infeed and stream batches to their "
                           "replica (default 0: the replica reads its data in a thread)")
    topo.add_argument("--ipus-per-replica", type=_positive_int, default=1, metavar="N",
                      help="exported as POPDIST_NUM_IPUS_PER_REPLICA (default 1)")
    placement = topo.add_mutually_exclusive_group()
    placement.add_argument("-H", "--host", type=_host_list, default=None, metavar="HOST0,HOST1",
                       help="hosts, optionally with slots (h0:2,h1:2): hostnames or IP addresses "
                            "([IPv6]:2); instances are divided evenly among them, at most SLOTS "
                            "ranks on a host")
    placement.add_argument("--hostfile", default=None, metavar="FILE",
                       help="hostfile in Open MPI (`host slots=N`) or MPICH (`host:N`) format; "
                            "its hosts are used like --host")


def _host_options(parser: argparse.ArgumentParser) -> None:
    """The options of how other hosts are reached, and the job's network."""
    net = parser.add_argument_group("hosts and network")
    net.add_argument("--launch-agent", default="ssh", metavar="AGENT",
                     help="program that runs a command on another host, called as "
                          "`AGENT [OPTIONS] [--] HOST COMMAND` like ssh (default ssh; Open "
                          "MPI's plm_ssh_agent, MPICH's -launcher-exec)")
    net.add_argument("--launcher", choices=allocation.LAUNCHERS, default=allocation.AUTO,
                     help="how processes on other hosts are started: `slurm` through Slurm "
                          "(mpirun's Slurm launch and `srun --overlap` steps; scancel ends "
                          "them all), `ssh` with --launch-agent; `auto` (default): slurm inside "
                          "a Slurm allocation without -H/--hostfile, else ssh (docs/slurm.md)")
    net.add_argument("--network-interface", default=None, metavar="IFACE|CIDR",
                     help="network for the job's control and data traffic: an interface "
                          "name (eth1) or a CIDR (10.1.0.0/16) (Open MPI oob_tcp_if_include "
                          "and btl_tcp_if_include; MPICH -iface for a name)")
    net.add_argument("--no-host-check", dest="host_check", action="store_false",
                     help="skip the check of every remote host before the launch: a probe run "
                          "with `AGENT -- HOST` connects back to poprun-lite over the job "
                          "network and proves it holds the check's key (the check fails fast "
                          "naming the host and what failed)")


def _mpirun_options(parser: argparse.ArgumentParser) -> None:
    """The options of mpirun itself and its arguments."""
    mpi = parser.add_argument_group("mpirun", "which mpirun runs the job, and arguments passed to it as given")
    mpi.add_argument("--mpirun", default=None, metavar="PATH",
                     help="mpirun/mpiexec to use (also $POPRUN_LITE_MPIRUN)")
    mpi.add_argument("--mpi-global-args", action="append", default=[], metavar='"ARGS"',
                     help="arguments given to mpirun before the contexts (repeatable)")
    mpi.add_argument("--mpi-local-args", action="append", default=[], metavar='"ARGS"',
                     help="arguments added to every instance's context (repeatable)")
    mpi.add_argument("--instance-mpi-local-args", action="append", default=[],
                     type=_instance_args, metavar='IDX:"ARGS"',
                     help="arguments added to instance IDX's context (repeatable)")


def _output_options(parser: argparse.ArgumentParser) -> None:
    """The options of output, the topology table, ``--timeout``, the timeline."""
    out = parser.add_argument_group("output and control")
    out.add_argument("--only-output-from-instance", type=_non_negative_int, default=None,
                     metavar="N", help="discard the output of the other instances (failure "
                     "reports still show their errors)")
    out.add_argument("--print-topology", action="store_true",
                     help="print replica/instance/rank/host before launching")
    out.add_argument("--tag-output", action="store_true",
                     help="prefix output lines with the rank (Open MPI --tag-output, "
                          "MPICH -prepend-rank)")
    out.add_argument("-v", "--verbose", action="store_true",
                     help="print the mpirun command before running it")
    out.add_argument("--timeout", type=_non_negative_float, default=0.0, metavar="SECONDS",
                     help="stop the job after this long and report it (0: no limit)")
    out.add_argument("--timeline", default=None, metavar="FILE",
                     help="record every collective and embedding phase of every replica and "
                          "write one Chrome-trace JSON file (open it in Perfetto); sets "
                          "POPDIST_LITE_TIMELINE for the ranks")


def _recovery_options(parser: argparse.ArgumentParser) -> None:
    """The options of stalls and restarts."""
    recovery = parser.add_argument_group("stalls and restarts")
    recovery.add_argument("--stall-warning", type=_non_negative_float, default=60.0,
                          metavar="SECONDS",
                          help="when replicas have waited this long in a collective call that "
                               "another replica has not entered, print which replicas wait, "
                               "which are missing, what they last entered and their Python "
                               "stacks (default 60; 0: never)")
    recovery.add_argument("--stall-timeout", type=_non_negative_float, default=None,
                          metavar="SECONDS",
                          help="after this long in such a stall, end the job with that block as "
                               "the root cause (default: $POPDIST_LITE_STALL_TIMEOUT, else never)")
    recovery.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="N",
                          help="when an attempt fails (stalls included), print its report and "
                               "launch the job again, up to N times; the program reads the "
                               "attempt in POPDIST_LITE_RESTART_COUNT (0, 1, ...). SIGINT and "
                               "SIGTERM stop without restarting (default 0)")


def _preemption_options(parser: argparse.ArgumentParser) -> None:
    """The options of the scheduler's signals (docs/slurm.md)."""
    sched = parser.add_argument_group("preemption and time limits (docs/slurm.md)")
    sched.add_argument("--preemption", choices=preempt.MODES, default=preempt.AUTO,
                       help="`on`: the requeue signal and SIGTERM ask the replicas to checkpoint "
                            "at their next step boundary (popdist_lite.should_checkpoint()) and "
                            "stop; `off`: SIGTERM stops the job at once and the requeue signal is "
                            "not caught; `auto` (default): on inside a Slurm allocation")
    sched.add_argument("--requeue-signal", default=preempt.DEFAULT_SIGNAL, metavar="SIG",
                       help="the signal that asks for a checkpoint and then `scontrol requeue` "
                            f"(default {preempt.DEFAULT_SIGNAL}; send it with sbatch "
                            "--signal=[B:]USR1@SECONDS or scancel --signal=USR1 [--batch|--full])")
    sched.add_argument("--no-requeue", dest="requeue", action="store_false",
                       help="after the requeue signal's checkpoint, end the job without "
                            "`scontrol requeue`")
    sched.add_argument("--preemption-grace", type=_non_negative_float, default=None, metavar="SECONDS",
                       help="how long the replicas have to reach a step boundary after the requeue "
                            "signal before the job is stopped without a checkpoint (default: until "
                            f"the job's end, EndTime in `scontrol show job`, less "
                            f"{END_MARGIN_SECONDS:g} s; no limit without one)")
    sched.add_argument("--grace-period", type=_non_negative_float, default=None, metavar="SECONDS",
                       help="how long the replicas have to reach a step boundary after SIGTERM "
                            "(not the requeue signal: --preemption-grace) before the job is "
                            "stopped without a checkpoint (default: Slurm's KillWait, read with "
                            f"`scontrol show config`, less {preempt.REPORT_SECONDS:g} s for the "
                            "report before Slurm's SIGKILL, at least half of KillWait; "
                            f"{preempt.DEFAULT_GRACE_SECONDS:g} when KillWait cannot be read)")


def _elastic_options(parser: argparse.ArgumentParser) -> None:
    """The options of elastic jobs (docs/elastic.md)."""
    grow = parser.add_argument_group("elastic jobs (docs/elastic.md)")
    grow.add_argument("--min-replicas", type=_positive_int, default=None, metavar="N",
                      help="make the job elastic: run with N to --num-replicas replicas on the "
                           "usable hosts, restart on the hosts left when one is lost, and grow "
                           "(the program checkpoints at a step boundary when "
                           "popdist_lite.should_checkpoint() says so) when more come; "
                           "--max-restarts then counts failures only (default: not elastic)")
    grow.add_argument("--host-discovery-script", default=None, metavar="PATH",
                      help="executable printing the hosts available now, one `host:slots` line "
                           "each (Horovod's contract); run at the start, before every attempt "
                           "and every --discovery-interval seconds (makes the job elastic; "
                           "without --min-replicas its size stays --num-replicas)")
    grow.add_argument("--discovery-interval", type=_number(float, 0.1, "at least 0.1"),
                      default=elastic.DISCOVERY_INTERVAL_SECONDS, metavar="SECONDS",
                      help="seconds between two checks of the hosts (discovery and probes) "
                           f"(default {elastic.DISCOVERY_INTERVAL_SECONDS:g})")
    grow.add_argument("--elastic-timeout", type=_non_negative_float,
                      default=elastic.ELASTIC_TIMEOUT_SECONDS, metavar="SECONDS",
                      help="longest wait for --min-replicas usable replicas before an attempt "
                           f"(default {elastic.ELASTIC_TIMEOUT_SECONDS:g}; --timeout bounds it too)")


def check_files(opts: Options) -> None:
    """The checks before launch of what the options and the program name on this host:
    the program (:func:`~popdist_lite_launcher.launch.command.check_program`), the
    discovery script (an executable file, or a command on PATH), the timeline's
    directory, the launch agent (on PATH) when other hosts may be used.

    Raises:
        LauncherError: one line naming the option (or the program) and the file.
    """
    check_program(opts.program, opts.args)
    script = opts.host_discovery_script
    if script is not None and "/" not in script:  # run as a command: found on PATH
        if shutil.which(script) is None:
            raise LauncherError(f"--host-discovery-script {script}: not found on PATH (./{script} for a file here)")
    elif script is not None:
        if not os.path.isfile(script):
            raise LauncherError(f"--host-discovery-script {script}: no such file")
        if not os.access(script, os.X_OK):
            raise LauncherError(f"--host-discovery-script {script} is not executable (chmod +x {script})")
    if opts.timeline:
        folder = os.path.dirname(os.path.abspath(opts.timeline))
        if not os.path.isdir(folder):
            raise LauncherError(f"--timeline {opts.timeline}: no such directory {os.path.dirname(opts.timeline)}")
    remote = script is not None or any(not hosts.is_local_host(name) for name in opts.hosts or ())
    if remote and opts.launcher == allocation.SSH:
        words = shlex.split(opts.launch_agent)
        if not words or shutil.which(words[0]) is None:
            raise LauncherError(f"--launch-agent {opts.launch_agent!r}: "
                                f"{words[0] if words else 'the agent'} not found on PATH")


def parse_args(argv: list[str] | None = None) -> Options:
    """Parse and cross-check the options (errors exit via ``parser.error``, one line
    each), typed. The files they name are checked by :func:`check_files`."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    try:  # the launcher; hosts, slots and --num-replicas from a Slurm allocation
        allocation.configure(opts, os.environ)
    except LauncherError as exc:
        parser.error(str(exc))
    if opts.num_replicas is None:
        opts.num_replicas = 1
    try:
        opts.preempt = preempt.settings(opts.preemption, opts.requeue_signal, opts.requeue,
                                        opts.grace_period, scontrol.job_id(os.environ), opts.preemption_grace)
    except (ValueError, LauncherError) as exc:
        parser.error(str(exc))
    if opts.stall_timeout is None:
        text = os.environ.get(STALL_TIMEOUT_ENV, "")
        try:
            opts.stall_timeout = _non_negative_float(text) if text.strip() else 0.0
        except argparse.ArgumentTypeError as exc:
            parser.error(f"${STALL_TIMEOUT_ENV}: {exc}")
    if opts.num_instances is None:
        opts.num_instances = opts.num_replicas
    elif opts.num_instances != opts.num_replicas:
        parser.error(f"--num-instances {opts.num_instances} must equal --num-replicas "
                     f"{opts.num_replicas}: each instance drives exactly one replica")
    for index, _ in opts.instance_mpi_local_args:
        if index >= opts.num_instances:
            parser.error(f"--instance-mpi-local-args index {index} is out of range "
                         f"(0..{opts.num_instances - 1})")
    if opts.only_output_from_instance is not None \
            and opts.only_output_from_instance >= opts.num_instances:
        parser.error(f"--only-output-from-instance {opts.only_output_from_instance} is out "
                     f"of range (0..{opts.num_instances - 1})")
    try:
        listed = opts.host or (hosts.read_hostfile(opts.hostfile) if opts.hostfile else None)
    except OSError as exc:
        parser.error(f"--hostfile {opts.hostfile}: {exc.strerror.lower()}")
    except LauncherError as exc:
        parser.error(f"--hostfile: {exc}")
    listed = listed or opts.allocation_hosts
    opts.hosts = [name for name, _ in listed] if listed else None
    opts.slots = {name: slots for name, slots in listed or () if slots is not None}
    if opts.hosts and hosts.find_duplicate(opts.hosts):
        parser.error("host named more than once: {} and {}".format(*hosts.find_duplicate(opts.hosts)))
    opts.elastic = opts.min_replicas is not None or opts.host_discovery_script is not None
    if opts.elastic:
        if opts.host_discovery_script and opts.hosts:
            parser.error("--host-discovery-script and -H/--hostfile exclude each other: the "
                         "script says which hosts are available")
        if opts.min_replicas is None:
            opts.min_replicas = opts.num_replicas
        if opts.min_replicas > opts.num_replicas:
            parser.error(f"--min-replicas {opts.min_replicas} is more than --num-replicas "
                         f"{opts.num_replicas} (the most replicas)")
        return Options.from_namespace(opts)  # hosts and slots are sized per attempt (elastic.size_attempt)
    if opts.allocation_hosts:  # the allocation's nodes filled up to their task slots
        try:
            opts.slurm_placement = tuple(allocation.place(opts.hosts, opts.slots, opts.num_instances))
        except LauncherError as exc:
            parser.error(str(exc))
        return Options.from_namespace(opts)
    if opts.hosts and opts.num_instances % len(opts.hosts):
        parser.error(f"{opts.num_instances} instances cannot be divided evenly among "
                     f"{len(opts.hosts)} hosts")
    if opts.hosts:
        per_host = opts.num_instances // len(opts.hosts) * (1 + opts.feeders_per_replica)
        for name, slots in opts.slots.items():
            if per_host > slots:
                parser.error(f"host {name} has {slots} slot(s) but would run {per_host} "
                             f"ranks ({opts.num_instances // len(opts.hosts)} instance(s) and "
                             f"their feeders)")
    return Options.from_namespace(opts)


def make_policy(opts: Options, node_address: NodeAddress | None = None) -> MembershipPolicy:
    """The job's membership policy: on a Slurm allocation's nodes under ``--launcher
    slurm`` the Slurm backend's (:func:`popdist_lite_launcher.slurm.nodes.make_policy`),
    else :class:`~popdist_lite_launcher.membership.policies.ElasticPolicy` for an elastic
    job, :class:`~popdist_lite_launcher.membership.policies.FixedPolicy` for any other."""
    policy = nodes.make_policy(opts)
    if policy is None:
        policy = ElasticPolicy(opts, elastic.Cluster(opts, node_address)) if opts.elastic else FixedPolicy(opts)
    return policy


def make_launcher(opts: Options, mpirun: str, implementation: str, preemption=None,
                  node_address: NodeAddress | None = None) -> MpirunLauncher:
    """The launcher backend of ``--launcher``: :class:`~popdist_lite_launcher.slurm.launcher.SlurmLauncher`
    or :class:`~popdist_lite_launcher.ssh.launcher.SshLauncher`."""
    backend = SlurmLauncher if opts.launcher == allocation.SLURM else SshLauncher
    return backend(opts, mpirun, implementation, preemption, node_address)


def main(argv: list[str] | None = None) -> None:
    """Run ``poprun-lite`` and exit with the job's exit code (0 on success, the root
    cause's code or 128+signal on failure, 1 for a stall or an internal error, 124 on
    --timeout, 2 on usage errors and attempts that could not be started). The attempts
    run in :class:`~popdist_lite_launcher.attempts.AttemptsLoop` (a fixed or an elastic
    membership; mpirun over the launch agent, or through Slurm under ``--launcher slurm``);
    the last attempt's outcome decides the exit code. Whatever happens, no mpirun session is left running (a ``finally``
    SIGKILLs what is left of one, and of the discovery and probe processes) and
    connections or records the collectors did not believe are counted in one line at
    the end."""
    early = preempt.catch_early()  # the scheduler's signals while the options and Slurm are read
    preemption = loop = None
    try:
        opts = parse_args(argv)
        try:
            check_files(opts)
        except LauncherError as exc:
            print(f"poprun-lite: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
        if opts.preempt.enabled:
            preemption = preempt.Preemption(opts.preempt)  # reads Slurm's KillWait
            preemption.install(early)
    finally:
        early.release(preemption.signals if preemption is not None else ())
    try:
        if preemption is not None:
            preemption.watch_steps()  # inside a Slurm job: the steps' signals on this node
        try:
            mpirun = find_mpirun(opts.mpirun)
            implementation = detect_implementation(mpirun)
        except LauncherError as exc:
            print(f"poprun-lite: error: {exc}", file=sys.stderr)
            sys.exit(2)
        node_address = scontrol.node_addresses(os.environ)
        loop = AttemptsLoop(opts, make_launcher(opts, mpirun, implementation, preemption, node_address),
                            make_policy(opts, node_address), preemption=preemption)
        code = loop.run()
    except KeyboardInterrupt:  # outside run_mpirun, which handles SIGINT itself
        code = 128 + signal.SIGINT
        print("poprun-lite: interrupted by SIGINT", file=sys.stderr, flush=True)
    finally:
        kill_sessions()
        children.kill_all()
        if preemption is not None:
            preemption.uninstall()
    line = report.format_ignored(loop.refused, loop.dropped) if loop is not None else ""
    if line:
        print(line, file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
