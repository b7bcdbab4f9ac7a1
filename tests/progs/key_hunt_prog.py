"""A program under poprun-lite looking for the job's key everywhere a process of the user
can read it: its environment (``os.environ``), its initial environment
(``/proc/self/environ``), the environment of every ancestor up to PID 1
(``/proc/PID/environ``), and the key file whose path any of those names
(``POPRUN_LITE_KEY_FILE``, and its directory). It prints one line, ``HUNT {json}``:

- ``names``: the environment variables seen anywhere whose name holds ``KEY`` and
  ``POPRUN`` (the key's old variable, ``POPRUN_LITE_JOB_KEY``, or the key file's);
- ``candidates``: every value of 64 hex digits seen in any of those environments or
  files (the key is 32 bytes in hex);
- ``files``: for every key-file path and key directory named, what reading it gave
  (``missing``, an ``OSError`` name, or ``read``/``listed`` with what it held, whose
  64-hex values are in ``candidates`` too);
- ``ancestors``: how many ancestors' environments it read, ``host`` and ``replica``.

The test compares ``candidates`` with the job's real keys (recorded by the launcher it
started) and asserts that nothing was read.
"""

import json
import os
import re
import socket
from pathlib import Path

HEX64 = re.compile(rb"(?<![0-9a-fA-F])[0-9a-fA-F]{64}(?![0-9a-fA-F])")
FILE_VARS = (b"POPRUN_LITE_KEY_FILE",)


def environ_of(pid) -> list[bytes]:
    try:
        return [e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e]
    except OSError:
        return []


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def main() -> None:
    entries = [f"{k}={v}".encode() for k, v in os.environ.items()] + environ_of("self")
    pid, ancestors = os.getpid(), 0
    while pid > 1:
        try:
            pid = parent_of(pid)
        except (OSError, ValueError, IndexError):
            break
        got = environ_of(pid)
        ancestors += bool(got)
        entries += got
    names = sorted({e.split(b"=", 1)[0].decode(errors="replace") for e in entries
                    if b"KEY" in e.split(b"=", 1)[0] and b"POPRUN" in e.split(b"=", 1)[0]})
    texts = list(entries)
    paths = {e.split(b"=", 1)[1].decode(errors="replace") for e in entries if e.split(b"=", 1)[0] in FILE_VARS}
    files = {}
    for path in sorted(paths | {os.path.dirname(p) for p in paths if os.path.dirname(p)}):
        try:
            if os.path.isdir(path):
                listed = sorted(os.listdir(path))
                files[path] = f"listed {listed}"
                for name in listed:
                    try:
                        texts.append(Path(path, name).read_bytes()[:4096])
                    except OSError:
                        pass
            else:
                data = Path(path).read_bytes()[:4096]
                texts.append(data)
                files[path] = f"read {len(data)} bytes"
        except FileNotFoundError:
            files[path] = "missing"
        except OSError as exc:
            files[path] = type(exc).__name__
    candidates = sorted({m.decode().lower() for t in texts for m in HEX64.findall(t)})
    print("HUNT " + json.dumps({"replica": int(os.environ.get("POPDIST_REPLICA_INDEX_OFFSET", "-1")),
                                "host": socket.gethostname(), "ancestors": ancestors, "names": names,
                                "candidates": candidates, "files": [f"{p}: {r}" for p, r in files.items()]}),
          flush=True)


if __name__ == "__main__":
    main()
