"""How a Horovod-style script ends: python torch_exit.py CASE (P >= 2)

  mpi4py   every rank trains a step with a DistributedOptimizer (partialcoll in use); the
           last rank then raises RuntimeError, uncaught, while the others sit in
           mpi4py's blocking allreduce (an MPI call partialcoll does not own): the
           excepthook reports it, prints it and aborts the job (pc.rc.abort_on_exception,
           as python -m mpi4py), so no rank waits for a timeout
  pg       the same with the others in dist.all_reduce over partialcoll's process group
  close    solo, late="fold", rank 0 30 ms slower per step, every rank the same number of
           steps and no close(): the fast ranks exit first; a normal exit closes their
           collectives cooperatively, so rank 0 goes on and ends normally, and no rank is
           reported as failed. Every rank prints PASSED.

The failing rank prints ``FAILING at=T`` (time.time()) just before it raises; the test
measures from it to the end of the job.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import partialcoll.integrations.torch as hvd

CASE = sys.argv[1]
comm = MPI.COMM_WORLD


def model_and_opt(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(), **kwargs)
    return model, opt


def step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
    opt.step()


if CASE in ("mpi4py", "pg"):
    if CASE == "pg":
        hvd.init_process_group()
    model, opt = model_and_opt()
    step(model, opt, comm.rank)
    comm.Barrier()
    if comm.rank == comm.size - 1:
        time.sleep(0.5)                  # the others are inside the collective by now
        print(f"FAILING at={time.time():.3f}", flush=True)
        raise RuntimeError("the user's code failed while the other ranks wait in a collective")
    if CASE == "mpi4py":
        comm.allreduce(1.0)              # mpi4py's blocking allreduce: never completes
    else:
        dist.all_reduce(torch.ones(4))   # the process group's: never completes
    print(f"UNREACHABLE rank={comm.rank}", flush=True)
elif CASE == "close":
    model, opt = model_and_opt(mode="solo", late="fold")
    for i in range(30):
        if comm.rank == 0:
            time.sleep(0.03)
        step(model, opt, 100 * comm.rank + i)
    print(f"DONE rank={comm.rank} at={time.time():.3f}", flush=True)
    print(f"PASSED {comm.rank}", flush=True)
    # no opt.close(): the exit closes the collectives with the peers
else:
    raise SystemExit(f"unknown case {CASE}")
