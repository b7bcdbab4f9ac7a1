"""``python -m popdist_lite.checkpoint``: look into checkpoints without a training job.

::

    python -m popdist_lite.checkpoint inspect DIR [--verify]   # the manifest as a table
    python -m popdist_lite.checkpoint export DIR NAME out.npy  # one full array as a .npy file

``DIR`` is a checkpoint (``.../step-00000020``) or a directory of checkpoints (the newest
is used). ``export`` assembles the array at its global shape from every writer's file,
one chunk at a time, into ``out.npy`` (memory-mapped: the array never has to fit in
memory), once every file it reads was checked (size, header, crc32); a failure leaves
no partial output.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from .format import CHUNK_BYTES, CheckpointError, committed
from .manifest import read_manifest
from .partition import Partition, copy_piece, plan
from .reader import ArrayFile


def _resolve(directory: Path) -> Path:
    """``directory`` itself if it is a checkpoint, else its newest checkpoint."""
    if (directory / "manifest.json").is_file():
        return directory
    found = committed(directory)
    if not found:
        raise CheckpointError(f"{directory} is not a checkpoint and holds no complete checkpoint")
    return found[-1][1]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _partition_text(record: dict) -> str:
    p = record["partition"]
    text = p["kind"] if p["kind"] == "replicated" else f"single(replica {p['replica']})" \
        if p["kind"] == "single" else f"{p['kind']}(axis {p['axis']})"
    strategy = record.get("meta", {}).get("strategy")
    return f"{text} {strategy} {record['meta'].get('layout')}" if strategy else text


def inspect(directory: Path, verify: bool) -> int:
    path = _resolve(directory)
    manifest = read_manifest(path)
    print(f"checkpoint {path}\nstep {manifest['step']}, written by {manifest['num_replicas']} replica(s) "
          f"at {manifest.get('created', '?')}")
    rows = [("array", "shape", "dtype", "partition", "writers", "files", "bytes")]
    total = 0
    for name, record in sorted(manifest["arrays"].items()):
        size = sum(f["bytes"] for f in record["files"])
        total += size
        rows.append((name, "x".join(map(str, record["shape"])) or "scalar", np.dtype(record["dtype"]).name,
                     _partition_text(record), str(record["writers"]), str(len(record["files"])), _size(size)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"{len(manifest['arrays'])} arrays, {_size(total)}")
    for name, value in sorted(manifest.get("values", {}).items()):
        text = repr(value)
        print(f"value {name} = {text if len(text) <= 100 else text[:97] + '...'}")
    for name, obj in sorted(manifest.get("objects", {}).items()):
        if obj.get("type") != "ndarray":
            print(f"state {name}: {obj.get('type')}")
    if verify:
        for name, record in sorted(manifest["arrays"].items()):
            for f in record["files"]:
                file = ArrayFile(path, name, f, np.dtype(record["dtype"]))
                try:
                    file.verify()
                finally:
                    file.close()
        print("every file's crc32 matches the manifest")
    return 0


def export(directory: Path, name: str, out: Path) -> int:
    """Write array ``name`` whole to ``out``. Every source file is opened and checked
    (size, header, crc32) before the output is created; the output is written under a
    temporary name beside ``out`` and renamed to it at the end, so a failure leaves no
    partial output (and an ``out`` that existed is kept).

    Raises:
        CheckpointError: no such array, a writer's file missing from the manifest, or a
            source file missing, not a regular file, of another size or header, or
            corrupted.
        OSError: the output cannot be written.
    """
    path = _resolve(directory)
    manifest = read_manifest(path)
    record = manifest["arrays"].get(name)
    if record is None:
        raise CheckpointError(f"{path} has no array {name!r}; it has: {', '.join(sorted(manifest['arrays']))}")
    shape, dtype = tuple(record["shape"]), np.dtype(record["dtype"])
    source, writers = Partition.from_record(record["partition"]), int(record["writers"])
    by_replica = {f["replica"]: f for f in record["files"]}
    target = Partition("replicated")
    files = []
    try:
        for writer in source.writers(writers):
            piece = plan(shape, target, 1, 0, source, writers, writer)
            if piece is None:
                continue
            if writer not in by_replica:
                raise CheckpointError(f"{path}: the manifest lists no file of array {name!r} from replica {writer}")
            files.append((ArrayFile(path, name, by_replica[writer], dtype), piece))
            files[-1][0].verify()
        partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
        try:
            result = np.lib.format.open_memmap(partial, mode="w+", dtype=dtype, shape=shape)
            for file, piece in files:
                copy_piece(result, file.array(), piece, CHUNK_BYTES, file.release_rows)
            result.flush()
            del result
            os.replace(partial, out)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    finally:
        for file, _ in files:
            file.close()
    print(f"wrote {out}: {name} {dtype.name}{list(shape)} from {path}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m popdist_lite.checkpoint", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Look into checkpoints without a training job.",
        epilog="DIR is a checkpoint (.../step-00000020) or a directory of checkpoints (the newest is used).\n\n"
               "examples:\n"
               "  python -m popdist_lite.checkpoint inspect ckpt --verify    # the manifest as a table\n"
               "  python -m popdist_lite.checkpoint export ckpt embedding/weights out.npy  # one array, whole")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("inspect", help="print a checkpoint's manifest as a table")
    p.add_argument("directory", type=Path, metavar="DIR", help="a checkpoint, or a directory of checkpoints (the newest)")
    p.add_argument("--verify", action="store_true", help="also check every file's crc32")
    p = commands.add_parser("export", help="write one full array as a .npy file")
    p.add_argument("directory", type=Path, metavar="DIR", help="a checkpoint, or a directory of checkpoints (the newest)")
    p.add_argument("name", help="the array's name in the manifest, e.g. embedding/weights")
    p.add_argument("out", type=Path, help="the .npy file to write")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return inspect(args.directory, args.verify)
        return export(args.directory, args.name, args.out)
    except (CheckpointError, OSError) as exc:
        print(f"python -m popdist_lite.checkpoint: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
