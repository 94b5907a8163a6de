"""Horovod's own examples, ported by their imports (examples/horovod/), side by side with
one persistent straggler: the synchronous reference (Horovod's calls on mpi4py), the port
as it is (partialcoll's default, mode "full") and the port with a partial mode chosen by
the launcher (PARTIALCOLL_TORCH), nothing else changed; and ``speed``: pytorch_mnist.py
with the two lines docs/stragglers.md recommends for a persistent straggler
(hvd.SpeedAwareSampler in DistributedSampler's place, the models averaged after each
epoch) and mode=solo, late=fold, average=nap; ``speed+root``: the same with rank 0's model
broadcast after each epoch instead of the average (what the average is worth);
``speed+steps``: the average weighted by each rank's number of steps in the epoch.
A configuration name may end in ``:epochs=N`` (or ``:lr=F``, ``:momentum=M``): the
recommended configuration with 12 epochs where the others run 8 is ``speed:epochs=12``.

    flock /tmp/pc-bench.lock python bench/horovod_examples.py --sizes 4 --examples mnist \
        --configs full,speed,speed:epochs=12 --seeds 1,2,3,4,5 \
        --mnist-args "--epochs 8 --batch-size 16 --lr 0.025 --log-interval 1000"

    flock /tmp/pc-bench.lock python bench/horovod_examples.py --sizes 2,4 --repeats 3

Each run is ``mpiexec -n P python bench/straggle.py --slow-ms 30 EXAMPLE ARGS`` (the
last rank sleeps 30 ms before every optimizer step); the configurations run interleaved
(a rotated order per repeat). Reported per example, P and configuration: the wall-clock
from the first step to the last rank's exit (median and range over the repeats), its
ratio to the same repeat's --base run (default: full, the port as it is); pytorch_mnist.py's held-out accuracy and loss after
the last epoch, and whether every printed loss equals the reference's (the port's default
against the synchronous reference, bit for bit where the sums agree); the synthetic
benchmark's img/sec of rank 0 (a fast rank). The load average is printed with every run.
"""
import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples", "horovod")
CONFIGS = {
    "reference": ("mpi4py", None),
    "full": ("partialcoll", None),
    "solo": ("partialcoll", "mode=solo,late=fold"),
    "solo+nap": ("partialcoll", "mode=solo,late=fold,average=nap"),
    "speed": ("partialcoll", "mode=solo,late=fold,average=nap"),      # and the docs' two lines (SPEED_LINES)
    "speed+rna": ("partialcoll", "mode=solo,late=fold,average=nap,lr_scaling=contributors"),      # the same
    "speed+world": ("partialcoll", "mode=solo,late=fold"),                                           # the same
    "speed+root": ("partialcoll", "mode=solo,late=fold,average=nap"),      # rank 0's model, not the average
    "speed+steps": ("partialcoll", "mode=solo,late=fold,average=nap"),     # the average weighted by steps
    "speed+latest": ("partialcoll", "mode=solo,late=latest,average=nap"),                            # the same
}
# the configuration docs/stragglers.md recommends for Horovod's loop with a persistent
# straggler: pytorch_mnist.py with two lines changed (its train sampler's name, and the
# models averaged where every rank meets at the epoch's end); MNIST only
SPEED_LINES = [
    ("    train_sampler = torch.utils.data.distributed.DistributedSampler(\n",
     "    train_sampler = hvd.SpeedAwareSampler(\n"),
    ("            train_epoch(epoch)\n",
     "            train_epoch(epoch)\n            hvd.sync_parameters(model.parameters())\n"),
]


