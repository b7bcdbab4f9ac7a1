#!/usr/bin/env python3
"""popdist_lite.torch against what a PyTorch user would run instead, in one job per
workload with the variants' timed blocks interleaved (bench_lookup.py's method).

    python scripts/bench_torch.py [--ranks 2] [--steps-char 96] [--steps-recsys 160] [--timeout 600]

prints one JSON object on stdout. Without ``--worker`` it launches itself once per
workload on ``--ranks`` replicas with ``poprun-lite`` (under ``--timeout``). Block ``b``
of every variant runs before block ``b + 1`` of any (``--blocks``, default 16), after a
barrier, so load from other processes hits every variant alike; a variant's time is its
median block's mean step, per replica, then the average and the maximum over replicas.
Quote figures only from a quiet machine: ``flock /tmp/popdist-bench.lock python
scripts/bench_torch.py`` (the JSON records the load average before and after).

Workloads and variants:
    char    the training step of examples/shakespeare_torch.py (batch 16 x 100 characters,
            table 256 x 256, GRU(256) + Linear(256, 256), momentum SGD, clipping 1.0; random
            characters instead of the text, which does not change the work):
        binding    popdist_lite.torch.HostEmbedding (SGD in backward) + popdist_lite.torch
                   .DistributedDataParallel (MPI)
        ddp_gloo   torch.nn.parallel.DistributedDataParallel on a gloo process group with a
                   replicated nn.Embedding(sparse=True) (its sparse gradient all-reduced
                   by DDP), torch.optim.SGD for the table
        local      no communication: the same model with a local nn.Embedding(sparse=True) on
                   this replica's batch alone (the compute both variants share)
    recsys  bench_lookup.py's workload: a 1,000,000 x 64 float32 table, 8192 Zipf(1.1) ids
            per replica and step; lookup + backward + SGD update per step:
        binding      popdist_lite.torch.HostEmbedding, ``out.backward(grad)``
        binding_bag  popdist_lite.torch.HostEmbeddingBag, one id per bag (mode "sum")
        numpy        the numpy API: HostEmbedding.lookup + apply_gradients with loss_scale = the
                     replica count, the binding's default update (the mean of the replicas'
                     gradients): the binding's floor
        numpy_bag    the numpy bag API: HostEmbedding.lookup_bags + apply_bag_gradients, one id
                     per bag (combiner "sum", loss_scale = the replica count): binding_bag's floor
        gloo         a replicated nn.EmbeddingBag(sparse=True), one id per bag, under
                     torch DDP with gloo (the sparse gradient all-reduced), torch.optim.SGD
Summary ratios (of the maxima over replicas) and goals: char ``binding_over_ddp_gloo``
(at most 0.9) and, for context, ``binding_over_local`` (the binding against its compute
alone); recsys ``gloo_over_binding`` (at least 3.5), ``binding_over_numpy`` (at
most 1.1) and ``binding_bag_over_numpy_bag`` (at most 1.15); ``summary.goals.met``
says which goal was met; ``*_paired`` are the median over rounds of the two variants'
block ratios. ``results.recsys_profile_ms_per_step`` splits the step of the binding and
numpy variants into the table's phases and the time outside them (``phase_profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import numpy as np  # noqa: E402

from _launch import run_ranks, under_mpi  # noqa: E402
from bench_lookup import WORKLOADS, across, batches, interleaved, paired_ratio  # noqa: E402

VARIANTS = {"char": ("binding", "ddp_gloo", "local"), "recsys": ("binding", "binding_bag", "numpy", "numpy_bag", "gloo")}
CHAR = {"batch": 16, "seq_len": 100, "vocab": 65, "lr": 1.0, "momentum": 0.9, "emb_lr": 10.0, "clip": 1.0}
GOALS = {"char_binding_over_ddp_gloo_at_most": 0.9, "recsys_gloo_over_binding_at_least": 3.5,
         "recsys_binding_over_numpy_at_most": 1.1, "recsys_binding_bag_over_numpy_bag_at_most": 1.15}


def gloo_group(comm) -> None:
    """A gloo process group over the same replicas (rank = replica), its rendezvous on
    a port that replica 0 picks and broadcasts."""
    import torch.distributed as dist

    import popdist_lite as pl

    port = np.zeros(1, np.int64)
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    port = pl.broadcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}", rank=comm.rank,
                            world_size=comm.size)


def char_variants(comm) -> dict:
    """Step functions ``step(s)`` of the char workload's variants."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import popdist_lite as pl
    import popdist_lite.torch as pt
    from shakespeare_torch import CharModel

    F = torch.nn.functional
    c = CHAR
    rng = np.random.default_rng([7, comm.rank])
    data = [torch.from_numpy(rng.integers(0, c["vocab"], size=(c["batch"], c["seq_len"] + 1))) for _ in range(4)]

    def trainer(embed, model, optimizers, dense):
        def step(s):
            ids = data[s % len(data)]
            logits, _ = model(embed(ids[:, :-1]))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            for o in optimizers:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dense, c["clip"])  # the dense gradients, as the example
            for o in optimizers:
                o.step()
        return step

    torch.manual_seed(0)
    emb = pt.HostEmbedding(256, 256, optimizer_spec=pl.HostEmbeddingOptimizerSpec(c["emb_lr"]))
    ddp = pt.DistributedDataParallel(CharModel(256, 256, 256))
    binding = trainer(emb, ddp, [torch.optim.SGD(ddp.parameters(), lr=c["lr"], momentum=c["momentum"])],
                      list(ddp.parameters()))

    class Replicated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 256, sparse=True)
            self.model = CharModel(256, 256, 256)

        def forward(self, ids):
            return self.model(self.emb(ids))

    gloo_group(comm)
    replicated = TorchDDP(Replicated())
    dense = [p for n, p in replicated.named_parameters() if not n.startswith("module.emb.")]
    gloo = trainer(lambda ids: ids, replicated,
                   [torch.optim.SGD(dense, lr=c["lr"], momentum=c["momentum"]),
                    torch.optim.SGD(replicated.module.emb.parameters(), lr=c["emb_lr"])], dense)
    alone = Replicated()
    alone_dense = [p for n, p in alone.named_parameters() if not n.startswith("emb.")]
    local = trainer(lambda ids: ids, alone, [torch.optim.SGD(alone_dense, lr=c["lr"], momentum=c["momentum"]),
                                             torch.optim.SGD(alone.emb.parameters(), lr=c["emb_lr"])], alone_dense)
    return {"binding": binding, "ddp_gloo": gloo, "local": local}


