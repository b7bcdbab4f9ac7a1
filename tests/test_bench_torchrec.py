"""scripts/bench_torchrec.py --check: every variant the benchmark times makes the same
update. One 2-replica job: one step of each recommender variant (popdist-lite's
HostEmbeddingBag, HostEmbedding and numpy API; TorchRec's ROW_WISE and TABLE_WISE
DistributedModelParallel) on a 1000 x 8 table against numpy's SGD step with the mean of
the replicas' gradients, and three DLRM steps of popdist-lite's (popdist_lite.torch's
EmbeddingBagCollection of the 26 tables, and of one table of all their rows) and
TorchRec's (its planner's plan and TABLE_WISE) from the same weights."""

import json
import subprocess
import sys

from helpers import JOB_SECONDS, ROOT, requires_torchrec, timeout_for

pytestmark = [requires_torchrec, timeout_for(1)]

RECSYS = ("binding_bag", "binding", "numpy_bag", "numpy", "torchrec_rw", "torchrec_tw")
DLRM = ("torchrec", "torchrec_tw", "popdist", "popdist_stacked")


def test_every_variant_makes_the_same_update():
    done = subprocess.run([sys.executable, "scripts/bench_torchrec.py", "--check", "--timeout", str(JOB_SECONDS)],
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, cwd=ROOT)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    check = json.loads(done.stdout)["check"]
    assert set(check) == {f"recsys.{v}" for v in RECSYS} | {f"dlrm.{v}" for v in DLRM}
    for v in RECSYS:
        got = check[f"recsys.{v}"]
        assert got["forward_max_abs_err"] < 1e-6 and got["update_max_abs_err"] < 1e-5, (v, got)
        assert got["untouched_rows_unchanged"], (v, got)
    assert check["recsys.torchrec_rw"]["plan"] == {"t0": "row_wise/fused ranks=[0, 1]"}
    assert check["recsys.torchrec_tw"]["plan"] == {"t0": "table_wise/fused ranks=[0]"}
    assert check["dlrm.popdist"]["collection"] == "popdist_lite.torch.collection.EmbeddingBagCollection"
    assert set(check["dlrm.popdist"]["plan"].values()) == {"row_wise ranks=[0, 1]"}
    assert check["dlrm.popdist_stacked"]["plan"] == {"stacked": "row_wise ranks=[0, 1]"}
    for v in DLRM:
        got = check[f"dlrm.{v}"]
        assert got["tables_moved_max"] > 0 and got["table_max_abs_err"] < 1e-3 * got["tables_moved_max"], (v, got)
        assert got["loss_max_abs_err"] < 1e-5 and got["logit_max_abs_err"] < 1e-4, (v, got)
    assert done.returncode == 0, done.stdout[-3000:]
