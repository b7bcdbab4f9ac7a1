"""Saving: every replica writes its own files in parallel, then an atomic commit.

The protocol (docs/checkpoint.md), for ``save_checkpoint(DIR, state, step=N)``:

1. Replica 0 creates ``DIR`` and a temporary directory ``DIR/.tmp-step-0000000N-<token>``,
   removing leftovers of torn saves (``.tmp-*``, ``.old-*``); every replica checks that
   it sees the temporary directory and can create a file in it. Any failure is raised
   on every replica before anything is written.
2. Every replica writes the files of its partitions (replicated arrays: replica 0 only)
   and fsyncs each (a helper thread fsyncs one file while the next is written).
3. Every replica reports success or its error to replica 0 (one small gather); if all
   succeeded, replica 0 writes ``manifest.json`` (fsynced), fsyncs the temporary
   directory, renames it to ``DIR/step-0000000N`` (an existing one of the same step is
   first renamed aside) and fsyncs ``DIR``. With ``keep=K`` it then removes all but the
   newest K checkpoints (renamed aside first, so none is ever seen half-deleted).
4. Replica 0 broadcasts the outcome; every replica returns the path or raises.

A kill or a full disk before the rename leaves only a ``.tmp-*`` directory, which no
reader takes for a checkpoint (it has no manifest under a ``step-*`` name).

With ``blocking=False`` steps 2-4 run in a background thread on a duplicate of the
replica communicator, from a copy of this replica's arrays made in the call (kept and
reused by the next background save: one copy of the replica's state in host memory);
the next checkpoint call (or :func:`wait`) joins it and raises its failure on every
replica.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..calls import numbered, set_lane
from ..collectives import agree_objects, comm_cache
from .format import (FORMAT, MANIFEST, TMP_PREFIX, TRASH_PREFIX, VERSION, CheckpointError, committed, file_name,
                     fsync_path, problem_of, step_dir_name, write_npy)
from .state import Description, describe

#: Test hook: seconds to sleep after each block written (slows saves down so a test can
#: kill a replica in the middle of one).
SLOW_WRITE_ENV = "POPDIST_LITE_CHECKPOINT_SLOW_WRITE"


class _Background:
    """A save in progress in a background thread."""

    def __init__(self, target, step: int):
        self.step = step
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, args=(target,), name=f"popdist-lite-checkpoint-{step}")
        self.thread.start()

    def _run(self, target) -> None:
        try:
            target()
        except CheckpointError as exc:  # agreed on every replica
            self.error = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported at the next checkpoint call
            self.error = f"{type(exc).__name__}: {exc}"


_pending: _Background | None = None
_DUPLICATE = "checkpoint writer"  # comm_cache(comm)[_DUPLICATE]: its Dup for background saves


def wait() -> None:
    """Wait for the background save started by ``save_checkpoint(..., blocking=False)``,
    if any. Called by every checkpoint function first.

    Raises:
        CheckpointError: the background save failed (on every replica: the failure was
            agreed between the replicas' background threads).
    """
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    pending.thread.join()
    if pending.error is not None:
        raise CheckpointError(f"the background save of step {pending.step} failed: {pending.error}")


def save_checkpoint(directory, state: dict, step: int, keep: int | None = None, blocking: bool = True,
                    *, comm=None) -> Path:
    """Save ``state`` as checkpoint ``step`` under ``directory``. Collective.

    Args:
        directory: the checkpoint directory, one path every replica sees (a filesystem
            they share); created if missing. The checkpoint goes to
            ``directory/step-<step, 8 digits>``.
        state: dict of name -> state (nested dicts allowed): host embedding tables,
            ``CrossReplicaOptimizer``/dense optimizers, loss scalers, an ``Infeed``,
            ``np.random.Generator``s, numpy arrays (replica-identical, such as dense
            parameters) and JSON values; see :mod:`popdist_lite.checkpoint.state`.
        step: the step number (int >= 0).
        keep: keep only the newest ``keep`` checkpoints, removing older ones after this
            one is committed (``None``: keep all).
        blocking: ``False`` returns once this replica's arrays are copied to memory; a
            background thread writes and commits them (see :func:`wait`).

    Returns:
        The checkpoint's path (with ``blocking=False``, where it will be once committed).

    Raises:
        TypeError, ValueError: bad arguments or an unsupported state entry, on every replica.
        CheckpointError: a replica cannot see or write ``directory`` (before anything is
            written), or a write or the commit failed (the previous checkpoints are
            intact); or an earlier background save failed.
    """
    from .. import elastic, topology

    topology.init()
    stopping = elastic.stopping()  # the save a preempted job's launcher waits for
    comm = topology.replica_comm() if comm is None else comm
    r, k = comm.Get_size(), comm.Get_rank()
    wait()
    what = f"save_checkpoint({str(directory)!r}, step={step!r})"
    problem, description = None, None
    try:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"argument step: expected an integer >= 0, got {step!r}")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"argument keep: expected None or an integer >= 1, got {keep!r}")
        description = describe(state, r, k)
    except Exception as exc:  # noqa: BLE001 - raised on every replica by agree_objects()
        problem = problem_of(exc)
    agree_objects(what, None, comm, problem=problem)
    directory = Path(os.path.abspath(directory))
    tmp = _prepare(comm, directory, step, what)
    final = directory / step_dir_name(step)
    slow = float(os.environ.get(SLOW_WRITE_ENV, "0") or 0)
    if blocking:
        _write_and_commit(comm, description, tmp, final, step, keep, slow, what, stopping)
        return final
    global _pending
    cache = comm_cache(comm)
    if _DUPLICATE not in cache:  # the background writer's own communicator, made once per communicator
        cache[_DUPLICATE] = numbered(comm, "comm_dup", comm.Dup)  # collective: every replica is in this call
        set_lane(cache[_DUPLICATE], "checkpoint")  # its writer thread's calls: seen by the stall inspector
    entries = [e for e in description.entries if k in e.partition.writers(r)]
    for name in set(_buffers) - {e.name for e in entries}:
        del _buffers[name]
    snapshot = Description([_copy(e, r, k) for e in entries], description.values, description.replica_values,
                           description.objects)
    background = cache[_DUPLICATE]
    _pending = _Background(lambda: _write_and_commit(background, snapshot, tmp, final, step, keep, slow, what,
                                                     stopping), step)
    return final


#: The host copies of the last background save, reused by the next one when shapes
#: and dtypes match (name -> array): copying into memory already mapped is a plain
#: memcpy, where a fresh allocation would also fault in every page.
_buffers: dict[str, np.ndarray] = {}


def _copy(entry, replicas: int, replica: int):
    """The entry with a private copy of this replica's real part (for a background save)."""
    part = entry.partition.local_view(entry.local, entry.shape, replicas, replica)
    buffer = _buffers.get(entry.name)
    if buffer is None or buffer.shape != part.shape or buffer.dtype != part.dtype:
        buffer = _buffers[entry.name] = np.empty_like(part, order="C")
    np.copyto(buffer, part)
    return replace(entry, local=buffer)


def _prepare(comm, directory: Path, step: int, what: str) -> Path:
    """Step 1: the temporary directory, created by replica 0 and checked by everyone."""
    problem, name = None, None
    if comm.Get_rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for leftover in os.listdir(directory):
                if leftover.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    shutil.rmtree(directory / leftover, ignore_errors=True)
            name = f"{TMP_PREFIX}{step_dir_name(step)}-{secrets.token_hex(4)}"
            (directory / name).mkdir()
        except OSError as exc:
            problem = problem_of(exc)
    problem, name = numbered(comm, "checkpoint_bcast", comm.bcast, (problem, name), root=0)
    if problem is not None:
        raise CheckpointError(f"{what}: replica 0 cannot create the checkpoint directory {directory}: "
                              f"{problem.message}")
    tmp = directory / name
    problem = None
    try:
        if not tmp.is_dir():
            raise CheckpointError(f"cannot see {tmp}, created by replica 0: the checkpoint directory must "
                                  f"be on a filesystem every replica shares")
        probe = tmp / f".probe-r{comm.Get_rank()}"
        probe.write_bytes(b"")
        probe.unlink()
    except (OSError, CheckpointError) as exc:
        problem = problem_of(exc if isinstance(exc, CheckpointError) else
                             CheckpointError(f"cannot write in {tmp}: {problem_of(exc).message}"))
    try:
        agree_objects(what, None, comm, problem=problem)
    except CheckpointError:
        if comm.Get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _write_and_commit(comm, description: Description, tmp: Path, final: Path, step: int, keep: int | None,
                      slow: float, what: str, stopping: bool = False) -> None:
    """Steps 2-4. Each file is fsynced by a helper thread while the next one is
    checksummed and written, so the checksums cost little beyond the disk's time. With
    ``stopping`` (the save began after ``should_checkpoint()`` answered True), every
    replica tells poprun-lite once the commit is done
    (:func:`popdist_lite.elastic.report_saved`)."""
    r, k = comm.Get_size(), comm.Get_rank()
    problem, files, syncs = None, {}, []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="popdist-lite-fsync") as pool:
        for entry in description.entries:
            if k not in entry.partition.writers(r):
                continue
            path = tmp / file_name(entry.name, None if entry.partition.kind == "replicated" else k)
            try:
                written = write_npy(path, entry.partition.local_view(entry.local, entry.shape, r, k), k, slow,
                                    sync=False)
            except Exception as exc:  # noqa: BLE001 - every replica must reach the gather below
                problem = f"writing {path.name} (array {entry.name!r}): {_describe_error(exc)}"
                break
            files[entry.name] = [written.record()]
            syncs.append((entry.name, path, pool.submit(fsync_path, path)))
        for name, path, sync in syncs:
            try:
                sync.result()
            except Exception as exc:  # noqa: BLE001
                problem = problem or f"fsync of {path.name} (array {name!r}): {_describe_error(exc)}"
    reports = numbered(comm, "checkpoint_gather", comm.gather, (problem, files, description.replica_values), root=0)
    outcome = None
    if k == 0:
        try:
            outcome = _commit(reports, description, tmp, final, step, keep, r)
        except Exception as exc:  # noqa: BLE001 - the others wait in the broadcast
            outcome = f"replica 0: committing {final}: {_describe_error(exc)}"
    outcome = numbered(comm, "checkpoint_bcast", comm.bcast, outcome, root=0)
    if outcome is not None:
        raise CheckpointError(f"{what} failed: {outcome}; the previous checkpoints are intact")
    if stopping:
        from ..elastic import report_saved

        report_saved(step)


