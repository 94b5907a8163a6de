"""Balanced data-parallel training throughput of the 2.9M-parameter MLP.

    flock /tmp/pc-bench.lock mpiexec -n 2 python bench/torch_mlp.py --json mlp_p2.json

A 784-1024-1024-1024-10 MLP (2,913,290 parameters, 11.6 MB of float32 gradients),
SGD, batch 64 of random data, no imbalance. Every variant trains a fresh copy of the
same model for --warmup steps, then --steps timed steps (time: the slowest rank's).
Variants, in this order (the same process, one default gloo group whose store is found
over MPI):

  gloo          DistributedDataParallel on gloo, its default reduction
  mpi4py        no DDP: after backward, one MPI Allreduce per parameter (in place), / P
  pc-group      DistributedDataParallel on the partialcoll process group (no hook)
  hook-full     DDP + partial_allreduce_hook, mode="full"
  hook-solo     DDP + partial_allreduce_hook, mode="solo"
  optim-full    DistributedOptimizer(SGD), mode="full"
  optim-solo    DistributedOptimizer(SGD), mode="solo"
  sync-full     GradientSynchronizer, mode="full": every bucket posted after backward (no
                overlap), as the mpi4py loop does

Printed: steps/s and the ratio to the best synchronous peer (gloo, mpi4py, pc-group).
--repeat R runs the whole list R times, each time in a rotated order (so no variant is
always first or last), and reports each variant's median; the single runs are in --json.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import partialcoll
import partialcoll.integrations.torch as pct

VARIANTS = ("gloo", "mpi4py", "pc-group", "hook-full", "hook-solo", "optim-full", "optim-solo", "sync-full")
PEERS = ("gloo", "mpi4py", "pc-group")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


def run(comm, variant, args, pcg):
    model = mlp()
    params = list(model.parameters())
    state = opt = sync = None
    if variant in ("gloo", "pc-group", "hook-full", "hook-solo"):
        net = DDP(model, process_group=pcg if variant == "pc-group" else None,
                  gradient_as_bucket_view=args.bucket_view)
        if variant.startswith("hook"):
            state = pct.PartialHookState(mode=variant.split("-")[1], comm=comm)
            net.register_comm_hook(state, pct.partial_allreduce_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
    elif variant.startswith("optim"):
        net = model
        opt = pct.DistributedOptimizer(torch.optim.SGD(params, lr=0.01), mode=variant.split("-")[1], comm=comm)
    else:
        net = model
        opt = torch.optim.SGD(params, lr=0.01)
        if variant == "sync-full":
            sync = pct.GradientSynchronizer(params, mode="full", comm=comm, first_bucket_mb=1.0)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, 784, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if variant == "mpi4py":
            for p in params:
                a = p.grad.numpy()
                comm.Allreduce(MPI.IN_PLACE, a)
                a /= comm.size
        elif sync is not None:
            sync.sync()
        opt.step()

    for _ in range(args.warmup):
        step()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    if state is not None:
        state.close()
    if variant.startswith("optim"):
        opt.close()
    if sync is not None:
        sync.close()
    return args.steps / elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-view", action=argparse.BooleanOptionalAction, default=True,
                    help="DDP's gradient_as_bucket_view for every DDP variant (default: on; "
                         "--no-bucket-view: DDP copies gradients into and out of its buckets)")
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    pct.init_process_group(comm, backend="gloo")
    pcg = dist.new_group(backend="partialcoll")
    variants = args.variants.split(",")
    runs = {v: [] for v in variants}
    for r in range(args.repeat):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            runs[v].append(run(comm, v, args, pcg))
            if comm.rank == 0:
                print(f"# {v:<11} {runs[v][-1]:7.1f} steps/s (run {r + 1})", flush=True)
    rates = {v: sorted(x)[len(x) // 2] for v, x in runs.items()}
    best = max((rates[p] for p in PEERS if p in rates), default=None)
    if comm.rank == 0:
        print(f"# 2.9M MLP, balanced, P = {comm.size}, batch {args.batch}, {args.steps} steps, "
              f"median of {args.repeat}, gradient_as_bucket_view={args.bucket_view} (torch threads per rank: 1; partialcoll {partialcoll.__version__})")
        print(f"# {'variant':<11} {'steps/s':>8} {'x best sync peer':>17}  runs")
        for v, r in rates.items():
            each = " ".join(f"{x:.1f}" for x in runs[v])
            print(f"  {v:<11} {r:8.1f} {r / best if best else float('nan'):17.2f}  {each}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"P": comm.size, "batch": args.batch, "steps": args.steps, "bucket_view": args.bucket_view, "steps_per_s": rates, "runs": runs,
                           "best_sync_peer": best}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
