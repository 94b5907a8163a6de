"""RNA's experiments on this machine: python bench/rna.py {mixed,probe,push} [options]

    flock /tmp/pc-bench.lock mpiexec -n 6 python bench/rna.py mixed --seconds 15 --plot rna-mixed.png
    flock /tmp/pc-bench.lock mpiexec -n 6 python bench/rna.py probe --rounds 150
    flock /tmp/pc-bench.lock mpiexec -n 4 python bench/rna.py push

mixed   RNA's mixed heterogeneity (its Fig. 7-8, delays scaled to this model): the digits
        CNN of examples/eager_sgd_digits.py, two speed classes (A: the first half of the
        ranks sleep a random 0-10 ms per step, B: the others 20-40 ms, --a-ms, --b-ms;
        RNA used 0-50 and 50-100 ms). Every trainer gets the same wall-clock budget; a rank steps until its
        own time is up (fast ranks take more steps), then the collectives close. Trainers
        (DistributedOptimizer, late="fold"):
          synch         mode="full", average="world"
          solo          eager-SGD solo, average="world", max_staleness=4
          majority      eager-SGD majority, average="world", max_staleness=4
          probe         flat RNA: probe(2), average="nap", lr_scaling="contributors"
          hierarchical  RNA: hierarchy="auto" (grouped at step 8 from the measured step
                        times), probe(2) in each group, average="nap",
                        lr_scaling="contributors", the groups' models averaged every
                        --average-every steps through an AsyncAverager
        Reported: steps/s (all ranks' steps over the budget) and the held-out accuracy
        of the ranks' averaged model at --checkpoints times.
probe   RNA's probe-count experiment (its Fig. 10): every rank sleeps a random delay
        (exponential, mean --delay-ms) after a common start, then posts to a probe(q)
        partial allreduce; the response time is when the first rank has the round's
        result (the initiator: the first of the q candidates to arrive, plus the round),
        for q = 1, 2, 3, 4 (q = 1 is majority).
push    The cost of an AsyncAverager push (every rank pushes at once, the server among
        them; and one client pushing alone) of 1 and 16 MiB of float32 against
        MPI_Allreduce of the same size (mpi4py), measured in the same run.

Only rank 0 prints; --json writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc


def quiet(req, interval=0.0002):
    while not req.Test():
        time.sleep(interval)


def quiet_barrier(comm, interval=0.0002):
    """A barrier that waits without spinning a core: it tests every `interval` seconds."""
    quiet(comm.Ibarrier(), interval)


# -- mixed heterogeneity ------------------------------------------------------------------
TRAINERS = {
    "synch": dict(mode="full", average="world"),
    "solo": dict(mode="solo", average="world", max_staleness=4),
    "majority": dict(mode="majority", average="world", max_staleness=4),
    "probe": dict(mode="probe", candidates=2, average="nap", lr_scaling="contributors"),
    "hierarchical": dict(mode="probe", candidates=2, average="nap", lr_scaling="contributors", hierarchy="auto",
                         regroup_every=8, regroup_points=1, hysteresis=1, window=6),
}


def flat_params(model):
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def load_flat(model, flat):
    import torch
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(flat[off:off + p.numel()]).reshape(p.shape))
            off += p.numel()


def train_mixed(comm, name, args, data, test):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import eager_sgd_digits as example
    from partialcoll.integrations.torch import DistributedOptimizer
    p, r = comm.size, comm.rank
    slow = r >= (p + 1) // 2                    # class B
    lo, hi = args.b_ms if slow else args.a_ms
    rng = np.random.default_rng(1000 * args.seed + r)
    model = example.cnn()
    opts = dict(TRAINERS[name])
    if "hierarchy" in opts:
        opts["average_every"] = args.average_every
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), comm=comm,
                               late="fold", seed=args.seed, **opts)
    x, y = data
    order = torch.Generator().manual_seed(100 + r)
    perm, pos = torch.randperm(len(y), generator=order), 0
    marks = [args.seconds * (k + 1) / args.checkpoints for k in range(args.checkpoints)]
    snaps = []
    grouped = False                             # hierarchical: regrouped (the group agrees on its stop)
    quiet_barrier(comm)
    t0 = time.perf_counter()
    steps = 0
    while True:
        now = time.perf_counter() - t0
        while len(snaps) < len(marks) and now >= marks[len(snaps)]:
            snaps.append(flat_params(model))
        if not grouped and now >= args.seconds:
            break
        time.sleep(rng.uniform(lo, hi) / 1000)
        if pos + args.batch > len(y):
            perm, pos = torch.randperm(len(y), generator=order), 0
        idx = perm[pos:pos + args.batch]
        pos += args.batch
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        steps += 1
        sync = opt._sync
        grouped = sync.grouping is not None and sync.grouping.regroupings > 0
        if grouped and steps % args.average_every == 0:
            # averaging is collective over the group: its members stop together, when the
            # first of them is out of time (checked where they average anyway)
            out = np.zeros(1, np.int32)
            quiet(sync.grouping.group_comm.Iallreduce(
                np.array([time.perf_counter() - t0 >= args.seconds], np.int32), out, op=MPI.MAX))
            if out[0]:
                break
    seconds = time.perf_counter() - t0
    groups = opt._sync.grouping.groups if opt._sync.grouping is not None else None
    opt.close()
    while len(snaps) < len(marks):
        snaps.append(flat_params(model))
    acc = []
    for snap in snaps:
        mean = comm.allreduce(snap) / p
        load_flat(model, mean)
        acc.append(example.accuracy(model, test))
    counts = comm.allgather(steps)
    return {"steps_per_s": sum(counts) / args.seconds, "steps": counts, "seconds": comm.allreduce(seconds, op=MPI.MAX),
            "accuracy": acc, "times": marks, "groups": groups,
            "steps_per_s_A": sum(counts[:(p + 1) // 2]) / args.seconds,
            "steps_per_s_B": sum(counts[(p + 1) // 2:]) / args.seconds}


def mixed(comm, args):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import eager_sgd_digits as example
    torch.set_num_threads(1)
    data, test = example.load(comm)
    out = {t: train_mixed(comm, t, args, data, test) for t in args.trainers.split(",")}
    if comm.rank == 0:
        base = out.get("synch")
        a, b = args.a_ms, args.b_ms
        print(f"# RNA mixed heterogeneity: load_digits CNN, P = {comm.size} (A: ranks 0-{(comm.size + 1) // 2 - 1} "
              f"+{a[0]:g}-{a[1]:g} ms/step, B: the others +{b[0]:g}-{b[1]:g} ms/step), {args.seconds:g} s per "
              f"trainer, batch {args.batch}")
        print(f"# {'trainer':<13} {'steps/s':>8} {'A':>7} {'B':>7} {'speedup':>8} {'final acc':>10} {'vs synch':>9}"
              f"  accuracy at {', '.join(f'{t:.1f}' for t in out[next(iter(out))]['times'])} s")
        for t, res in out.items():
            sp = res["steps_per_s"] / base["steps_per_s"] if base else float("nan")
            diff = 100 * (res["accuracy"][-1] - base["accuracy"][-1]) if base else float("nan")
            print(f"  {t:<13} {res['steps_per_s']:8.1f} {res['steps_per_s_A']:7.1f} {res['steps_per_s_B']:7.1f} "
                  f"{sp:8.2f} {res['accuracy'][-1]:10.3f} {diff:+8.1f}p  "
                  + " ".join(f"{a:.3f}" for a in res["accuracy"])
                  + (f"  groups {res['groups']}" if res["groups"] else ""))
        if args.plot:
            plot_mixed(out, args.plot, comm.size)
    return out


def plot_mixed(out, path, size):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    for t, res in out.items():
        a1.plot(res["times"], res["accuracy"], marker="o", label=t)
    a1.set_xlabel("training time (s)")
    a1.set_ylabel("held-out accuracy (averaged model)")
    a1.set_title(f"mixed heterogeneity, P = {size}")
    a1.legend()
    names = list(out)
    a2.bar(names, [out[t]["steps_per_s"] for t in names])
    a2.set_ylabel("steps/s (all ranks)")
    a2.set_title("throughput")
    a2.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- probe count ----------------------------------------------------------------------------
def probe(comm, args):
    p, r = comm.size, comm.rank
    out = {}
    x = np.ones(1024, np.float32)
    for q in range(1, min(4, p) + 1):
        coll = pc.PartialAllreduce(x.size, np.float32, MPI.SUM, comm, mode="probe", candidates=q, seed=args.seed)
        rng = np.random.default_rng(7 * args.seed + r)
        times = []
        for _ in range(args.rounds):
            quiet_barrier(comm)
            t0 = time.perf_counter()
            time.sleep(rng.exponential(args.delay_ms) / 1000)
            req = coll.post(x)
            req.wait()
            done = time.perf_counter() - t0
            times.append(comm.allreduce(done, op=MPI.MIN))     # the first rank to have the result
        coll.close()
        out[q] = {"mean_ms": 1000 * float(np.mean(times)), "median_ms": 1000 * float(np.median(times)),
                  "p90_ms": 1000 * float(np.percentile(times, 90))}
    if r == 0:
        print(f"# RNA probe count: P = {p}, per-rank delay exponential with mean {args.delay_ms:g} ms, "
              f"{args.rounds} rounds each; response time = first rank with the round's result")
        print(f"# {'q':>2} {'mean ms':>8} {'median ms':>10} {'p90 ms':>8}")
        for q, v in out.items():
            print(f"  {q:>2} {v['mean_ms']:8.2f} {v['median_ms']:10.2f} {v['p90_ms']:8.2f}")
    return out


# -- AsyncAverager push cost -------------------------------------------------------------
def push(comm, args):
    out = {}
    for mib in (1, 16):
        n = (mib << 20) // 4
        x = np.full(n, comm.rank, np.float32)
        y = np.empty_like(x)
        with pc.AsyncAverager(n, np.float32, comm=comm, server=0) as avg:
            for _ in range(2):                       # warm-up
                avg.push(x).wait()
                comm.Allreduce(x, y)
            quiet_barrier(comm)
            pt, at, alone = [], [], []
            for _ in range(args.iters):
                quiet_barrier(comm)
                if comm.rank == comm.size - 1:        # one client pushes, the others idle
                    t0 = time.perf_counter()
                    avg.push(x).wait()
                    alone.append(time.perf_counter() - t0)
                quiet_barrier(comm)
                t0 = time.perf_counter()
                avg.push(x).wait()
                pt.append(time.perf_counter() - t0)
                quiet_barrier(comm)
                t0 = time.perf_counter()
                comm.Allreduce(x, y)
                at.append(time.perf_counter() - t0)
        pt = comm.allreduce(float(np.median(pt)), op=MPI.MAX)
        at = comm.allreduce(float(np.median(at)), op=MPI.MAX)
        alone = comm.bcast(float(np.median(alone)) if alone else None, root=comm.size - 1)
        out[mib] = {"push_ms": 1000 * pt, "allreduce_ms": 1000 * at, "alone_ms": 1000 * alone}
    if comm.rank == 0:
        print(f"# AsyncAverager push (all {comm.size} ranks at once, server rank 0 among them) vs MPI_Allreduce "
              f"(mpi4py), float32, median of {args.iters}, slowest rank")
        print(f"# {'MiB':>4} {'push ms':>9} {'allreduce ms':>13} {'ratio':>6} {'one pusher ms':>14}")
        for mib, v in out.items():
            print(f"  {mib:>4} {v['push_ms']:9.2f} {v['allreduce_ms']:13.2f} {v['push_ms'] / v['allreduce_ms']:6.2f}"
                  f" {v['alone_ms']:14.2f}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("mixed", "probe", "push"))
    ap.add_argument("--seconds", type=float, default=15.0, help="mixed: training time per trainer")
    ap.add_argument("--checkpoints", type=int, default=5, help="mixed: accuracy measured at this many times")
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--average-every", type=int, default=4, help="mixed: hierarchical model averaging")
    ap.add_argument("--a-ms", type=lambda s: tuple(float(v) for v in s.split(",")), default=(0.0, 10.0),
                    help="mixed: class A's extra delay per step, uniform in LO,HI ms")
    ap.add_argument("--b-ms", type=lambda s: tuple(float(v) for v in s.split(",")), default=(20.0, 40.0),
                    help="mixed: class B's extra delay per step, uniform in LO,HI ms")
    ap.add_argument("--rounds", type=int, default=150, help="probe: rounds per q")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="probe: mean random delay")
    ap.add_argument("--iters", type=int, default=20, help="push: timed pushes per size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    res = {"mixed": mixed, "probe": probe, "push": push}[args.what](comm, args)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"P": comm.size, "args": vars(args), "results": res}, f, indent=1)
    pc.finalize()


if __name__ == "__main__":
    main()
