"""Horovod's pytorch_mnist.py loop on scikit-learn's digits, with one persistent
straggler: what does a Horovod user gain, and which configuration gets it?

    flock /tmp/pc-bench.lock mpiexec -n 4 python bench/torch_horovod_mnist.py --epochs 8 --slow-ms 30
    flock /tmp/pc-bench.lock mpiexec -n 2 python bench/torch_horovod_mnist.py --repeats 5 --trainers synch,solo+speed+nap

The script is Horovod's example with its import changed (``import
partialcoll.integrations.torch as hvd``): hvd.broadcast_parameters and
hvd.broadcast_optimizer_state at the start, hvd.DistributedOptimizer, a sampler per rank,
test metrics averaged with hvd.allreduce after every epoch (a synchronisation point, as
in Horovod's loop). Rank 0 sleeps --slow-ms before every step (a persistent straggler).
Trainers, side by side in one job, from the same initial model:

  synch         DistributedOptimizer(opt, named_parameters) (the default: mode="full"),
                DistributedSampler: Horovod's own behaviour
  solo          mode="solo", late="fold", DistributedSampler: every rank the same number
                of batches per epoch (the fast ranks idle at the epoch's end)
  solo+speed    mode="solo", late="fold", SpeedAwareSampler: each rank's share of the
                epoch in proportion to its measured speed

``--net horovod`` trains Horovod's network as it is (28x28 inputs, dropout) instead of its
8x8 scaling; ``--slow-rank`` picks the straggler. A trainer name may carry overrides for
that trainer alone, ``NAME:momentum=M`` and ``NAME:lr_x=F`` (the learning rate times F), or
any DistributedOptimizer option as ``NAME:key=value`` (``solo+speed+avg:late=latest``).
Repeat r seeds the models, the dropout and the sampler with ``--seed + r``.

Reported (rank 0): wall-clock of the training (evaluation excluded), held-out accuracy
after each epoch, and the wall-clock at which each trainer first reached synch's final
accuracy minus 1 point, as a fraction of synch's total. Where the time goes: each rank's
steps and its time in the epochs' loops (the rest of the wall-clock it waited at the
epochs' ends). ``--repeats N`` runs the trainers N times, in a rotated order (interleaved),
each repeat's ratios against that repeat's synch, and prints the median and the range with
the load average.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import partialcoll.integrations.torch as hvd


class Net(torch.nn.Module):
    """Horovod's MNIST network, scaled to 8x8 digits."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 10, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv2d(10, 20, kernel_size=3, padding=1)
        self.fc1 = torch.nn.Linear(20 * 2 * 2, 50)
        self.fc2 = torch.nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 20 * 2 * 2)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def horovod_net():
    """Horovod's MNIST network as it is (28x28 inputs, dropout): examples/horovod/pytorch_mnist.py's."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "horovod"))
    from pytorch_mnist import Net as HorovodNet
    return HorovodNet()


NETS = {"small": Net, "horovod": horovod_net}


def data(net="small"):
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if net == "horovod":            # MNIST's size, as examples/horovod/small_vision.py
        x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
        x = (x - 0.1307) / 0.3081
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


TRAINERS = {
    "synch": {},
    "solo": {"mode": "solo", "late": "fold"},
    "solo+speed": {"mode": "solo", "late": "fold", "speed": True},
    "solo+avg": {"mode": "solo", "late": "fold", "average_models": True},
    "solo+speed+avg": {"mode": "solo", "late": "fold", "speed": True, "average_models": True},
    "solo+speed+nap": {"mode": "solo", "late": "fold", "average": "nap", "speed": True, "average_models": True},
    "solo+speed+nap-noavg": {"mode": "solo", "late": "fold", "average": "nap", "speed": True},
    "solo+speed+rna": {"mode": "solo", "late": "fold", "average": "nap", "lr_scaling": "contributors",
                       "speed": True, "average_models": True},
}


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()     # Horovod's example's helper


def train(trainer, args, train_set, test_set, seed):
    torch.manual_seed(seed + hvd.rank())          # the ranks start apart: broadcast_parameters
    model = NETS[args.net]()
    options = dict(TRAINERS[trainer.split(":")[0]])
    for extra in trainer.split(":")[1:]:           # name:key=value, e.g. solo+speed+avg:momentum=0
        key, value = extra.split("=")
        options[key] = float(value) if key in ("momentum", "lr_x") else value
    momentum = options.pop("momentum", args.momentum)
    lr = args.lr * hvd.size() * options.pop("lr_x", 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    average_models = options.pop("average_models", False)
    speed = options.pop("speed", False)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **options)
    if speed:
        sampler = hvd.SpeedAwareSampler(train_set, seed=seed)
    else:
        sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    x_test, y_test = test_set.tensors
    acc, times, wall, busy, steps = [], [], 0.0, 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        hvd.barrier()
        t0 = time.perf_counter()
        model.train()
        for x, y in loader:
            if hvd.rank() == args.slow_rank % hvd.size():
                time.sleep(args.slow_ms / 1000)
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            opt.step()
            steps += 1
        busy += time.perf_counter() - t0
        # the epoch ends when every rank is done with it (Horovod's loop synchronises here)
        if average_models:           # at the epoch's end, where every rank meets anyway
            hvd.sync_parameters(model.parameters())
        hvd.barrier()
        wall += time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).float().mean().item()
        acc.append(metric_average(correct, "avg_accuracy"))
        times.append(wall)
    opt.close()
    return {"accuracy": acc, "wall_s": times, "ranks": hvd.allgather_object({"steps": steps, "loop_s": busy})}


def report(out, args, base):
    """One repeat's table (rank 0): ratios against this repeat's synch."""
    target = base["accuracy"][-1] - 0.01 if base else None
    print(f"{'trainer':<15} {'wall s':>7} {'final acc':>9} {'vs synch':>9} {'to synch-1pt':>13}  "
          "steps / loop s per rank; accuracy per epoch")
    for trainer, r in out.items():
        reach = next((t for a, t in zip(r["accuracy"], r["wall_s"]) if target is not None and a >= target), None)
        r["to_target_x"] = reach / base["wall_s"][-1] if reach is not None and base else None
        r["wall_x"] = r["wall_s"][-1] / base["wall_s"][-1] if base else None
        frac = f"{r['to_target_x']:.2f}x" if r["to_target_x"] is not None else "never"
        ranks = " ".join(f"{x['steps']}/{x['loop_s']:.1f}" for x in r["ranks"])
        print(f"{trainer:<15} {r['wall_s'][-1]:>7.2f} {100 * r['accuracy'][-1]:>8.1f}% "
              f"{r['wall_x'] if base else float('nan'):>8.2f}x {frac:>13}  {ranks}; "
              + " ".join(f"{100 * a:.1f}" for a in r["accuracy"]))


def summary(runs, trainers):
    """Median and range over the repeats, per trainer (rank 0)."""
    print(f"# {len(runs)} repeats: median [min - max]")
    print(f"{'trainer':<15} {'wall vs synch':>22} {'final acc %':>22} {'to synch-1pt':>22} never")
    for trainer in trainers:
        rs = [run[trainer] for run in runs]

        def stat(xs, scale=1.0):
            xs = sorted(x * scale for x in xs)
            return f"{statistics.median(xs):.2f} [{xs[0]:.2f} - {xs[-1]:.2f}]" if xs else "-"
        reached = [r["to_target_x"] for r in rs if r["to_target_x"] is not None]
        print(f"{trainer:<15} {stat([r['wall_x'] for r in rs]):>22} {stat([r['accuracy'][-1] for r in rs], 100):>22} "
              f"{stat(reached):>22} {len(rs) - len(reached)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--slow-ms", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--net", choices=sorted(NETS), default="small",
                        help="small: Horovod's network scaled to 8x8 digits; horovod: Horovod's as it is (28x28, dropout)")
    parser.add_argument("--slow-rank", type=int, default=0, help="the straggler (negative: from the end)")
    parser.add_argument("--trainers", default="synch,solo,solo+speed")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_set, test_set = data(args.net)
    trainers = args.trainers.split(",")
    runs = []
    for rep in range(args.repeats):
        load = os.getloadavg()[0]
        order = trainers[rep % len(trainers):] + trainers[:rep % len(trainers)]
        out = {trainer: train(trainer, args, train_set, test_set, args.seed + rep) for trainer in order}
        out = {trainer: out[trainer] for trainer in trainers}
        if hvd.rank() == 0:
            print(f"# Horovod's MNIST loop on digits, P = {hvd.size()}, rank 0 {args.slow_ms:g} ms slower per step, "
                  f"{args.epochs} epochs; repeat {rep + 1}/{args.repeats}, order {','.join(order)}, "
                  f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
            report(out, args, out.get("synch"))
        runs.append({"load": [load, os.getloadavg()[0]], **out})
    if hvd.rank() == 0 and args.repeats > 1 and "synch" in trainers:
        summary(runs, trainers)
    if hvd.rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"size": hvd.size(), "args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
