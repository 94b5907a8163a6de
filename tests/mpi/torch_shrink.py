"""Training goes on without a rank that fails: python torch_shrink.py HOW STEPS DIE_AT

HOW ``ddp``: partial_ddp(mode="full", on_failure="shrink", on_shrink=...) over the
partialcoll process group (small buckets: several collectives); ``optim``: the same with
DistributedOptimizer(on_failure="shrink", on_shrink=...). The last rank raises
RuntimeError (uncaught) at the start of step DIE_AT; under MPICH's
``mpiexec -disable-auto-cleanup`` it reports and leaves, the others train on. on_shrink
multiplies the learning rate by new_size / old size.

Every rank trains STEPS steps of SGD (lr 0.1) on a float64 MLP with no buffers, the same
initial weights (seed 0); rank r's batch at step s is batch(r, s) below. Each survivor
prints, for tests/test_torch_shrink.py (which computes the reference itself):

  SHRINK rank=R calls=[(failed, new_size), ...] size=N colls=K
  PARAMS rank=R [flat parameters]
  REFUSED rank=R <the process group's error on a later all_reduce>
  PASSED R
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

import partialcoll as pc
import partialcoll.integrations.torch as pct

HOW, STEPS, DIE_AT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
me, P = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
torch.set_default_dtype(torch.float64)


def batch(r: int, s: int):
    g = torch.Generator().manual_seed(1000 * s + r)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
calls = []
sgd = torch.optim.SGD(model.parameters(), lr=0.1)


def on_shrink(failed, new_size):
    calls.append((tuple(failed), new_size))
    for group in sgd.param_groups:
        group["lr"] *= new_size / (new_size + len(failed))


pct.init_process_group()
if HOW == "ddp":
    net, state = pct.partial_ddp(model, mode="full", on_failure="shrink", on_shrink=on_shrink, bucket_cap_mb=1e-4)
    opt = sgd
else:
    net, state = model, None
    opt = pct.DistributedOptimizer(sgd, model.named_parameters(), on_failure="shrink", on_shrink=on_shrink,
                                   bucket_mb=1e-4)
for s in range(STEPS):
    if me == P - 1 and s == DIE_AT:
        raise RuntimeError(f"rank {me} fails at step {s} (on purpose)")
    x, y = batch(me, s)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
colls = len(state.colls) if state is not None else len(opt._sync.buckets)
size = state.size if state is not None else opt._sync.size
print(f"SHRINK rank={me} calls={calls} size={size} colls={colls}", flush=True)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print(f"PARAMS rank={me} {flat.tolist()}", flush=True)
try:
    dist.all_reduce(torch.ones(3))
except pc.StateError as exc:
    print(f"REFUSED rank={me} {exc}", flush=True)
if state is not None:
    state.close()
else:
    opt.close()
print(f"PASSED {me}", flush=True)
os._exit(0)     # MPI_Finalize could wait for the dead rank
