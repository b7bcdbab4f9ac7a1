"""Loading, at any replica count and partition: check everything, then copy in place.

``load_checkpoint(path, state)`` runs in four agreed phases, so a bad checkpoint
(corrupted, or made to harm: see docs/security.md) changes nothing on any replica:

1. every replica reads and checks the manifest (:func:`~.manifest.read_manifest`) and
   matches ``state`` against it (kinds, shapes, dtypes, JSON types;
   :func:`popdist_lite.checkpoint.state.bind`); shapes and dtypes come from the live
   state, never from the checkpoint, and the arrays an object claims from the
   checkpoint (:class:`~.stateful.Allocate`) are checked by the object (against its
   live parameters where it has them) but not allocated; then each object's
   ``validate_state_dict`` runs, which also tries every conversion its
   ``load_state_dict`` will make (generator states, tensors from the arrays) on
   copies or placeholders, so that ``load_state_dict`` cannot fail on the input;
2. every replica opens the files it needs (:func:`~.partition.plan`: the pieces of
   each writer's file that overlap its own part) as regular files only, and checks
   their sizes, headers and data lengths;
   the crc32 checks are shared out: each file is checked once, by one of the replicas
   that read it (balanced by bytes; mapped and released one chunk at a time), so a
   file several replicas read (a replicated array, a reshard) is checksummed once, not
   once per reader;
3. every replica allocates the claimed arrays, now that the files behind them were
   checked (so a manifest's claims cost memory only when files of that size back
   them);
4. every replica copies its pieces from the mapped files into its arrays in place,
   one chunk at a time, then restores the rest (objects' ``load_state_dict``: optimizer
   slots, generator states, values, the feed position).

Phases 1 to 3 end with an agreement: a problem on any replica raises on every replica
before anything is changed. Phase 4 cannot fail on the input; should it fail for
another reason (memory, an object's own error), the
error is agreed too and raised on every replica, saying the state is partly loaded.
"""

from __future__ import annotations

import os
from pathlib import Path


from ..calls import numbered
from ..collectives import Problem, agree_objects
from .format import CHUNK_BYTES, CheckpointError, committed, problem_of
from .manifest import read_manifest
from .partition import Partition, plan, copy_piece
from .reader import ArrayFile
from .save import wait
from .state import bind


def latest_checkpoint(directory, *, comm=None) -> Path | None:
    """The newest complete checkpoint under ``directory`` (the ``step-N`` directory with
    a manifest and the highest N), or ``None``. Collective: replica 0 looks, every
    replica gets its answer; leftovers of torn saves are never returned.

    Raises:
        CheckpointError: an earlier background save failed.
    """
    from .. import topology

    topology.init()
    comm = topology.replica_comm() if comm is None else comm
    wait()
    found = None
    if comm.Get_rank() == 0:
        found = committed(Path(os.path.abspath(directory)))
        found = str(found[-1][1]) if found else None
    found = numbered(comm, "checkpoint_bcast", comm.bcast, found, root=0)
    return Path(found) if found is not None else None


