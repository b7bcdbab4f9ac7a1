"""``poprun-lite``: options, the rank plan, and ``main``.

The job is planned as a list of :class:`~popdist_lite_launcher.mpirun.RankSpec`
by :func:`plan_ranks`; :func:`~popdist_lite_launcher.mpirun.build_command` turns
that list into the MPMD mpirun command. New kinds of ranks (e.g. host feeders)
only need new specs in :func:`plan_ranks` and new options in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time

from popdist_lite import records

from . import __version__, channel, cleanup, elastic, hosts, job, network, report, slurm
from .collector import Collector
from .inspector import StallInspector
from .mpirun import (EXPORTED_VARS, THREAD_VARS, LauncherError, RankSpec, build_command,
                     default_rank_env, detect_implementation, find_mpirun, is_local_host)

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
  poprun-lite --num-replicas 4 --min-replicas 2 --host-discovery-script ./hosts.sh \
      python3 train.py --checkpoint-dir ckpt --resume
      an elastic job: 2 to 4 replicas on the hosts ./hosts.sh prints (host:slots lines);
      it shrinks when a host is lost and grows when one comes back (docs/elastic.md)
  poprun-lite --print-topology python3 train.py        (in an sbatch script, no -H)
      hosts, slots and replicas from the Slurm allocation; processes on other nodes start
      through Slurm, so scancel ends them all (--launcher; docs/slurm.md)

Each rank gets POPDIST_NUM_TOTAL_REPLICAS, POPDIST_NUM_IPUS_PER_REPLICA,
POPDIST_NUM_LOCAL_REPLICAS=1, POPDIST_UNIFORM_REPLICAS_PER_INSTANCE=1,
POPDIST_REPLICA_INDEX_OFFSET, POPDIST_LOCAL_INSTANCE_INDEX, POPDIST_LITE_ROLE,
POPRUN_LITE_COLLECTOR (where its agent sends records), POPDIST_LITE_FEEDERS_PER_REPLICA (and
POPDIST_LITE_TIMELINE with --timeline). The agents also get the job's key (a new one for
every attempt) in POPRUN_LITE_JOB_KEY, forwarded by name from mpirun's environment like
POPRUN_LITE_COLLECTOR, never on a command line; the program does not see it. Feeders (ranks after the replicas, on their replica's host) get their
replica's variables plus POPDIST_LITE_ROLE=feeder, POPDIST_LITE_FEEDER_OF and
POPDIST_LITE_FEEDER_INDEX. OMP_NUM_THREADS and the BLAS thread variables default to 1.
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
#: Which attempt a rank belongs to (0 for the first, 1 after the first restart, ...).
RESTART_COUNT_ENV = "POPDIST_LITE_RESTART_COUNT"

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
    if not sep or not index.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected IDX:\"ARGS\", got {text!r}")
    return int(index), shlex.split(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``poprun-lite`` (options in groups, easy to extend)."""
    parser = argparse.ArgumentParser(
        prog="poprun-lite", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # never take a program option (e.g. --mpi) for one of ours
        description="Launch a replicated program with MPI: one MPI rank (instance) per\n"
                    "replica, the PopDist environment in every rank, and a failure report\n"
                    "naming the root cause.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")

    topo = parser.add_argument_group("topology")
    topo.add_argument("--num-replicas", type=_positive_int, default=None, metavar="N",
                      help="number of replicas (default 1; inside a Slurm allocation without "
                           "-H/--hostfile, the allocation's task count)")
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

    net = parser.add_argument_group("hosts and network")
    net.add_argument("--launch-agent", default="ssh", metavar="AGENT",
                     help="program that runs a command on another host, called as "
                          "`AGENT [OPTIONS] [--] HOST COMMAND` like ssh (default ssh; Open "
                          "MPI's plm_ssh_agent, MPICH's -launcher-exec)")
    # [slurm hook 1 (issue 29)] the launcher choice
    net.add_argument("--launcher", choices=slurm.LAUNCHERS, default=slurm.AUTO,
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

    mpi = parser.add_argument_group("mpirun")
    mpi.add_argument("--mpirun", default=None, metavar="PATH",
                     help="mpirun/mpiexec to use (also $POPRUN_LITE_MPIRUN)")
    mpi.add_argument("--mpi-global-args", action="append", default=[], metavar='"ARGS"',
                     help="arguments given to mpirun before the contexts (repeatable)")
    mpi.add_argument("--mpi-local-args", action="append", default=[], metavar='"ARGS"',
                     help="arguments added to every instance's context (repeatable)")
    mpi.add_argument("--instance-mpi-local-args", action="append", default=[],
                     type=_instance_args, metavar='IDX:"ARGS"',
                     help="arguments added to instance IDX's context (repeatable)")

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

    parser.add_argument("program", help="the program to run in every instance")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the options (errors exit via ``parser.error``)."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    # [slurm hook 2 (issue 29)] the launcher, and hosts, slots and --num-replicas from the
    # allocation (docs/slurm.md)
    try:
        slurm.configure(opts, os.environ)
    except LauncherError as exc:
        parser.error(str(exc))
    if opts.num_replicas is None:
        opts.num_replicas = 1
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
    except (OSError, LauncherError) as exc:
        parser.error(str(exc))
    listed = listed or opts.allocation_hosts  # [slurm hook 2]
    opts.hosts = [name for name, _ in listed] if listed else None
    opts.slots = {name: slots for name, slots in listed or () if slots is not None}
    if opts.hosts and len(set(opts.hosts)) != len(opts.hosts):
        parser.error(f"hosts named more than once: {', '.join(opts.hosts)}")
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
        return opts  # hosts and slots are sized per attempt (elastic.size_attempt)
    if opts.allocation_hosts:  # [slurm hook 2] the nodes filled up to their task slots
        try:
            opts.slurm_placement = slurm.place(opts.hosts, opts.slots, opts.num_instances)
        except LauncherError as exc:
            parser.error(str(exc))
        return opts
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
    return opts


def placement(opts: argparse.Namespace) -> tuple[tuple[str | None, int], ...]:
    """``(host, instances)`` of a job that is not elastic: ``--num-instances`` divided
    evenly among the hosts, in their order, or all on this machine (host None)."""
    n = opts.num_instances
    if getattr(opts, "slurm_placement", None):  # [slurm hook 2]
        return tuple(opts.slurm_placement)
    if not opts.hosts:
        return ((None, n),)
    return tuple((host, n // len(opts.hosts)) for host in opts.hosts)


def plan_ranks(opts: argparse.Namespace, attempt: int = 0,
               membership: "elastic.Membership | None" = None) -> list[RankSpec]:
    """One :class:`RankSpec` per MPI rank, in rank order, with its PopDist environment.
    (The collector's address and the job's key, the same for every rank, are not in the
    specs: :func:`job_environment` puts them in mpirun's environment, forwarded by name.)

    Instance ``i`` drives replica ``i``; instances are placed on the hosts of
    ``membership`` (an elastic job's attempt: its replica count is the attempt's),
    else divided evenly (consecutive blocks) among ``--host`` (:func:`placement`), and
    ``POPDIST_LOCAL_INSTANCE_INDEX`` counts instances per host. With
    ``--feeders-per-replica F`` the replicas keep ranks
    ``0..R-1`` and feeder ``k`` of replica ``r`` is rank ``R + r*F + k``, on its
    replica's host, with its replica's environment and MPI arguments plus the role
    variables (``POPDIST_LITE_ROLE=feeder``, ``POPDIST_LITE_FEEDER_OF=r``,
    ``POPDIST_LITE_FEEDER_INDEX=k``). Every rank gets ``POPDIST_LITE_RESTART_COUNT=attempt``,
    and ``POPRUN_LITE_STALL_INSPECTOR=1`` when ``--stall-warning`` or ``--stall-timeout``
    is on (its agent then records its progress).
    """
    hosts = membership.hosts if membership is not None else placement(opts)
    n = sum(count for _, count in hosts)
    local_args = [a for text in opts.mpi_local_args for a in shlex.split(text)]
    instance_args: dict[int, list[str]] = {}
    for index, args in opts.instance_mpi_local_args:
        instance_args.setdefault(index, []).extend(args)
    common = default_rank_env()
    common.update({
        "POPDIST_NUM_TOTAL_REPLICAS": str(n),
        "POPDIST_NUM_IPUS_PER_REPLICA": str(opts.ipus_per_replica),
        "POPDIST_NUM_LOCAL_REPLICAS": "1",
        "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1",
        # Open MPI gives every rank a pty, so ranks can't tell a terminal from a pipe.
        "POPDIST_LITE_STDOUT_ISATTY": "1" if sys.stdout.isatty() else "0",
        "POPDIST_LITE_FEEDERS_PER_REPLICA": str(opts.feeders_per_replica),
        RESTART_COUNT_ENV: str(attempt),
    })
    if getattr(opts, "stall_warning", 0) or getattr(opts, "stall_timeout", 0):
        common[records.INSPECTOR_ENV] = "1"
    if opts.only_output_from_instance is not None:
        common["POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE"] = str(opts.only_output_from_instance)
    if getattr(opts, "timeline", None):
        common["POPDIST_LITE_TIMELINE"] = os.path.abspath(opts.timeline)
    ranks = []
    for host, count in hosts:
        for local in range(count):
            i = len(ranks)
            env = dict(common)
            env.update({
                "POPDIST_REPLICA_INDEX_OFFSET": str(i),
                "POPDIST_LOCAL_INSTANCE_INDEX": str(local),
                "POPDIST_LITE_ROLE": "replica",
            })
            ranks.append(RankSpec(role="replica", replica=i, host=host, env=env,
                                  mpi_args=local_args + instance_args.get(i, [])))
    feeders = []
    for replica in ranks:
        for k in range(opts.feeders_per_replica):
            env = dict(replica.env)
            env.update({
                "POPDIST_LITE_ROLE": "feeder",
                "POPDIST_LITE_FEEDER_OF": str(replica.replica),
                "POPDIST_LITE_FEEDER_INDEX": str(k),
            })
            feeders.append(RankSpec(role="feeder", replica=replica.replica, host=replica.host,
                                    env=env, mpi_args=list(replica.mpi_args)))
    return ranks + feeders


def format_topology(ranks: list[RankSpec]) -> str:
    """A table of replica, instance, rank, host and role, one row per rank; a feeder's
    row reads ``feeder K of replica N`` (the replica it feeds)."""
    rows = [("replica", "instance", "rank", "host", "role")]
    for rank, spec in enumerate(ranks):
        role = spec.role
        if role == "feeder":
            role = f"feeder {spec.env.get('POPDIST_LITE_FEEDER_INDEX', '?')} of replica {spec.replica}"
        rows.append((str(spec.replica), str(spec.replica), str(rank),
                     spec.host or "localhost", role))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def main(argv: list[str] | None = None) -> None:
    """Run ``poprun-lite`` and exit with the job's exit code (0 on success, the root
    cause's code or 128+signal on failure, 1 for a stall or an internal error, 124 on
    --timeout, 2 on usage errors). With ``--max-restarts N`` a failed attempt is reported
    and the job launched again, up to N times; the last attempt's outcome decides the
    exit code. Whatever happens, no mpirun session is left running (a ``finally``
    SIGKILLs what is left of one) and connections or records the collectors did not
    believe are counted in one line at the end."""
    opts = parse_args(argv)
    try:
        mpirun = find_mpirun(opts.mpirun)
        implementation = detect_implementation(mpirun)
    except LauncherError as exc:
        print(f"poprun-lite: error: {exc}", file=sys.stderr)
        sys.exit(2)

    seen = {"history": [], "result": None, "refused": {}, "dropped": {}}
    try:
        if opts.elastic:
            def attempt(index, membership, timeout, monitor_factory):
                return _noted(seen, _run_attempt(opts, mpirun, implementation, index, timeout,
                                                 membership, monitor_factory))
            code = elastic.run(opts, attempt, _exit_code)
        else:
            code = _run_attempts(opts, mpirun, implementation, seen)
    except Exception as exc:  # noqa: BLE001 - a bug in the launcher: report, never orphan
        code = 1
        _print_internal_error(exc, seen)
    except KeyboardInterrupt:  # outside run_job, which handles SIGINT itself
        code = 128 + signal.SIGINT
        print("poprun-lite: interrupted by SIGINT", file=sys.stderr, flush=True)
    finally:
        job.kill_sessions()
    line = report.format_ignored(seen["refused"], seen["dropped"])
    if line:
        print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def _run_attempts(opts: argparse.Namespace, mpirun: str, implementation: str, seen: dict) -> int:
    """Run the job's attempts, print their reports, and return the exit code; every
    attempt's result and its collector's counts go into ``seen``."""
    attempts = opts.max_restarts + 1
    deadline = time.monotonic() + opts.timeout if opts.timeout else None
    history: list[str] = seen["history"]  # one line per failed attempt
    for attempt in range(attempts):
        left = opts.timeout or None  # --timeout covers all attempts together
        if deadline is not None and attempt:
            left = max(0.001, deadline - time.monotonic())
        result = _noted(seen, _run_attempt(opts, mpirun, implementation, attempt, left))
        if result.returncode == 0 and not result.stop_reason and not result.failures \
                and not result.internal_error:
            if opts.timeline:
                path = os.path.abspath(opts.timeline)
                state = "written to" if os.path.exists(path) else "not written (did the program call popdist_lite.init()?):"
                print(f"poprun-lite: timeline {state} {path}", file=sys.stderr, flush=True)
            if history:
                print(f"poprun-lite: job succeeded on attempt {attempt + 1} of {attempts}; "
                      f"earlier attempts:", *history, sep="\n", file=sys.stderr, flush=True)
            return 0
        code = _exit_code(result)
        summary = report.summary(result.failures, reason=result.stop_reason,
                                 stalled=result.stall is not None)
        history.append(f"  attempt {attempt + 1}: {summary} (exit code {code})")
        final = attempt + 1 == attempts or result.stop_signal is not None or result.timed_out \
            or result.internal_error is not None
        reason = result.stop_reason if final else f"attempt {attempt + 1} of {attempts} failed"
        if result.internal_error:
            reason = "job stopped after an internal error in poprun-lite"
        text = report.format_report(result.failures, code, reason=reason,
                                    mpirun_tail=result.mpirun_tail, cause=result.stall)
        if final and len(history) > 1:
            text += "\nattempts:\n" + "\n".join(history)
        if result.internal_error:
            text += f"\npoprun-lite: internal error: {result.internal_error}"
        print(text, file=sys.stderr, flush=True)
        if final:
            return code
        print(f"poprun-lite: restarting the job: attempt {attempt + 2} of {attempts} "
              f"({RESTART_COUNT_ENV}={attempt + 1})", file=sys.stderr, flush=True)
    raise AssertionError("unreachable: the last attempt is final")


def _noted(seen: dict, result: job.JobResult) -> job.JobResult:
    """``result``, kept in ``seen`` as the last one, its collector's counts added up."""
    seen["result"] = result
    for total, counts in ((seen["refused"], result.refused), (seen["dropped"], result.dropped)):
        for reason, count in counts.items():
            total[reason] = total.get(reason, 0) + count
    return result


def _print_internal_error(exc: Exception, seen: dict) -> None:
    """What is known when the launcher itself failed outside :func:`job.run_job`: the
    attempts so far, the failures of the last one, and the error."""
    lines = ["poprun-lite: job ended by an internal error in poprun-lite (exit code 1)"]
    result = seen["result"]
    if result is not None:
        for failure in result.failures:
            try:
                lines.append(f"  {failure.title()}: {failure.status()}")
            except Exception:  # noqa: BLE001 - print what can be printed
                lines.append(f"  rank {getattr(failure, 'rank', '?')}: failed")
    if seen["history"]:
        lines += ["attempts:", *seen["history"]]
    lines.append(f"poprun-lite: internal error: {job.describe(exc)}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _exit_code(result: job.JobResult) -> int:
    """The exit code of a failed attempt."""
    if result.internal_error:
        cause = report.root_cause(result.failures)
        return cause.launcher_exit_code() if cause is not None else 1
    if result.timed_out:
        return 124
    if result.stop_signal is not None:
        return 128 + result.stop_signal
    if result.stall is not None:
        return 1
    return report.exit_code_for(result.failures, result.returncode)


def processes_of(ranks: list[RankSpec]) -> dict[int, list[tuple[str, int]]]:
    """For each replica, ``(who, rank)`` of its processes: its own rank first, then its
    feeders' (``"feeder 0 of replica 1"``)."""
    processes: dict[int, list[tuple[str, int]]] = {}
    for rank, spec in enumerate(ranks):
        who = f"replica {spec.replica}"
        if spec.role == "feeder":
            who = f"feeder {spec.env.get('POPDIST_LITE_FEEDER_INDEX', '?')} of replica {spec.replica}"
        processes.setdefault(spec.replica, []).append((who, rank))
    return processes


def job_environment(collector: Collector, mark: str, launch_agent: str | None = None) -> dict[str, str]:
    """mpirun's environment: the launcher's, plus the collector's address and the job's
    key, which mpirun forwards to every rank by name (never on a command line), the
    attempt's mark (:mod:`popdist_lite_launcher.cleanup`) and, for remote hosts, the real
    launch agent behind :data:`cleanup.ATTEMPT_AGENT
    <popdist_lite_launcher.cleanup.ATTEMPT_AGENT>`."""
    env = {**os.environ, records.COLLECTOR_ENV: collector.address,
           channel.KEY_ENV: collector.key.hex(), cleanup.MARK_ENV: mark}
    if launch_agent is not None:
        env[cleanup.LAUNCH_AGENT_ENV] = launch_agent
    return env


def _run_attempt(opts: argparse.Namespace, mpirun: str, implementation: str, attempt: int,
                 timeout: float | None, membership: "elastic.Membership | None" = None,
                 monitor_factory=None) -> job.JobResult:
    """Launch the job once (attempt ``attempt``, counted from 0; each with its own
    collector, key, mark and stall inspector; on ``membership`` for an elastic job, whose
    hosts were checked already) and return its result, with the collector's counts of
    what it refused and the ``resize_stop`` records it got. ``monitor_factory(send)``
    makes the attempt's :class:`~popdist_lite_launcher.elastic.ResizeMonitor`. When the
    attempt has ended, whatever is left of it is killed on every host
    (:mod:`popdist_lite_launcher.cleanup`). Exits with code 2 when the hosts fail their
    check or the collector or mpirun cannot be started."""
    ranks = plan_ranks(opts, attempt, membership)
    remote = list(dict.fromkeys(spec.host for spec in ranks if not is_local_host(spec.host)))
    try:
        address = network.launcher_address(opts.network_interface, remote) if remote \
            else "127.0.0.1"
        if remote and opts.host_check and membership is None:
            network.check_hosts(opts.launch_agent, remote, address=address)
        collector = Collector(address, ranks=len(ranks))
    except (OSError, LauncherError) as exc:
        print(f"poprun-lite: error: {exc}", file=sys.stderr)
        sys.exit(2)
    mark = cleanup.new_mark()
    try:
        with collector:
            result = _launch(opts, mpirun, implementation, attempt, timeout, ranks, remote, address,
                             collector, mark, monitor_factory)
    finally:
        _clean_up(opts, ranks, remote, mark)
    result.refused, result.dropped = collector.ignored()
    return result


def _launch(opts, mpirun, implementation, attempt, timeout, ranks, remote, address, collector,
            mark, monitor_factory) -> job.JobResult:
    """Build the attempt's mpirun command and run it (:func:`job.run_job`) with its stall
    inspector and resize monitor."""
    inspector = None
    if opts.stall_warning or opts.stall_timeout:
        inspector = StallInspector(
            len([spec for spec in ranks if spec.role == "replica"]), processes_of(ranks),
            lambda rank, request: collector.send(rank, records.make("stack_request", request=request)),
            warning=opts.stall_warning, timeout=opts.stall_timeout)
        collector.subscribe("progress", inspector.on_progress)
        collector.subscribe("stack", inspector.on_stack)
    export = [name for name in (*EXPORTED_VARS, *THREAD_VARS) if name in os.environ]
    through_slurm = getattr(opts, "launcher", slurm.SSH) == slurm.SLURM and remote  # [slurm hook 3]
    cmd = build_command(
        mpirun, implementation, ranks, [opts.program, *opts.args],
        global_args=[*(slurm.mpirun_args(implementation) if through_slurm else ()),
                     *(a for text in opts.mpi_global_args for a in shlex.split(text))],
        tag_output=opts.tag_output,
        oversubscribe=not remote or len(ranks) > (os.cpu_count() or 1),
        allow_run_as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
        export=[*export, records.COLLECTOR_ENV, channel.KEY_ENV, cleanup.MARK_ENV],
        launch_agent=cleanup.ATTEMPT_AGENT if remote and not through_slurm else None,
        network=opts.network_interface if remote else None,
        launcher_address=address if remote else None)
    if opts.print_topology and (attempt == 0 or opts.elastic):
        if getattr(opts, "allocation", None) is not None:  # [slurm hook 4]
            print(f"{opts.allocation.describe()}; launcher {opts.launcher}", flush=True)
        print(format_topology(ranks), flush=True)
    env = job_environment(collector, mark, opts.launch_agent if remote else None)
    if opts.verbose:
        shown = [f"{name}={env[name]}" for name in (cleanup.LAUNCH_AGENT_ENV, cleanup.MARK_ENV)
                 if remote and name in env]
        print(shlex.join([*shown, *cmd]), file=sys.stderr, flush=True)
    sys.stdout.flush()
    monitor = monitor_factory(collector.send).start() if monitor_factory is not None else None
    try:
        result = job.run_job(cmd, collector, timeout=timeout, inspector=inspector, env=env)
    except OSError as exc:
        print(f"poprun-lite: error: cannot run {mpirun}: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        if monitor is not None:
            monitor.stop()
    result.resize_stops = len(collector.records("resize_stop"))
    return result


def _clean_up(opts: argparse.Namespace, ranks: list[RankSpec], remote: list[str], mark: str) -> None:
    """Kill what is left of the attempt ``mark``: on this machine if it ran ranks here,
    on every remote host through the launch agent; print every host where that failed."""
    problems = {}
    if any(is_local_host(spec.host) for spec in ranks):
        _, left = cleanup.kill_marked(mark)
        if left:
            problems["this host"] = f"{len(left)} process(es) still running (pids {left[:10]})"
    if remote:
        problems.update(cleanup.clean_hosts(opts.launch_agent, remote, mark))
    for host, problem in problems.items():
        print(f"poprun-lite: cleanup after the attempt failed on {host}: {problem}",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
