"""popdist_lite.torch's collections in one process: ``import popdist_lite.torch`` and a
lookup of plain mappings never import torchrec, and TorchRec's configs map onto the
core's (pooling, FP16 as a float16 table with stochastic rounding and float32 outputs,
empty feature_names, TorchRec's default and custom initialisers, options without an
equivalent refused); TorchRec's own ``torchrec.models.dlrm.DLRM`` trains on the
collection. The multi-replica behaviour is tests/mpi/test_torch_collection.py's."""

import pytest

from helpers import requires_torchrec, run_python, timeout_for

pytestmark = timeout_for(1)

LAZY = """
import sys
import numpy as np, torch
import popdist_lite as pl, popdist_lite.torch as pt
assert not [m for m in sys.modules if m.split(".")[0] == "torchrec"], "imported torchrec"
sys.modules["torchrec"] = None  # as if it were not installed
ebc = pt.EmbeddingBagCollection([pt.EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="t", feature_names=["f"],
                                                       initializer=np.arange(8.0).reshape(4, 2))],
                                optimizer=pl.HostEmbeddingOptimizerSpec(1.0))
out = ebc({"f": (torch.tensor([1, 3, 3]), torch.tensor([2, 1]))})
assert list(out) == ["f"] and out["f"].tolist() == [[8.0, 10.0], [6.0, 7.0]], out
out["f"].sum().backward()
want = np.arange(8.0).reshape(4, 2)
want[1] -= 1
want[3] -= 2
assert np.array_equal(ebc.tables["t"].get_embedding_tensor(), want)
print("OK")
"""


def test_import_and_plain_mappings_need_no_torchrec():
    """``import popdist_lite.torch`` imports no torchrec; with torchrec made unimportable,
    a plain mapping's lookup and update work (against a hand-computed table)."""
    pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")
    r = run_python(LAZY)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


CONFIGS = """
import functools
import numpy as np, torch, torchrec
import popdist_lite as pl, popdist_lite.torch as pt

half = torchrec.EmbeddingBagConfig(num_embeddings=1000, embedding_dim=3, name="half", feature_names=[],
                                   data_type=torchrec.DataType.FP16, pooling=torchrec.PoolingType.MEAN)
const = torchrec.EmbeddingBagConfig(num_embeddings=5, embedding_dim=2, name="const", feature_names=["c"],
                                    init_fn=functools.partial(torch.nn.init.constant_, val=0.25))
ebc = pt.EmbeddingBagCollection([half, const], optimizer=pl.HostEmbeddingOptimizerSpec(0.1))
assert half.feature_names == ["half"] and ebc.feature_names == ["half", "c"]  # TorchRec's: the table's name
table = ebc.tables["half"]
assert table.dtype == np.float16 and table.stochastic_rounding.mode.name == "ON", table.stochastic_rounding
assert ebc.core.configs[0].pooling.value == "MEAN" and ebc.embedding_bag_configs() == [half, const]
values = table.get_embedding_tensor().astype(np.float64)
bound = np.sqrt(1 / 1000)  # TorchRec's default init_fn: uniform in [-sqrt(1/t), sqrt(1/t))
assert values.min() >= -bound - 1e-3 and values.max() <= bound + 1e-3 and values.std() > bound / 3, values.std()
assert np.array_equal(ebc.tables["const"].get_embedding_tensor(), np.full((5, 2), 0.25, np.float32))
kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["c", "half"], values=torch.tensor([1, 7, 8]),
                                                   lengths=torch.tensor([1, 0, 0, 2]))
out = ebc(kjt)
assert out.values().dtype == torch.float32 and out.length_per_key() == [3, 2], out  # TorchRec's float32 outputs
mean = (values[7] + values[8]) / 2
np.testing.assert_allclose(out.to_dict()["half"].detach().numpy()[1], mean, rtol=2e-3)
assert out.to_dict()["half"][0].abs().sum() == 0 and out.to_dict()["c"][1].abs().sum() == 0  # empty bags

for bad, message in [
        (lambda: pt.EmbeddingCollection([half]), "EmbeddingCollection takes EmbeddingConfig"),
        (lambda: pt.EmbeddingBagCollection([torchrec.EmbeddingConfig(num_embeddings=3, embedding_dim=2, name="s")]),
         "EmbeddingBagCollection takes EmbeddingBagConfig"),
        (lambda: pt.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(
            num_embeddings=3, embedding_dim=2, name="v", use_virtual_table=True)]), "use_virtual_table"),
        (lambda: pt.EmbeddingBagCollection([const], device="cuda"), "argument device"),
        (lambda: pt.EmbeddingBagCollection([const], output_dtype=torch.int32), "argument output_dtype"),
        (lambda: pt.EmbeddingBagCollection([const], optimizer={"nope": pl.HostEmbeddingOptimizerSpec(1.0)}),
         "no table 'nope'"),
        (lambda: pt.EmbeddingBagCollection([pt.EmbeddingBagConfig(
            num_embeddings=3, embedding_dim=2, name="o", feature_names=["o"],
            optimizer=pl.HostEmbeddingOptimizerSpec(1.0))], optimizer={"o": pl.HostEmbeddingOptimizerSpec(2.0)}),
         "in one place")]:
    try:
        bad()
    except (ValueError, TypeError) as exc:
        assert message in str(exc) and "replica 0" in str(exc), exc
    else:
        raise AssertionError(f"no error for {message}")
pt.EmbeddingBagCollection([const], device="meta")  # TorchRec's idiom before DistributedModelParallel
weighted = pt.EmbeddingBagCollection([const], is_weighted=True)
try:
    weighted(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["c"], values=torch.tensor([1]),
                                                          lengths=torch.tensor([1])))
except ValueError as exc:
    assert "replica 0" in str(exc) and "is_weighted=True" in str(exc), exc
else:
    raise AssertionError("no error for a weighted collection's unweighted batch")

# TorchRec's own DLRM over this collection: logits, and a backward that updates the tables
from torchrec.models.dlrm import DLRM
dims = [torchrec.EmbeddingBagConfig(num_embeddings=9, embedding_dim=4, name=f"t{j}", feature_names=[f"f{j}"])
        for j in range(3)]
dlrm_ebc = pt.EmbeddingBagCollection(dims, optimizer=pl.HostEmbeddingOptimizerSpec(0.5))
model = DLRM(embedding_bag_collection=dlrm_ebc, dense_in_features=2, dense_arch_layer_sizes=[8, 4],
             over_arch_layer_sizes=[8, 1])
kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5, 6]),
                                                   lengths=torch.ones(6, dtype=torch.int64))
before = dlrm_ebc.tables["t1"].get_embedding_tensor().copy()
logits = model(torch.ones(2, 2), kjt)
assert logits.shape == (2, 1)
logits.sum().backward()
moved = np.flatnonzero(np.abs(dlrm_ebc.tables["t1"].get_embedding_tensor() - before).sum(1))
assert moved.tolist() == [3, 4], moved  # feature f1's IDs
print("OK")
"""


@requires_torchrec
def test_torchrec_configs_map_onto_the_cores():
    r = run_python(CONFIGS)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
