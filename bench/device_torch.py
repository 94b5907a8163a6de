"""The torch paths on a model on one device, as bench/device.sh runs them on a GPU node.

    mpiexec -n 2 python bench/device_torch.py --device cuda --json torch_cuda.json

Paths, each in mode full and solo, on a fresh copy of the same MLP (several gradient
buckets) on --device (cuda on a GPU node; cpu in device.sh's dry run):

  hook        DistributedDataParallel + PartialHookState + partial_allreduce_hook
  partial_ddp partial_ddp(model, mode=...)
  optimizer   DistributedOptimizer(SGD) on the model's gradients (no DDP)

Full mode: at every step after the hook's first plain-allreduce iterations, every
gradient equals the mean over ranks of each rank's own gradient (computed beside the
path with torch.autograd.grad, reduced on the host with MPI_Allreduce), to float32
rounding. Solo: the steps run, every gradient is finite, and the round results came
back on the device the parameters live on. steps/s is the slowest rank's. One path's
failure (an exception: for instance a CUDA path that is not there yet) is recorded with
its message and the others go on; the exit status is 1 if any path failed.
"""
import argparse
import json
import sys
import time
import traceback

import numpy as np
import torch
from mpi4py import MPI

import partialcoll.integrations.torch as pct

PATHS = ("hook", "partial_ddp", "optimizer")
MODES = ("full", "solo")
BUCKET_MB = 0.5                   # several buckets for a 0.6M-parameter model


def mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10)).to(device)


def batch(rank, step, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(64, 256, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device)


def mean_grads(comm, module, x, y):
    """Every rank's own gradient of this batch, averaged over ranks on the host (the reference)."""
    params = [p for p in module.parameters() if p.requires_grad]
    local = torch.autograd.grad(torch.nn.functional.cross_entropy(module(x), y), params)
    flat = torch.cat([g.detach().reshape(-1) for g in local]).cpu().numpy().astype(np.float32)
    out = np.empty_like(flat)
    comm.Allreduce(flat, out)
    return out / comm.size


def run(comm, path, mode, device, steps, warmup):
    model = mlp(device)
    state = opt = None
    if path == "hook":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        state = pct.PartialHookState(mode=mode, comm=comm)
        net.register_comm_hook(state, pct.partial_allreduce_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
    elif path == "partial_ddp":
        net, state = pct.partial_ddp(model, mode=mode, comm=comm, bucket_cap_mb=BUCKET_MB)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
    else:
        net = model
        opt = pct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), mode=mode, comm=comm,
                                       bucket_mb=BUCKET_MB, first_bucket_mb=BUCKET_MB / 2)
    params = [p for p in model.parameters() if p.requires_grad]
    checked, worst = 0, 0.0
    start_iter = state.start_iter if state is not None else 0
    elapsed = 0.0
    for step in range(warmup + steps):
        x, y = batch(comm.rank, step, device)
        check = mode == "full" and step >= start_iter
        expect = mean_grads(comm, model, x, y) if check else None
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            elapsed += time.perf_counter() - t0
        grads = [p.grad for p in params]
        if any(g is None or g.device != params[0].device for g in grads):
            raise AssertionError(f"step {step}: a gradient is missing or not on {params[0].device}")
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            raise AssertionError(f"step {step}: a gradient is not finite")
        if check:
            got = torch.cat([g.detach().reshape(-1) for g in grads]).cpu().numpy()
            err = float(np.max(np.abs(got - expect) / (np.abs(expect) + 1e-6)))
            worst = max(worst, err)
            if not np.allclose(got, expect, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"step {step}: gradients differ from the mean of every rank's gradients "
                                     f"(largest relative difference {err:.3g})")
            checked += 1
    if state is not None:
        state.close()
    if path == "optimizer":
        opt.close()
    rate = steps / comm.allreduce(elapsed, op=MPI.MAX)
    return {"steps_per_s": rate, "checked_steps": checked, "max_rel_diff": worst}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    torch.set_num_threads(1)
    pct.init_process_group(comm)
    results, failed = [], 0
    for path in args.paths.split(","):
        for mode in args.modes.split(","):
            row = {"path": path, "mode": mode, "device": str(device), "P": comm.size}
            try:
                row.update(run(comm, path, mode, device, args.steps, args.warmup), ok=True)
            except Exception as exc:      # noqa: BLE001 - recorded; the other paths go on
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                           where=traceback.format_exc().strip().splitlines()[-3:])
            oks = comm.allgather(row["ok"])
            if not all(oks) and row["ok"]:
                row.update(ok=False, error=f"failed on rank(s) {[r for r, ok in enumerate(oks) if not ok]}")
            failed += not row["ok"]
            results.append(row)
            if comm.rank == 0:
                print(json.dumps(row), flush=True)
            if not all(oks):
                break                      # a rank may be stuck inside that path's collectives
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"P": comm.size, "device": str(device), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "results": results}, f, indent=1)
    torch.distributed.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
