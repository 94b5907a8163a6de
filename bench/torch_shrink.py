"""Training through a dead rank (on_failure="shrink") vs a checkpoint resumed on the survivors.

    python bench/torch_shrink.py --seeds 3 --json torch_shrink.json     # launches mpiexec itself

The digits CNN of examples/eager_sgd_digits.py (scikit-learn's load_digits, 360 held out),
DDP with the partial hook, mode="full", SGD (lr 0.05, momentum 0.9), batch 32, P = 4, STEPS
steps. Rank r trains on its shard of the training set (every 4th sample from r); its batch
at step s is a fixed function of (seed, r, s), so a run resumed elsewhere sees the same
batches. Per seed (the model's initial weights and the batch order):

  shrink      one job of 4 ranks under MPICH's `mpiexec -disable-auto-cleanup`
              (Open MPI: `--with-ft ulfm`), partial_ddp(on_failure="shrink"); rank 3
              raises RuntimeError (uncaught) at the start of step --die-at (or, --kill,
              is SIGKILLed there: needs ULFM); ranks 0-2 train on to STEPS
  checkpoint  4 ranks train --die-at steps and rank 0 saves the model and the optimizer;
              then a new job of 3 ranks (ranks 0-2, their own shards and batches) loads it
              and trains the rest: what a job restarted from a checkpoint taken at the
              death does (the time to restart is not counted)

Printed per seed and as the mean: final held-out accuracy of each and their difference in
points; the shrink run's recovery: the survivors' time of the step the rank died in (from
the victim's `time.time()` just before it failed to the end of that step, the slowest
survivor) against the median step time, and the collectives' own recovery seconds
(coll.recoveries). No data is re-sharded (the dead rank's shard is not trained on from
then on), in both runs alike.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

BATCH, LR, MOMENTUM, P = 32, 0.05, 0.9, 4


def batch_of(n, seed, rank, step):
    import torch
    per_epoch = n // BATCH
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_000 + rank * 1000 + step // per_epoch))
    i = step % per_epoch
    return order[i * BATCH:(i + 1) * BATCH]


def worker(args):
    """One rank of a job: --worker shrink | save | resume."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import eager_sgd_digits as example
    import partialcoll.integrations.torch as pct
    comm = MPI.COMM_WORLD
    rank = comm.rank
    # rank r of 4's shard, also in the 3-rank resumed job (load() shards by comm.rank, comm.size)
    (x_all, y_all), test = example.load(SimpleNamespace(rank=rank, size=P))
    model = example.cnn()
    torch.manual_seed(args.seed)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    shrunk = []
    ddp, state = pct.partial_ddp(model, mode="full", on_failure="shrink" if args.worker == "shrink" else None,
                                 on_shrink=(lambda failed, size: shrunk.append((failed, size, time.time())))
                                 if args.worker == "shrink" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    first, last = 0, args.steps
    if args.worker == "save":
        last = args.die_at
    if args.worker == "resume":
        saved = torch.load(os.path.join(args.dir, "ck.pt"))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        first = args.die_at
    ends = {}
    for s in range(first, last):
        if args.worker == "shrink" and rank == P - 1 and s == args.die_at:
            print(f"DIED at={time.time():.6f}", flush=True)
            if args.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"rank {rank} fails at step {s} (on purpose)")
        idx = batch_of(len(y_all), args.seed, rank, s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x_all[idx]), y_all[idx]).backward()
        opt.step()
        ends[s] = time.time()
    if args.worker == "save":
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(args.dir, "ck.pt"))
        state.close()
        dist.destroy_process_group()
        return
    acc = example.accuracy(model, test)
    torch.save(model.state_dict(), os.path.join(args.dir, f"params.{args.worker}.{rank}.pt"))
    secs = sorted({round(r["seconds"], 6) for e in state.colls.values() for r in e.coll.recoveries})
    times = [ends[s] - ends[s - 1] for s in range(first + 1, last) if s - 1 in ends and s != args.die_at]
    with open(os.path.join(args.dir, f"{args.worker}.{rank}.json"), "w") as f:
        json.dump({"rank": rank, "accuracy": acc, "shrunk": [(list(f), n) for f, n, _ in shrunk],
                                  "end_of_death_step": ends.get(args.die_at), "median_step_s": statistics.median(times),
                   "coll_recovery_s": secs}, f)
    state.close()
    if args.worker == "shrink":
        os._exit(0)          # MPI_Finalize could wait for the dead rank
    dist.destroy_process_group()


