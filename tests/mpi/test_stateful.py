"""A user's own object joins checkpoints through the Stateful protocol
(popdist_lite.checkpoint.stateful): saved, resharded where it declares a partition, and
restored, at 1-4 ranks. A different replica count is had in one job by saving from a
sub-communicator of the first ``s`` replicas and loading on all ``r``.

The reference is plain numpy: the object's whole table is a known function of the
row index, so each replica's part can be written down independently of the code.
"""


import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite.checkpoint import Partition, Partitioned, PerReplica

N, W = 11, 3  # the object's table: N rows of W values, row i on replica i % r


def table(seed: float) -> np.ndarray:
    return np.arange(N * W, dtype=np.float64).reshape(N, W) * 10 + seed


class Counter:
    """A user's object: a replicated array, a table split by rows, a per-replica value
    and a JSON counter."""

    def __init__(self, comm, seed: float):
        r, k = comm.Get_size(), comm.Get_rank()
        self.bias = np.full(4, seed, np.float32)
        self.rows = np.full((-(-N // r), W), -1.0)  # padded to ceil(N/r) rows
        mine = table(seed)[k::r]
        self.rows[:len(mine)] = mine
        self.replica_seed = 1000 * seed + k
        self.count = int(seed)

    def state_dict(self):
        return {"bias": self.bias, "rows": Partitioned(self.rows, (N, W), Partition("cyclic", 0)),
                "replica_seed": PerReplica(self.replica_seed), "count": self.count}

    def load_state_dict(self, state_dict):
        self.count = state_dict["count"]
        self.replica_seed = state_dict.get("replica_seed", self.replica_seed)


@pytest.mark.mpi
@pytest.mark.parametrize("fewer", [0, 1])
def test_user_object_saved_resharded_restored(shared, comm, fewer):
    r, k = comm.size, comm.rank
    s = max(1, r - fewer)  # replicas that save
    sub = comm.Split(0 if k < s else 1, k)
    if k < s:
        pl.save_checkpoint(shared, {"counter": Counter(sub, seed=7.0)}, step=1, comm=sub)
    sub.Free()
    comm.Barrier()
    mine = Counter(comm, seed=2.0)
    pl.load_checkpoint(shared / "step-00000001", {"counter": mine}, comm=comm)

    want = table(7.0)[k::r]
    np.testing.assert_array_equal(mine.rows[:len(want)], want)
    np.testing.assert_array_equal(mine.rows[len(want):], -1.0)  # padding untouched
    np.testing.assert_array_equal(mine.bias, np.full(4, 7.0, np.float32))
    assert mine.count == 7
    # per-replica values come back at the same replica count, or when every writer saved
    # the same one (a single writer); otherwise the object keeps its own
    assert mine.replica_seed == (7000 + k if s == r else 7000 if s == 1 else 2000 + k)


@pytest.mark.mpi
def test_user_object_mismatch_changes_nothing(shared, comm):
    pl.save_checkpoint(shared, {"counter": Counter(comm, seed=7.0)}, step=1)
    wide = Counter(comm, seed=2.0)
    wide.bias = np.zeros(5, np.float32)  # another shape than saved
    before = (wide.rows.copy(), wide.bias.copy(), wide.count, wide.replica_seed)
    with pytest.raises(pl.CheckpointError, match=r"array 'counter/bias': the checkpoint holds float32\[4\]"):
        pl.load_checkpoint(shared / "step-00000001", {"counter": wide})
    np.testing.assert_array_equal(wide.rows, before[0])
    np.testing.assert_array_equal(wide.bias, before[1])
    assert (wide.count, wide.replica_seed) == before[2:]


class Legacy:
    """A class whose own state_dict() means something else (as torch modules')."""

    def __init__(self, values):
        self.values = np.asarray(values, np.float64)

    def state_dict(self):
        return {"not": object()}  # unsavable: the adapter must be used instead

    def load_state_dict(self, state_dict):
        raise AssertionError("the adapter is used, never this")


class LegacyChild(Legacy):
    pass


class LegacyAdapter:
    def __init__(self, obj):
        self.obj = obj

    def checkpoint_info(self):
        return {"type": "Legacy"}

    def state_dict(self):
        return {"values": self.obj.values}

    def load_state_dict(self, state_dict):
        pass


@pytest.mark.mpi
def test_registered_adapter_comes_before_the_objects_own_state_dict(shared, comm):
    from popdist_lite.checkpoint import register_adapter

    register_adapter(Legacy, LegacyAdapter)
    pl.save_checkpoint(shared, {"legacy": LegacyChild([1.0, 2.0, 3.0])}, step=1)  # a subclass: its base's adapter
    loaded = Legacy(np.zeros(3))
    pl.load_checkpoint(shared / "step-00000001", {"legacy": loaded})
    np.testing.assert_array_equal(loaded.values, [1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="expected a class and a callable"):
        register_adapter("Legacy", LegacyAdapter)


@pytest.mark.mpi
def test_two_names_for_one_file_are_refused_before_writing(shared, comm):
    """File names keep [A-Za-z0-9_-] only: "a.b" and "a/b" would be the same file."""
    state = {"a.b": np.zeros(2), "a": {"b": np.ones(2)}}
    with pytest.raises(ValueError, match=r"replica 0: state 'a/b' and 'a.b' would be written to the same "
                                         r"file a\.b\.\*"):
        pl.save_checkpoint(shared, state, step=1)
    assert list(shared.iterdir()) == []
