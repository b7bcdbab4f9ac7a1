"""The key hunt shared by tests/launcher/test_key_unreadable.py and
tests/multihost/test_hosts_launch.py: poprun-lite started through a wrapper that records
every key it makes (``channel.new_key``), the programs' ``HUNT`` lines
(tests/progs/key_hunt_prog.py), and the check that they found nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

HUNT = str(Path(__file__).resolve().parent / "progs" / "key_hunt_prog.py")

# poprun-lite, recording each key it makes in the file named by its first argument
RECORDING_LAUNCHER = """
import sys
from popdist_lite_launcher.core import channel
log, made = sys.argv.pop(1), channel.new_key
def recorded():
    key = made()
    with open(log, "a") as f:
        f.write(key.hex() + "\\n")
    return key
channel.new_key = recorded
from popdist_lite_launcher.cli import main
main(sys.argv[1:])
"""


def recording_launcher(python: str, keys: Path, *args: str) -> list[str]:
    """The command of poprun-lite ``args`` recording its keys in ``keys``."""
    return [python, "-c", RECORDING_LAUNCHER, str(keys), *args]


def hunts(stdout: str) -> list[dict]:
    """The programs' ``HUNT {json}`` lines, by replica."""
    found = [json.loads(m) for m in re.findall(r"HUNT (\{[^{}]*\})", stdout)]  # hydra may join lines
    return sorted(found, key=lambda h: h["replica"])


def check_nothing_found(found: list[dict], keys: list[str], replicas: int, ancestors: int, stderr: str) -> None:
    """Every agent had the key (none warned that it had none), yet no real key is in
    anything the programs read, no key variable anywhere, and every key file path they
    found leads nowhere."""
    assert "no job key" not in stderr, stderr[-3000:]
    assert [h["replica"] for h in found] == list(range(replicas)), found
    assert keys and all(len(k) == 64 for k in keys)
    for hunt in found:
        assert hunt["ancestors"] >= ancestors, hunt  # the agent, MPI's daemon(s), ... were read
        assert not set(keys) & set(hunt["candidates"]), hunt
        assert "POPRUN_LITE_JOB_KEY" not in hunt["names"], hunt
        assert hunt["files"] and all(f.endswith(": missing") for f in hunt["files"]), hunt


def key_dirs() -> set[str]:
    """The key directories of this user on this machine now (keys.key_parent())."""
    import os

    from popdist_lite_launcher.node import keys

    parent = Path(keys.key_parent())
    return {str(p) for p in parent.glob(keys.KEY_DIR_PREFIX + "*") if p.stat().st_uid == os.getuid()}