def _describe_error(exc: BaseException) -> str:
    """An OSError's cause ("No space left on device"), else ``Type: message``."""
    return problem_of(exc).message if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"


def _commit(reports, description: Description, tmp: Path, final: Path, step: int, keep: int | None,
            replicas: int) -> str | None:
    """Replica 0: manifest, rename, cleanup. Returns the failure (naming its replica) or None."""
    for replica, (problem, _, _) in enumerate(reports):
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"replica {replica}: {problem}"
    arrays = {}
    for entry in description.entries:
        arrays[entry.name] = {"shape": list(entry.shape), "dtype": entry.dtype.str,
                              "partition": entry.partition.record(), "writers": replicas,
                              **({"meta": entry.meta} if entry.meta else {}), "files": []}
    for _, files, _ in reports:
        for name, records in files.items():
            arrays[name]["files"].extend(records)
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "num_replicas": replicas,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "arrays": arrays, "values": description.values,
                "replica_values": [values for _, _, values in reports], "objects": description.objects}
    try:
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        directory = final.parent
        aside = None
        if final.exists():
            aside = directory / f"{TRASH_PREFIX}{final.name}-{secrets.token_hex(4)}"
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_path(directory)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"replica 0: committing {final}: {problem_of(exc).message}"
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if keep is not None:
        others = [path for _, path in committed(directory) if path != final]
        for old in others[:max(0, len(others) - (keep - 1))]:
            aside = directory / f"{TRASH_PREFIX}{old.name}-{secrets.token_hex(4)}"
            try:
                os.rename(old, aside)
            except OSError:
                continue
            shutil.rmtree(aside, ignore_errors=True)
    return None
