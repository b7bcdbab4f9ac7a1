"""The Shakespeare example's data path through the infeed gives the same losses with
and without feeders (tests/feed_example_standin.py mirrors the example's loop)."""

import subprocess
import sys
from pathlib import Path

from mpirun import ROOT

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]
STANDIN = str(Path(__file__).parent / "feed_example_standin.py")
TEXT = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to "
        "suffer the slings and arrows of outrageous fortune, or to take arms against a sea "
        "of troubles and by opposing end them. ") * 12


def losses(tmp_path, feeders, seed=0):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    proc = subprocess.run([*LAUNCHER, "--timeout", "40", "--num-replicas", "2",
                           "--feeders-per-replica", str(feeders), sys.executable, STANDIN,
                           "--data", str(data), "--seed", str(seed)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("Step ")]
    assert len(lines) == 8, proc.stdout
    return lines


def test_same_first_losses_with_and_without_feeders(tmp_path):
    without = losses(tmp_path, 0)
    assert losses(tmp_path, 1) == without
    assert losses(tmp_path, 0, seed=1) != without  # the comparison can tell data apart