def recsys_variants(comm, names) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import popdist_lite as pl
    import popdist_lite.torch as pt

    w = WORKLOADS["recsys"]
    t, e = w["t"], w["e"]
    idx = batches(w, comm.rank)
    ids = [torch.from_numpy(i) for i in idx]
    offsets = torch.arange(w["shape"][0])
    grad = torch.full(w["shape"] + (e,), 1e-3)
    grad_np = grad.numpy()
    spec = pl.HostEmbeddingOptimizerSpec(0.01)
    out = {}
    if "binding" in names:
        emb = pt.HostEmbedding(t, e, optimizer_spec=spec, name="bench_binding")
        out["binding"] = lambda s: emb(ids[s % len(ids)]).backward(grad)
    if "binding_bag" in names:
        bag = pt.HostEmbeddingBag(t, e, mode="sum", optimizer_spec=spec, name="bench_binding_bag")
        out["binding_bag"] = lambda s: bag(ids[s % len(ids)], offsets).backward(grad)
    if "numpy" in names:
        table = pl.create_host_embedding("bench_numpy", shape=[t, e], optimizer_spec=spec)

        def numpy_step(s):
            table.lookup(idx[s % len(idx)])
            table.apply_gradients(idx[s % len(idx)], grad_np, loss_scale=comm.size)  # op="mean"
        out["numpy"] = numpy_step
    if "numpy_bag" in names:
        bag_table = pl.create_host_embedding("bench_numpy_bag", shape=[t, e], optimizer_spec=spec)
        lengths = np.ones(w["shape"][0], np.int64)

        def numpy_bag_step(s):
            bag_table.lookup_bags(idx[s % len(idx)], lengths)
            bag_table.apply_bag_gradients(idx[s % len(idx)], grad_np, lengths, loss_scale=comm.size)  # op="mean"
        out["numpy_bag"] = numpy_bag_step
    if "gloo" in names:
        gloo_group(comm)
        model = TorchDDP(torch.nn.EmbeddingBag(t, e, mode="sum", sparse=True))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def gloo_step(s):
            opt.zero_grad()
            model(ids[s % len(ids)], offsets).backward(grad)
            opt.step()
        out["gloo"] = gloo_step
    return out


def worker(opts) -> None:
    import popdist_lite as pl

    pl.init()
    comm = pl.replica_comm()
    names = opts.variants.split(",")
    variants = char_variants(comm) if opts.workload == "char" else recsys_variants(comm, names)
    variants = {n: variants[n] for n in names if n in variants}
    times = interleaved(comm, variants, opts.steps, opts.blocks, lambda v, s: v(s))
    report = {name: {"workload": opts.workload, "variant": name, "steps": opts.steps, "blocks": opts.blocks,
                     "step_ms": across(comm, float(np.median(times[name])))} for name in variants}
    pairs = {"char": [("binding_over_ddp_gloo", "binding", "ddp_gloo"), ("binding_over_local", "binding", "local")],
             "recsys": [("gloo_over_binding", "gloo", "binding"), ("binding_over_numpy", "binding", "numpy"),
                        ("binding_bag_over_numpy", "binding_bag", "numpy"),
                        ("binding_bag_over_numpy_bag", "binding_bag", "numpy_bag")]}[opts.workload]
    paired = {k: paired_ratio(comm, times[a], times[b]) for k, a, b in pairs if a in times and b in times}
    profile = {name: phase_profile(comm, v, opts.steps) for name, v in variants.items()
               if opts.workload == "recsys" and name in PROFILED}
    if comm.rank == 0:
        print("JSON " + json.dumps({"variants": report, "paired": paired, "profile": profile}), flush=True)


