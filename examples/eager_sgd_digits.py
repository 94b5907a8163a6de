"""eager-SGD on real data: a small CNN learns scikit-learn's digits under load imbalance.

    mpiexec -n 4 python examples/eager_sgd_digits.py --imbalance random --delay-ms 20
    mpiexec -n 4 python examples/eager_sgd_digits.py --imbalance shifted --scale 0.05

The 1,797 8x8 handwritten digits that ship inside scikit-learn (load_digits), 360 held
out for testing; every rank trains on its own shard of the rest. Three trainers run the
same steps through DistributedDataParallel and partialcoll's DDP hook:

  synch     mode="full": an ordinary allreduce per step (synch-SGD)
  solo      eager-SGD solo: the first rank to finish its backward starts the round
  majority  eager-SGD majority: a rank chosen per round (seeded) starts it

Stale gradients of late ranks stay in the library's accumulator and join the next round
(late="fold": nothing is lost); models are averaged after every epoch (eager-SGD §5),
then evaluated. Imbalance (eager-SGD §7), the same on every rank (seeded):

  random    each step one random rank sleeps --delay-ms before its forward pass
  shifted   every rank is slow, by 50 to 400 ms spread over the ranks, and the pattern
            shifts by one rank each step: rank i sleeps
            (50 + 350 * ((i + step) mod P) / (P - 1)) * --scale ms
            (--scale scales the paper's delays, set for a step of ~100-400 ms on a
            GPU, to this model's step of a few ms)
  none      balanced

Reported per trainer: steps/s over the training steps (evaluation excluded) and the
held-out accuracy after each epoch. --json writes them; bench/torch_digits.py runs both
patterns and draws the plot.
"""
import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

from partialcoll.integrations.torch import (PartialHookState, init_process_group, partial_allreduce_hook,
                                            sync_parameters)

TRAINERS = {"synch": "full", "solo": "solo", "majority": "majority"}


def load(comm, test_size=360):
    """(train shard of this rank, test set) as tensors; the split is the same everywhere."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("this example needs scikit-learn: pip install scikit-learn") from None
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:test_size], order[test_size:]
    mine = train[comm.rank::comm.size]
    return (x[mine], y[mine]), (x[test], y[test])


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def delays_ms(args, size, steps):
    """delay[step][rank] in ms: the imbalance pattern, identical on every rank."""
    out = np.zeros((steps, size))
    if args.imbalance == "random":
        slow = np.random.default_rng(args.seed).integers(size, size=steps)
        out[np.arange(steps), slow] = args.delay_ms
    elif args.imbalance == "shifted":
        for step in range(steps):
            for r in range(size):
                frac = ((r + step) % size) / max(size - 1, 1)
                out[step, r] = (50 + 350 * frac) * args.scale
    return out


def accuracy(model, test):
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def train(comm, trainer, args, data, test, budget_s=None):
    """args.epochs epochs; or, given budget_s, as many epochs as fit in that much training
    time (at most 3 x args.epochs): the same wall-clock budget for every trainer."""
    model = cnn()
    ddp = DDP(model)
    extra = {"max_staleness": args.max_staleness} if args.max_staleness and trainer != "synch" else {}
    state = PartialHookState(mode=TRAINERS[trainer], comm=comm, late=args.late, average=args.average, **extra)
    ddp.register_comm_hook(state, partial_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    x, y = data
    steps_per_epoch = min(comm.allgather(len(y) // args.batch))
    epochs = args.epochs if budget_s is None else 3 * args.epochs
    delay = delays_ms(args, comm.size, epochs * steps_per_epoch)
    order_rng = torch.Generator().manual_seed(100 + comm.rank)
    acc, busy, step = [], 0.0, 0
    for _epoch in range(epochs):
        if budget_s is not None and busy >= budget_s:
            break
        perm = torch.randperm(len(y), generator=order_rng)
        comm.Barrier()
        t0 = time.perf_counter()
        for i in range(steps_per_epoch):
            if delay[step, comm.rank]:
                time.sleep(delay[step, comm.rank] / 1000)
            idx = perm[i * args.batch:(i + 1) * args.batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
            step += 1
        busy += comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        sync_parameters(model.parameters(), comm)       # eager-SGD §5: models agree again
        acc.append(accuracy(model, test))
    state.close()
    return {"steps_per_s": step / busy, "accuracy": acc, "steps": step, "seconds": busy}


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--imbalance", choices=("random", "shifted", "none"), default="random")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="random: the slow rank's delay")
    ap.add_argument("--scale", type=float, default=0.05, help="shifted: factor on the 50-400 ms delays")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--late", choices=("fold", "latest"), default="fold")
    ap.add_argument("--average", choices=("world", "nap", "none"), default="world")
    ap.add_argument("--max-staleness", type=int, default=0, help="every s-th round full (0: never)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trainers", default="synch,solo,majority")
    ap.add_argument("--equal-time", action="store_true",
                    help="the other trainers train for synch's training time (more epochs), not its epochs")
    ap.add_argument("--json")
    return ap


def run(comm, args):
    """Every trainer in turn; {trainer: {steps_per_s, accuracy, steps}} (the same on every rank)."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        init_process_group(comm)
    data, test = load(comm)
    out = {}
    for t in args.trainers.split(","):
        budget = out["synch"]["seconds"] if args.equal_time and t != "synch" and "synch" in out else None
        out[t] = train(comm, t, args, data, test, budget)
    return out


def main():
    args = parser().parse_args()
    comm = MPI.COMM_WORLD
    results = run(comm, args)
    if comm.rank == 0:
        base = results.get("synch", {}).get("steps_per_s")
        print(f"# load_digits CNN, P = {comm.size}, imbalance {args.imbalance} "
              f"({args.delay_ms if args.imbalance == 'random' else args.scale}), {args.epochs} epochs")
        print(f"# {'trainer':<9} {'steps/s':>8} {'speedup':>8}  held-out accuracy per epoch")
        for t, r in results.items():
            speed = f"{r['steps_per_s'] / base:8.2f}" if base else f"{'-':>8}"
            print(f"  {t:<9} {r['steps_per_s']:8.1f} {speed}  " + " ".join(f"{a:.3f}" for a in r["accuracy"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"P": comm.size, "args": vars(args), "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