def speed_variant(folder, config="speed"):
    """pytorch_mnist.py with SPEED_LINES applied (speed+root: rank 0's model broadcast in
    the average's place; speed+steps: the average weighted by steps), written into folder."""
    with open(os.path.join(EXAMPLES, SCRIPTS["mnist"])) as f:
        text = f.read()
    for old, new in SPEED_LINES:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    if config.startswith("speed+steps"):
        text = text.replace("hvd.sync_parameters(model.parameters())",
                            "w = float(len(train_loader)); tot = hvd.allreduce(torch.tensor(w), op=hvd.Sum).item()\n"
                            "            for p in model.parameters(): p.data.copy_(hvd.allreduce(p.data * w, op=hvd.Sum) / tot)")
    if config.startswith("speed+root"):
        text = text.replace("hvd.sync_parameters(model.parameters())",
                            "hvd.sync_parameters(model.parameters(), how='broadcast')")
    path = os.path.join(folder, "pytorch_mnist_speed.py")
    with open(path, "w") as f:
        f.write(text)
    return path
SCRIPTS = {"mnist": "pytorch_mnist.py", "synthetic": "pytorch_synthetic_benchmark.py"}


def with_options(extra, config):
    """The script's arguments for a configuration named NAME[:lr=F][:momentum=M][:epochs=N]:
    --lr times F, --momentum M, --epochs N (a configuration at another learning rate or
    momentum, or run longer to show when it reaches an accuracy)."""
    extra = list(extra)
    for option in config.split(":")[1:]:
        key, value = option.split("=")
        flag = {"lr": "--lr", "epochs": "--epochs", "momentum": "--momentum"}[key]
        if flag not in extra:
            extra += [flag, value]
        else:
            i = extra.index(flag)
            extra[i + 1] = f"{float(extra[i + 1]) * float(value):g}" if key == "lr" else value
    return extra


def run(example, size, config, args, seed=None):
    hvd, env_options = CONFIGS[config.split(":")[0]]
    env = dict(os.environ)
    env.pop("PARTIALCOLL_TORCH", None)
    if env_options:
        env["PARTIALCOLL_TORCH"] = env_options
    env["PYTHONPATH"] = os.pathsep.join([EXAMPLES, *filter(None, [env.get("PYTHONPATH")])])   # small_vision
    extra = with_options((args.mnist_args if example == "mnist" else args.synthetic_args).split(), config)
    if seed is not None and example == "mnist":
        extra += ["--seed", str(seed)]
    with tempfile.TemporaryDirectory() as times:
        script = speed_variant(times, config) if config.startswith("speed") else os.path.join(EXAMPLES, SCRIPTS[example])
        cmd = ["timeout", str(args.timeout), "mpiexec", "-n", str(size), sys.executable,
               os.path.join(HERE, "straggle.py"), "--slow-ms", str(args.slow_ms), "--times", times, "--hvd", hvd,
               script, *extra]
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        ranks = [json.load(open(p)) for p in glob.glob(os.path.join(times, "rank*.json"))]
        assert len(ranks) == size, ranks
    out = proc.stdout
    start = min(r["first"] for r in ranks)
    result = {"load": load, "wall_s": max(r["end"] for r in ranks) - start,
              "steps": sorted(r["steps"] for r in ranks),
              "test_s": [t - start for r in ranks for t in r["tests"]]}     # when each epoch's test line came
    if example == "mnist":
        tests = re.findall(r"Average loss: ([\d.]+), Accuracy: ([\d.]+)%", out)
        if not tests:
            raise SystemExit(f"{' '.join(cmd)}: no test line printed:\n{out[-3000:]}{proc.stderr[-3000:]}")
        result["accuracy"] = [float(a) for _, a in tests]
        result["loss"] = float(tests[-1][0])
        result["printed"] = sorted(re.findall(r"Loss: [\d.]+|Average loss: [\d.]+, Accuracy: [\d.]+%", out))
    else:
        result["img_s"] = float(re.search(r"Img/sec per CPU: ([\d.]+)", out).group(1))
    return result


def reached(r, base):
    """When run r's held-out accuracy first came within one point of base's final one, as a
    fraction of base's wall-clock (None: never)."""
    target = base["accuracy"][-1] - 1.0
    times = r["test_s"]
    return next((t / base["wall_s"] for a, t in zip(r["accuracy"], times) if a >= target), None)


