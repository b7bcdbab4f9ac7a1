"""Multi-rank program of tests/test_torch_resume.py (run under mpirun).

    torch_checkpoint_prog.py save DIR OUT STRATEGY   train SAVE_AT steps, save, dump; train to END, dump
    torch_checkpoint_prog.py load DIR OUT STRATEGY   fresh objects, load the newest checkpoint, dump;
                                                     train to END, dump

The model: a popdist_lite.torch HostEmbedding (Adam on touched rows) of sequences of 3
ids, summed, and a HostEmbeddingBag (Adagrad, "sum") of bags of 2 ids, concatenated
into a dense MLP under popdist_lite.torch.DistributedDataParallel, trained with
torch.optim.Adam and a GradScaler; the loss is the squared error. Training is a pure
function of the global step, whatever the replica count: every step has a global batch
of B = 12 samples (:func:`batch`); replica k takes samples k, k + r, ... (12 divides
evenly for r = 1, 2, 3, 4), and the mean over the replicas of their mean losses is the
global batch's mean loss. Every row of the embedding is looked up at every step, so the
table's Adam (per-row step counts) equals torch.optim.SparseAdam (the reference in the
test).

Dumps: ``OUT/<tag>.r<k>.npz``, each replica's local table arrays (``emb/weights``,
``emb/optimizer/m``, ...), assembled by the test with numpy; ``OUT/<tag>.full.npz``
(replica 0), the dense parameters, the torch optimizer's state (``opt/<index>/<slot>``),
the full tables (get_embedding_tensor) and the values (step, the loss scale).
"""

import sys

import numpy as np
import torch

import popdist_lite as pl
import popdist_lite.torch as pt

T_EMB, T_BAG, E, B = 12, 17, 4, 12
SAVE_AT, END = 4, 7
EMB_ADAM = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-8}
BAG_ADAGRAD = {"learning_rate": 0.3, "initial_accumulator_value": 0.1, "epsilon": 1e-7}
DENSE_LR = 0.01


def dense_model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(2 * E, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def batch(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The global batch of ``step``: ids (B, 3) with every embedding row in column 0,
    bag ids (B, 2), targets (B, 1)."""
    rng = np.random.default_rng([11, step])
    ids = rng.integers(0, T_EMB, size=(B, 3))
    ids[:, 0] = rng.permutation(T_EMB)
    return ids, rng.integers(0, T_BAG, size=(B, 2)), rng.standard_normal((B, 1)).astype(np.float32)


def build(strategy: str) -> dict:
    scaler = pt.GradScaler(init_scale=2.0 ** 4, growth_interval=3)
    emb = pt.HostEmbedding(T_EMB, E, partition_strategy=strategy, seed=1, name="emb", grad_scaler=scaler,
                           optimizer_spec=pl.HostEmbeddingAdamOptimizerSpec(**EMB_ADAM))
    bag = pt.HostEmbeddingBag(T_BAG, E, mode="sum", partition_strategy=strategy, seed=2, name="bag",
                              grad_scaler=scaler, optimizer_spec=pl.HostEmbeddingAdagradOptimizerSpec(**BAG_ADAGRAD))
    model = pt.DistributedDataParallel(dense_model())
    return {"step": 0, "emb": emb, "bag": bag, "model": model, "scaler": scaler,
            "optimizer": torch.optim.Adam(model.parameters(), lr=DENSE_LR)}


def train(state: dict, first: int, last: int) -> None:
    r, k = pl.num_replicas(), pl.replica_id()
    for step in range(first, last):
        ids, bag_ids, y = (torch.from_numpy(a[k::r]) for a in batch(step))
        features = torch.cat([state["emb"](ids).sum(1), state["bag"](bag_ids)], 1)
        loss = ((state["model"](features) - y) ** 2).mean()
        state["optimizer"].zero_grad()
        state["scaler"].scale(loss).backward()
        assert state["scaler"].step(state["optimizer"])
        state["scaler"].update()
    state["step"] = last


def dump(state: dict, out: str, tag: str) -> None:
    k = pl.replica_id()
    local = {f"{name}/{key}": a for name in ("emb", "bag") for key, a in state[name].table.state().arrays.items()}
    np.savez(f"{out}/{tag}.r{k}.npz", **local)
    full = {f"{name}/full": state[name].get_embedding_tensor(master=True).numpy() for name in ("emb", "bag")}
    if k == 0:
        full.update({f"model/{n}": p.detach().numpy() for n, p in state["model"].module.state_dict().items()})
        for index, slots in state["optimizer"].state_dict()["state"].items():
            full.update({f"opt/{index}/{slot}": v.numpy() for slot, v in slots.items()})
        full["values"] = np.array([state["step"], state["scaler"].get_scale(), pl.num_replicas()])
        np.savez(f"{out}/{tag}.full.npz", **full)


def main() -> None:
    command, directory, out, strategy = sys.argv[1:5]
    pl.init()
    state = build(strategy)
    if command == "save":
        dump(state, out, "initial")
        train(state, 0, SAVE_AT)
        pl.save_checkpoint(directory, state, step=SAVE_AT)
        dump(state, out, "saved")
    else:
        assert not state["optimizer"].state  # a fresh optimizer: its state comes from the checkpoint
        pl.load_checkpoint(pl.latest_checkpoint(directory), state)
        assert state["step"] == SAVE_AT, state["step"]
        dump(state, out, "loaded")
    train(state, SAVE_AT, END)
    dump(state, out, "continued")


if __name__ == "__main__":
    main()