#: The recsys variants whose step :func:`phase_profile` splits into the table's phases.
PROFILED = ("binding", "binding_bag", "numpy", "numpy_bag")


def phase_profile(comm, step, steps: int) -> dict:
    """Where one variant's step goes: ms per step of each phase of
    ``popdist_lite.stats()`` (``lookup.*``, ``update.*``; ``lookup`` and ``update`` are
    the whole calls, bag calls included, ``*.rest`` their time outside the named
    sub-phases: for bags, pooling and unpooling) and of the
    step outside the table (``outside``: for the bindings, torch's module call,
    ``Function.apply`` and autograd engine; for the numpy API, the loop), over ``steps``
    steps right after the timed blocks, averaged over the replicas."""
    import popdist_lite as pl

    comm.Barrier()
    pl.reset_stats()
    start = time.perf_counter()
    for s in range(steps):
        step(s)
    total = time.perf_counter() - start
    phases = {name: x["seconds"] for name, x in pl.stats()["phases"].items()
              if name.split(".")[0] in ("lookup", "update", "lookup_bags", "update_bags")}
    for call in ("lookup", "update"):
        # the bag calls are phases lookup_bags / update_bags, their parts lookup.* / update.*
        phases[call] = phases.get(call, 0.0) + phases.pop(call + "_bags", 0.0)
        parts = sum(x for name, x in phases.items() if name.startswith(call + "."))
        phases[call + ".rest"] = phases[call] - parts
    phases["outside"] = total - phases.get("lookup", 0.0) - phases.get("update", 0.0)
    phases["step"] = total
    names = sorted(phases)
    mean = np.array(comm.allgather([phases[n] for n in names])).mean(axis=0)  # once per variant
    return {n: round(float(x) / steps * 1e3, 4) for n, x in zip(names, mean)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps-char", type=int, default=96)
    parser.add_argument("--steps-recsys", type=int, default=160)
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks per variant (median kept)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--workloads", default=",".join(VARIANTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--variants", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker or under_mpi():
        worker(opts)
        return
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    results, summary = {}, {}
    for workload in opts.workloads.split(","):
        steps = opts.steps_char if workload == "char" else opts.steps_recsys
        args = ["--workload", workload, "--variants", ",".join(VARIANTS[workload]), "--steps", str(steps),
                "--blocks", str(opts.blocks)]
        got = run_ranks(os.path.abspath(__file__), args, opts.ranks, opts.timeout)[0]
        results[workload] = got["variants"]
        if got.get("profile"):
            results[workload + "_profile_ms_per_step"] = got["profile"]
        ms = {name: r["step_ms"]["max"] for name, r in got["variants"].items()}
        s = {}
        if workload == "char":
            s["binding_over_ddp_gloo"] = round(ms["binding"] / ms["ddp_gloo"], 3)
            s["binding_over_local"] = round(ms["binding"] / ms["local"], 3)
        else:
            s["gloo_over_binding"] = round(ms["gloo"] / ms["binding"], 2)
            s["binding_over_numpy"] = round(ms["binding"] / ms["numpy"], 3)
            s["binding_bag_over_numpy"] = round(ms["binding_bag"] / ms["numpy"], 3)
            s["binding_bag_over_numpy_bag"] = round(ms["binding_bag"] / ms["numpy_bag"], 3)
        s.update({k + "_paired": v for k, v in got["paired"].items()})
        summary[workload] = s
    met = {}
    if "char" in summary:
        met["char_binding_over_ddp_gloo"] = summary["char"]["binding_over_ddp_gloo"] <= GOALS["char_binding_over_ddp_gloo_at_most"]
    if "recsys" in summary:
        rec = summary["recsys"]
        met["recsys_gloo_over_binding"] = rec["gloo_over_binding"] >= GOALS["recsys_gloo_over_binding_at_least"]
        met["recsys_binding_over_numpy"] = rec["binding_over_numpy"] <= GOALS["recsys_binding_over_numpy_at_most"]
        met["recsys_binding_bag_over_numpy_bag"] = (rec["binding_bag_over_numpy_bag"]
                                                    <= GOALS["recsys_binding_bag_over_numpy_bag_at_most"])
    summary["goals"] = {**GOALS, "met": met}
    print(json.dumps({"benchmark": "torch", "replicas": opts.ranks, "seconds": round(time.perf_counter() - start, 1),
                      "machine": {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before, 2),
                                  "load_avg_1min_after": round(os.getloadavg()[0], 2)},
                      "summary": summary, "results": results}, indent=1))


if __name__ == "__main__":
    main()
