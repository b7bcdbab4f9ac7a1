"""A load's memory: beyond the replica's own arrays, one chunk of a file at a time, never
a whole file (docs/checkpoint.md), measured as the peak resident set size that Linux
reports in /proc/self/status (VmHWM, reset through /proc/self/clear_refs)."""

import os

import pytest

from helpers import run_python, timeout_for

pytestmark = timeout_for(1)

CODE = """
import numpy as np, popdist_lite as pl
from popdist_lite.checkpoint import load, reader

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

chunk = 1 << 20
reader.CHUNK_BYTES = load.CHUNK_BYTES = chunk
pl.init()
rows, dim = 131072, 64                           # a 32 MiB table file
saved = pl.create_host_embedding("t", [rows, dim], seed=1)
path = pl.save_checkpoint({directory!r}, {{"t": saved}}, step=1)
want = saved.get_embedding_tensor(master=True)
del saved
table = pl.create_host_embedding("t", [rows, dim], seed=2, partition_strategy={strategy!r})
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                 # reset the peak resident set size
before = status("VmRSS")
pl.load_checkpoint(path, {{"t": table}})
extra = status("VmHWM") - before
np.testing.assert_array_equal(table.get_embedding_tensor(master=True), want)
print("EXTRA", extra)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_load_needs_about_one_chunk_not_the_file(tmp_path, strategy):
    result = run_python(CODE.format(directory=str(tmp_path), strategy=strategy))
    assert result.returncode == 0, result.stderr
    extra = int(result.stdout.split("EXTRA")[1])
    file_bytes, chunk = 131072 * 64 * 4, 1 << 20
    assert extra < 4 * chunk, f"a load needed {extra / 2**20:.1f} MiB beyond the table (file: " \
                              f"{file_bytes / 2**20:.0f} MiB, chunk: {chunk / 2**20:.0f} MiB)"
