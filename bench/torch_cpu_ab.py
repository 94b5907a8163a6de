"""Where solo's time goes: steps/s, process CPU time per step and late posts per
step of the 2.9M MLP's variants, under several runtime options, interleaved in one process.

    flock /tmp/pc-bench.lock mpiexec -n 2 python bench/torch_cpu_ab.py hook-full,hook-solo,optim-solo 3 \
        "default;sleep_max_us=1000;busy_cap_us=0"

VARIANTS: hook-full, hook-solo, optim-full, optim-solo (as bench/torch_mlp.py), mpi4py.
REPS repetitions; each runs every configuration (rotated), each configuration every
variant. A configuration is "default" or k=v,k=v of partialcoll.rc (the engine restarts
with it). Printed per configuration and variant: median steps/s (the slowest rank's), the
median ratio to the first variant of the same repetition [range], each rank's median
process CPU ms per step (every thread: application, progress, completer), and each rank's
late posts per step (Result.contributed false). STEPS (environment, default 40) timed
steps after 8 warm-up steps.
"""

import os
import sys
import time
import statistics as st
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP
import partialcoll
import partialcoll.integrations.torch as pct

comm = MPI.COMM_WORLD
torch.set_num_threads(1)
pct.init_process_group(comm, backend="gloo")
STEPS = int(os.environ.get("STEPS", 40))


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def sleepy_barrier():
    r = comm.Ibarrier()
    while not r.Test():
        time.sleep(0.0005)


def run(variant, steps=STEPS, warm=8):
    model = mlp()
    params = list(model.parameters())
    kind, mode = (variant.split("-") + [""])[:2]
    state = None
    if kind == "hook":
        net = DDP(model, gradient_as_bucket_view=True)
        state = pct.PartialHookState(mode=mode, comm=comm)
        net.register_comm_hook(state, pct.partial_allreduce_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
    elif kind == "optim":
        net = model
        opt = pct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), mode=mode, comm=comm)
    else:
        net = model
        opt = torch.optim.SGD(params, lr=0.01)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(64, 784, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    lates = 0
    for i in range(warm + steps):
        if i == warm:
            comm.Barrier()
            t0 = time.perf_counter()
            c0 = time.process_time()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if kind == "mpi4py":
            for p in params:
                a = p.grad.numpy()
                comm.Allreduce(MPI.IN_PLACE, a)
                a /= comm.size
        opt.step()
        if i >= warm and state is not None:
            lates += sum(not r.contributed for r in state.last.values())
        elif i >= warm and kind == "optim":
            lates += sum(not r.contributed for r in opt.last)
    mine = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if os.environ.get("SLEEPY"):
        sleepy_barrier()
    el = comm.allreduce(mine, op=MPI.MAX)
    if state:
        state.close()
    elif kind == "optim":
        opt.close()
    return steps / el, cpu / steps * 1e3, lates / steps


variants = sys.argv[1].split(",")
reps = int(sys.argv[2])
cfgs = sys.argv[3].split(";") if len(sys.argv) > 3 else ["default"]
res = {}
for r in range(reps):
    for _ci, cfg in enumerate(cfgs[r % len(cfgs) :] + cfgs[: r % len(cfgs)]):
        partialcoll.finalize()
        for k, v in partialcoll.rc._defaults.items():
            setattr(partialcoll.rc, k, v)
        if cfg != "default":
            for kv in cfg.split(","):
                k, v = kv.split("=")
                setattr(partialcoll.rc, k, v if k in ("progress", "idle") else float(v))
        vs = variants if r % 2 == 0 else variants[::-1]
        for v in vs:
            rate, cpu, late = run(v)
            res.setdefault((cfg, v), []).append((rate, cpu, late))
            if comm.rank == 0:
                print(f"# rep {r} {cfg:24s} {v:10s} {rate:5.1f} st/s", flush=True)
cpus = comm.gather({k: [c for _, c, _ in x] for k, x in res.items()})
lates = comm.gather({k: [lt for _, _, lt in x] for k, x in res.items()})
if comm.rank == 0:
    base = variants[0]
    for cfg in cfgs:
        for v in variants:
            x = res[(cfg, v)]
            rates = [a for a, _, _ in x]
            ratios = [a / b for (a, _, _), (b, _, _) in zip(x, res[(cfg, base)])]
            cpu = [st.median(c[(cfg, v)]) for c in cpus]
            lt = [st.mean(per[(cfg, v)]) for per in lates]
            print(
                f"{cfg:24s} {v:10s} median {st.median(rates):5.1f} st/s  x{base} median {st.median(ratios):.2f} "
                f"[{min(ratios):.2f}-{max(ratios):.2f}]  proc cpu ms/step {' '.join(f'{c:.1f}' for c in cpu)}  "
                f"late/step {' '.join(f'{z:.2f}' for z in lt)}"
            )
dist.destroy_process_group()
