"""eager-SGD on real data under imbalance: synch vs solo vs majority.

    flock /tmp/pc-bench.lock mpiexec -n 4 python bench/torch_digits.py --json digits_p4.json --plot digits_p4.png

Runs examples/eager_sgd_digits.py's three trainers (a small CNN on scikit-learn's
load_digits, through DDP and the partial hook) under each imbalance pattern in turn
(--patterns, default random and shifted), and prints one table: steps/s, speedup over
synch, final held-out accuracy and its difference to synch's (in points), and the
accuracy after each epoch (final: after the last epoch; best: the highest reached).
Solo and majority run with eager-SGD's staleness bound, --max-staleness 4 (every 4th
round full), unless told otherwise. --equal-time gives them synch's training time instead
of its epochs (they run more epochs in it). --plot draws accuracy per epoch and steps/s per trainer.
"""
import argparse
import copy
import json
import os
import sys

from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import eager_sgd_digits as example


def plot(table, path, size):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    patterns = list(table)
    fig, axes = plt.subplots(1, len(patterns) + 1, figsize=(4.2 * (len(patterns) + 1), 3.4))
    for ax, pattern in zip(axes, patterns):
        for trainer, r in table[pattern]["results"].items():
            ax.plot(range(1, len(r["accuracy"]) + 1), r["accuracy"], marker="o", label=trainer)
        ax.set_title(f"{pattern} imbalance, P = {size}")
        ax.set_xlabel("epoch")
        ax.set_ylabel("held-out accuracy")
        ax.legend()
    ax = axes[-1]
    width = 0.8 / len(patterns)
    trainers = list(table[patterns[0]]["results"])
    for j, pattern in enumerate(patterns):
        rates = [table[pattern]["results"][t]["steps_per_s"] for t in trainers]
        ax.bar([i + j * width for i in range(len(trainers))], rates, width, label=pattern)
    ax.set_xticks([i + width * (len(patterns) - 1) / 2 for i in range(len(trainers))], trainers)
    ax.set_ylabel("steps/s")
    ax.set_title("throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = example.parser()
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--patterns", default="random,shifted")
    ap.add_argument("--plot")
    ap.set_defaults(max_staleness=4)          # eager-SGD's staleness bound: every 4th round full
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    table = {}
    for pattern in args.patterns.split(","):
        a = copy.copy(args)
        a.imbalance = pattern
        table[pattern] = {"delay": a.delay_ms if pattern == "random" else a.scale, "results": example.run(comm, a)}
    example.dist.destroy_process_group()
    if comm.rank != 0:
        return
    print(f"# load_digits CNN through DDP + partial hook, P = {comm.size}, {args.epochs} epochs, batch "
          f"{args.batch}/rank; random: one rank +{args.delay_ms} ms per step; shifted: 50-400 ms x {args.scale}")
    print(f"# max_staleness={args.max_staleness} (solo and majority), late={args.late}, average={args.average}; "
          + ("equal time: solo and majority train as long as synch" if args.equal_time else "equal epochs"))
    print(f"# {'imbalance':<9} {'trainer':<9} {'steps/s':>8} {'speedup':>8} {'final acc':>10} {'vs synch':>9}"
          f" {'best acc':>9} {'vs synch':>9}  accuracy per epoch")
    for pattern, entry in table.items():
        res = entry["results"]
        base = res.get("synch")
        for trainer, r in res.items():
            speed = r["steps_per_s"] / base["steps_per_s"] if base else float("nan")
            diff = 100 * (r["accuracy"][-1] - base["accuracy"][-1]) if base else float("nan")
            best = max(r["accuracy"])
            best_diff = 100 * (best - max(base["accuracy"])) if base else float("nan")
            print(f"  {pattern:<9} {trainer:<9} {r['steps_per_s']:8.1f} {speed:8.2f} {r['accuracy'][-1]:10.3f} "
                  f"{diff:+8.1f}p {best:9.3f} {best_diff:+8.1f}p  " + " ".join(f"{x:.3f}" for x in r["accuracy"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"P": comm.size, "args": vars(args), "table": table}, f, indent=1)
    if args.plot:
        plot(table, args.plot, comm.size)


if __name__ == "__main__":
    main()