def stat(xs, fmt="{:.2f}"):
    xs = sorted(xs)
    return (fmt + " [" + fmt + " - " + fmt + "]").format(statistics.median(xs), xs[0], xs[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", help="pytorch_mnist.py's --seed per repeat (comma-separated; sets --repeats)")
    parser.add_argument("--examples", default="mnist,synthetic")
    parser.add_argument("--configs", default="reference,full,solo")
    parser.add_argument("--slow-ms", type=float, default=30.0)
    parser.add_argument("--mnist-args", default="--epochs 8 --batch-size 16 --lr 0.05 --log-interval 1")
    parser.add_argument("--synthetic-args", default="--model resnet_small --batch-size 8 --num-iters 5")
    parser.add_argument("--base", default="full", help="the configuration wall-clock and img/s are compared to")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--json")
    args = parser.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else None
    if seeds:
        args.repeats = len(seeds)
    results = {}
    for size in map(int, args.sizes.split(",")):
        for example in args.examples.split(","):
            configs = [c for c in args.configs.split(",") if example == "mnist" or not c.startswith("speed")]
            runs = {c: [] for c in configs}
            for rep in range(args.repeats):
                order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                for config in order:
                    r = run(example, size, config, args, seeds[rep] if seeds else None)
                    runs[config].append(r)
                    print(f"P={size} {example} repeat {rep + 1} {config}: wall {r['wall_s']:.2f} s, load "
                          f"{r['load']:.1f}, steps {r['steps']}, " + (f"accuracy per epoch {' '.join(f'{a:.1f}' for a in r['accuracy'])} %" if example == "mnist"
                                                  else f"{r['img_s']:.1f} img/s"), flush=True)
            results[f"{example} P={size}"] = runs
            print(f"\n## {example}, P = {size}, last rank {args.slow_ms:g} ms slower per step, {args.repeats} "
                  "repeats: median [min - max]")
            print(f"| configuration | wall s | vs {args.base} | " +
                  (f"final accuracy % | loss | every printed loss = reference's | reached {args.base}'s final "
                   f"accuracy - 1 pt at (x {args.base}'s wall) | never |" if example == "mnist"
                   else f"img/s (rank 0) | vs {args.base} |"))
            print("|---|---:|---:|---:|---:|" + ("---|---:|---:|" if example == "mnist" else ""))
            ref, base = runs.get("reference"), runs.get(args.base)
            for config in configs:
                rs = runs[config]
                ratio = stat([r["wall_s"] / b["wall_s"] for r, b in zip(rs, base)]) if base else "-"
                row = f"| {config} | {stat([r['wall_s'] for r in rs])} | {ratio} | "
                if example == "mnist":
                    same = (f"{sum(r['printed'] == b['printed'] for r, b in zip(rs, ref))}/{len(rs)}"
                            if ref else "-")
                    reach = [reached(r, b) for r, b in zip(rs, base)] if base else []
                    got = [x for x in reach if x is not None]
                    row += (f"{stat([r['accuracy'][-1] for r in rs])} | {stat([r['loss'] for r in rs], '{:.4f}')} | "
                            f"{same} | {stat(got) if got else '-'} | {len(reach) - len(got) if base else '-'} |")
                else:
                    gain = stat([r["img_s"] / b["img_s"] for r, b in zip(rs, base)]) if base else "-"
                    row += f"{stat([r['img_s'] for r in rs], '{:.1f}')} | {gain} |"
                print(row, flush=True)
            if example == "mnist" and base:
                print(f"\nevery repeat (seed: wall vs {args.base}, reached at, final accuracy %):")
                for config in configs:
                    print(f"- {config}: " + "; ".join(
                        f"{seeds[i] if seeds else i + 1}: {r['wall_s'] / b['wall_s']:.2f}x, "
                        + (f"{x:.2f}x" if (x := reached(r, b)) is not None else "never")
                        + f", {r['accuracy'][-1]:.2f}" for i, (r, b) in enumerate(zip(runs[config], base))))
            print(f"load average during the runs: {stat([r['load'] for c in configs for r in runs[c]], '{:.1f}')}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "when": time.time(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
