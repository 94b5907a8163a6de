"""A BatchNorm CNN through partial_ddp when rank 0 is slow: does the partial mode keep its
speedup with DDP's defaults?

    flock /tmp/pc-bench.lock mpiexec -n 4 python bench/torch_batchnorm.py --steps 80 --slow-ms 30

Horovod's pytorch_synthetic_benchmark.py structure (synthetic images, a small ResNet-like
CNN with BatchNorm, SGD), through ``partial_ddp`` with DDP's own defaults; rank 0 sleeps
--slow-ms before each step. Every rank takes --steps steps; the fast ranks' steps/s is
their own steps over their own time (before close()). Trainers, in one job:

  full              partial_ddp(model): DDP's synchronous averaging, buffers broadcast
  solo              partial_ddp(model, mode="solo", late="fold"): the buffers averaged
                    through a solo partial round (partial_ddp's default for partial modes)
  solo+broadcast    the same with broadcast_buffers=True (DDP broadcasts rank 0's buffers
                    at every forward: rank 0 paces everyone; partial_ddp warns)

Only rank 0 prints: a table, and with --json the numbers.
"""
import argparse
import json
import time
import warnings

import torch
import torch.distributed as dist
from mpi4py import MPI

import partialcoll.integrations.torch as pct


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


def make_model(classes=10, c=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c),
                               torch.nn.ReLU(), Block(c), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(c, classes))


def run(trainer, args, comm):
    options = {"full": {}, "solo": {"mode": "solo", "late": "fold"},
               "solo+broadcast": {"mode": "solo", "late": "fold", "broadcast_buffers": True}}[trainer]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp, state = pct.partial_ddp(make_model(), **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(comm.rank)
    data = torch.randn(args.batch, 3, 16, 16, generator=g)
    target = torch.randint(0, 10, (args.batch,), generator=g)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            comm.Barrier()
            t0 = time.perf_counter()
        if comm.rank == 0:
            time.sleep(args.slow_ms / 1000)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(data), target).backward()
        opt.step()
    elapsed = time.perf_counter() - t0
    state.close()
    rates = comm.gather(args.steps / elapsed, root=0)
    comm.Barrier()
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind, default in (("--steps", int, 80), ("--warmup", int, 5), ("--batch", int, 16),
                                ("--slow-ms", float, 30.0), ("--trainers", str, "full,solo,solo+broadcast"),
                                ("--json", str, None)):
        parser.add_argument(name, type=kind, default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    pct.init_process_group()
    table = {}
    for trainer in args.trainers.split(","):
        rates = run(trainer, args, comm)
        if comm.rank == 0:
            fast = rates[1:]
            table[trainer] = {"fast_steps_per_s": sum(fast) / len(fast), "rank0_steps_per_s": rates[0]}
    if comm.rank == 0:
        base = table.get("full", {}).get("fast_steps_per_s")
        print(f"# BatchNorm CNN, P = {comm.size}, rank 0 {args.slow_ms:g} ms slower per step, {args.steps} steps")
        print(f"{'trainer':<16} {'fast ranks steps/s':>19} {'rank 0 steps/s':>15} {'vs full':>8}")
        for trainer, r in table.items():
            ratio = r["fast_steps_per_s"] / base if base else float("nan")
            print(f"{trainer:<16} {r['fast_steps_per_s']:>19.1f} {r['rank0_steps_per_s']:>15.1f} {ratio:>7.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": comm.size, "slow_ms": args.slow_ms, "steps": args.steps, "results": table}, f,
                          indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