def launch(n, argv, keep_going):
    from conftest import launch as command, launch_env      # either MPI's mpiexec, as the suite's
    out = subprocess.run(command(n, [sys.executable, __file__, *argv], keep_going=keep_going), capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, **launch_env()))
    return out.stdout + out.stderr


def results(tmp, worker, n):
    got = {}
    for rank in range(n):
        path = os.path.join(tmp, f"{worker}.{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                got[rank] = json.load(f)
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--die-at", type=int, default=50)
    ap.add_argument("--kill", action="store_true", help="SIGKILL the rank (needs Open MPI with ULFM)")
    ap.add_argument("--json")
    ap.add_argument("--worker", choices=["shrink", "save", "resume"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    common = ["--steps", str(args.steps), "--die-at", str(args.die_at)]
    rows = []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            run = common + ["--seed", str(seed), "--dir", tmp]
            out = launch(P, run + ["--worker", "shrink"] + (["--kill"] if args.kill else []), keep_going=True)
            got = results(tmp, "shrink", P)
            died = [float(line.split("at=")[1].split()[0]) for line in out.splitlines() if "DIED at=" in line]
            if sorted(got) != list(range(P - 1)) or not died:
                raise SystemExit(f"shrink run, seed {seed}: survivors {sorted(got)}\n{out[-4000:]}")
            out2 = launch(P, run + ["--worker", "save"], keep_going=False)
            if not os.path.exists(os.path.join(tmp, "ck.pt")):
                raise SystemExit(f"checkpoint run, seed {seed}:\n{out2[-4000:]}")
            out3 = launch(P - 1, run + ["--worker", "resume"], keep_going=False)
            ref = results(tmp, "resume", P - 1)
            import torch
            a, b = (torch.load(os.path.join(tmp, f"params.{w}.0.pt")) for w in ("shrink", "resume"))
            gap = max(float((a[k] - b[k]).abs().max()) for k in a)
        if sorted(ref) != list(range(P - 1)):
            raise SystemExit(f"resumed run, seed {seed}: ranks {sorted(ref)}\n{out3[-4000:]}")
        row = {"seed": seed, "max_param_diff": gap, "shrink_acc": got[0]["accuracy"], "checkpoint_acc": ref[0]["accuracy"],
               "survivors_agree": len({g["accuracy"] for g in got.values()}) == 1,
               "shrunk": got[0]["shrunk"], "death_step_s": max(g["end_of_death_step"] for g in got.values()) - died[0],
               "median_step_s": statistics.median(g["median_step_s"] for g in got.values()),
               "coll_recovery_s": max(max(g["coll_recovery_s"], default=0.0) for g in got.values())}
        rows.append(row)
        print(f"seed {seed}: shrink {100 * row['shrink_acc']:.2f} %  checkpoint {100 * row['checkpoint_acc']:.2f} %  "
              f"diff {100 * (row['shrink_acc'] - row['checkpoint_acc']):+.2f} pt  death step {row['death_step_s']:.3f} s "
              f"(median step {row['median_step_s'] * 1e3:.1f} ms, collectives' recovery "
              f"{row['coll_recovery_s'] * 1e3:.1f} ms)  on_shrink {row['shrunk']}  agree {row['survivors_agree']}  "
              f"max |param diff| {gap:.2e}",
              flush=True)
    mean = {k: statistics.mean(r[k] for r in rows) for k in ("shrink_acc", "checkpoint_acc")}
    print(f"mean over {len(rows)} seeds: shrink {100 * mean['shrink_acc']:.2f} %  checkpoint "
          f"{100 * mean['checkpoint_acc']:.2f} %  diff {100 * (mean['shrink_acc'] - mean['checkpoint_acc']):+.2f} pt; "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "mean": mean, "P": P, "steps": args.steps, "die_at": args.die_at}, f, indent=1)


if __name__ == "__main__":
    main()
