"""How far the ranks' models drift apart through DDP and the partial hook, and what bounds it.

    mpiexec -n 4 python bench/torch_drift.py --steps 64

PyTorch's DDP tutorial model (Linear(10, 10), ReLU, Linear(10, 5), MSE loss, SGD lr
0.001) trained through partial_ddp, one random rank (seeded, the same on every rank)
sleeping --delay-ms per step, so that it misses rounds. For each variant: the largest
difference of one parameter between two ranks, after the last step and the largest at
any step, and the ranks' sums of all weights after the last step (the issue's measure).

  full                mode="full": every rank gets every round (the reference: no drift)
  solo-latest         mode="solo", late="latest" (eager-SGD): a late rank gets the latest
                      round only and never sees the rounds it missed
  solo-fold           mode="solo", late="fold": a late rank gets every round it missed,
                      folded; every rank's sum of results is the same
  solo-latest-sync8   solo-latest with model_sync_every=8 (parameters averaged every 8 steps)
  solo-fold-sync8     solo-fold with model_sync_every=8
"""
import argparse
import time

import numpy as np
import torch
from mpi4py import MPI

import partialcoll.integrations.torch as pct

VARIANTS = {
    "full": dict(mode="full"),
    "solo-latest": dict(mode="solo", late="latest"),
    "solo-fold": dict(mode="solo", late="fold"),
    "solo-latest-sync8": dict(mode="solo", late="latest", model_sync_every=8),
    "solo-fold-sync8": dict(mode="solo", late="fold", model_sync_every=8),
}


class ToyModel(torch.nn.Module):          # the DDP tutorial's
    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(10, 10)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def flat(m) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).double().numpy()


def run(comm, options, args):
    torch.manual_seed(0)
    model = ToyModel()
    ddp, state = pct.partial_ddp(model, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.001)
    slow = np.random.default_rng(args.seed).integers(0, comm.size, args.steps)
    history = []                # this rank's parameters after each step (compared at the end:
    for step in range(args.steps):
        if comm.rank == slow[step]:
            time.sleep(args.delay_ms / 1000)
        g = torch.Generator().manual_seed(1000 * step + comm.rank)
        x, y = torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        history.append(flat(model))      # a collective per step would keep the ranks in step)
    everyone = np.array(comm.allgather(np.array(history)))        # rank, step, parameter
    spread = (everyone.max(0) - everyone.min(0)).max(1)           # per step
    state.close()
    return float(spread[-1]), float(spread.max()), [float(s) for s in everyone[:, -1].sum(1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    pct.init_process_group(comm)
    rows = [(v, *run(comm, VARIANTS[v], args)) for v in args.variants.split(",")]
    if comm.rank == 0:
        print(f"# DDP tutorial model, P = {comm.size}, {args.steps} steps, one random rank {args.delay_ms:g} ms "
              f"late per step; largest difference of a parameter between two ranks")
        print(f"# {'variant':<18} {'after last':>11} {'any step':>10}  sum of weights per rank")
        for v, last, worst, sums in rows:
            print(f"  {v:<18} {last:11.2e} {worst:10.2e}  " + " ".join(f"{s:.4f}" for s in sums))


if __name__ == "__main__":
    main()