def load_checkpoint(path, state: dict, *, comm=None) -> dict:
    """Load the checkpoint at ``path`` into ``state``, in place. Collective.

    ``state`` has the same names as when saving (a subset is fine); arrays, tables and
    optimizer state are overwritten in place, JSON values are replaced in their dicts.
    The checkpoint may come from another replica count, and tables from another
    partition strategy: each replica reads only the pieces of the files that overlap
    its own part. Stochastic-rounding and ``np.random.Generator`` states of single
    replicas are restored at the same replica count only (elsewhere they keep their
    current state); an ``Infeed`` resumes after the batches already taken
    (docs/checkpoint.md gives the rule across replica counts).

    Args:
        path: a checkpoint directory (``.../step-00000020``; see :func:`latest_checkpoint`).
        state: dict of name -> state, as for :func:`save_checkpoint`.

    Returns:
        ``state``.

    The checkpoint is read as untrusted input (docs/checkpoint.md, "Untrusted
    checkpoints"): every field of its manifest, every file's name, type, size, header and
    data length are checked, and shapes and dtypes come from ``state``, before anything
    changes.

    Raises:
        CheckpointError: on every replica, before anything is changed: ``path`` is not a
            checkpoint, its manifest breaks the format, a file is missing, not a regular
            file, truncated or corrupted (the crc32 mismatch names the file and the
            array), or the checkpoint does not match ``state`` (it lacks an entry or
            holds another kind, shape, dtype or JSON type; such a mismatch is also a
            ``ValueError``), an object refused the saved state, or the arrays it
            claims do not fit in memory. After the copying began (phase 4 above),
            only a failure that is not the input's (memory, an object's own
            error), raised on every replica and saying the state is partly loaded.
        TypeError: an unsupported state entry.
    """
    from .. import topology

    topology.init()
    comm = topology.replica_comm() if comm is None else comm
    r, k = comm.Get_size(), comm.Get_rank()
    wait()
    path = Path(os.path.abspath(path))
    what = f"load_checkpoint({str(path)!r})"
    problem, binding, manifest = None, None, None
    try:
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            found = committed(path)
            if found:
                raise CheckpointError(f"{exc}; it holds checkpoints (the newest is {found[-1][1].name}): pass "
                                      f"latest_checkpoint({str(path)!r})") from None
            raise
        binding = bind(state, manifest, path, r, k)
        binding.check()
    except Exception as exc:  # noqa: BLE001 - raised on every replica by agree_objects()
        problem = problem_of(exc)
    agree_objects(what, None, comm, problem=problem)

    problem, reads = None, []
    try:
        reads = _reads(binding, manifest, path, r, k)
    except Exception as exc:  # noqa: BLE001
        problem = problem_of(exc)
    needs = agree_objects(what, {record["file"]: record["bytes"] for _, record, _ in reads}, comm, problem=problem)
    mine = _verification_share(needs, k)
    opened, work = {}, []
    problem = None
    try:
        for target, record, piece in reads:
            if record["file"] not in opened:
                opened[record["file"]] = ArrayFile(path, target.name, record, target.dtype)
                if record["file"] in mine:
                    opened[record["file"]].verify()
            work.append((target, opened[record["file"]], piece))
    except Exception as exc:  # noqa: BLE001
        problem = problem_of(exc)
    try:
        agree_objects(what, None, comm, problem=problem)
        problem = None
        try:
            binding.allocate()
        except Exception as exc:  # noqa: BLE001 - a MemoryError, raised on every replica
            problem = problem_of(exc)
        agree_objects(what, None, comm, problem=problem)
        problem = None
        try:
            for target, file, piece in work:
                copy_piece(target.local, file.array(), piece, CHUNK_BYTES, file.release_rows)
            for finish in binding.finish:
                finish()
        except Exception as exc:  # noqa: BLE001 - not the input's fault: raised on every replica
            problem = Problem(CheckpointError, f"the load failed after it began changing the state, which is now "
                                               f"partly loaded: {type(exc).__name__}: {exc}")
    finally:
        for file in opened.values():
            file.close()
    agree_objects(what, None, comm, problem=problem)
    return state


def _reads(binding, manifest: dict, path: Path, r: int, k: int) -> list:
    """``(target, file record, piece)`` for every piece of a file that replica ``k`` of
    ``r`` copies into its part of a bound array (:func:`~.partition.plan`)."""
    reads = []
    for target in binding.targets:
        saved = manifest["arrays"][target.name]
        source = Partition.from_record(saved["partition"])
        writers = int(saved["writers"])
        by_replica = {f["replica"]: f for f in saved["files"]}
        for writer in source.writers(writers):
            piece = plan(target.shape, target.partition, r, k, source, writers, writer)
            if piece is None:
                continue
            record = by_replica.get(writer)
            if record is None:
                raise CheckpointError(f"{path}: the manifest lists no file of array {target.name!r} "
                                      f"from replica {writer}")
            reads.append((target, record, piece))
    return reads


def _verification_share(needs: list[dict], k: int) -> set:
    """The files whose crc32 replica ``k`` checks, given every replica's ``{file: bytes}``
    it reads: each file once, by one of the replicas that read it, the largest file first
    to the reader with the fewest bytes so far (ties: the lowest replica). Every replica
    computes the same shares from the same gathered lists."""
    readers: dict[str, tuple[int, list[int]]] = {}
    for replica, files in enumerate(needs):
        for name, size in files.items():
            readers.setdefault(name, (size, []))[1].append(replica)
    assigned, mine = [0] * len(needs), set()
    for name, (size, who) in sorted(readers.items(), key=lambda item: (-item[1][0], item[0])):
        checker = min(who, key=lambda replica: (assigned[replica], replica))
        assigned[checker] += size
        if checker == k:
            mine.add(name)
    return mine
