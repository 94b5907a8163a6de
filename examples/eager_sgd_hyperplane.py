"""eager-SGD's hyperplane regression (§7.2.1), scaled to one machine.

    mpiexec -n 4 python examples/eager_sgd_hyperplane.py --delay-ms 30 --json out.json

A one-layer model learns a d-dimensional hyperplane (d = 2048) from noisy samples.
Every step one random rank (seeded, the same on every rank) is delayed by --delay-ms,
as a straggler would be. Three trainers run the same steps: synch-SGD (a full
allreduce per step), eager-SGD solo and eager-SGD majority (partial allreduces; stale
gradients are carried by the library's accumulator; models are synchronised every
epoch). Reported: throughput (steps/s) and validation loss per epoch.
"""
import argparse
import json
import time

import numpy as np
import torch
from mpi4py import MPI

from partialcoll.integrations.torch import GradientSynchronizer

VARIANTS = {"synch-SGD": "full", "eager-SGD solo": "solo", "eager-SGD majority": "majority"}


def data(rng, n, w_true, noise=0.1):
    x = rng.standard_normal((n, w_true.size)).astype(np.float32)
    y = x @ w_true + noise * rng.standard_normal(n).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


def train(comm, mode, args, w_true, val):
    torch.manual_seed(0)
    model = torch.nn.Linear(args.dim, 1, bias=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    sync = GradientSynchronizer(model.parameters(), mode=mode, comm=comm, average="world", late="fold",
                                model_sync_every=args.steps)
    delay_rng = np.random.default_rng(args.seed)          # same on every rank: who is slow this step
    data_rng = np.random.default_rng(1000 + comm.rank)
    losses = []
    comm.Barrier()
    t0 = MPI.Wtime()
    for _epoch in range(args.epochs):
        for _ in range(args.steps):
            slow = delay_rng.integers(comm.size)
            x, y = data(data_rng, args.batch, w_true)
            if comm.rank == slow:
                time.sleep(args.delay_ms / 1000)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            sync.sync()
            opt.step()
        with torch.no_grad():                              # models were just synchronised
            losses.append(float(torch.nn.functional.mse_loss(model(val[0]).squeeze(1), val[1])))
    elapsed = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
    sync.close()
    return {"steps_per_s": args.epochs * args.steps / elapsed, "val_loss": losses}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--delay-ms", type=float, default=30.0)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="steps per epoch")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(42)
    w_true = rng.standard_normal(args.dim).astype(np.float32) / np.sqrt(args.dim)
    val = data(np.random.default_rng(7), 2048, w_true)
    results = {name: train(comm, mode, args, w_true, val) for name, mode in VARIANTS.items()}
    if comm.rank == 0:
        base = results["synch-SGD"]["steps_per_s"]
        print(f"# hyperplane d={args.dim}, P={comm.size}, one random rank delayed {args.delay_ms:g} ms per step")
        print(f"# {'trainer':<20} {'steps/s':>8} {'speedup':>8}  validation loss per epoch")
        for name, r in results.items():
            print(f"  {name:<20} {r['steps_per_s']:8.2f} {r['steps_per_s'] / base:8.2f}  "
                  + " ".join(f"{v:.4f}" for v in r["val_loss"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"P": comm.size, "delay_ms": args.delay_ms, "dim": args.dim, "results": results}, f,
                          indent=1)
        if args.plot:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots()
            for name, r in results.items():
                ax.plot(range(1, args.epochs + 1), r["val_loss"], marker="o", label=name)
            ax.set_xlabel("epoch")
            ax.set_ylabel("validation loss")
            ax.set_yscale("log")
            ax.legend()
            fig.savefig(args.plot, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
