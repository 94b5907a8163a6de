"""PSLD's experiments, scaled down: slow aggregators under algorithm="ps".

    flock /tmp/pc-bench.lock python bench/psld.py one        [--np 4] [--mib 16] [--rounds 30]
    flock /tmp/pc-bench.lock python bench/psld.py two
    flock /tmp/pc-bench.lock python bench/psld.py transient  [--rounds 60]
    flock /tmp/pc-bench.lock python bench/psld.py none
    flock /tmp/pc-bench.lock python bench/psld.py one --link 500mbit    (root: emulated hosts)
    flock /tmp/pc-bench.lock python bench/psld.py one --np 6 --servers 4  (dedicated servers)
    flock /tmp/pc-bench.lock python bench/psld.py one --quota 0.05       (root: a CPU quota)

A driver: it launches one MPI job per scenario (mpiexec; the slow ranks' command lines
start with ``taskset -c CPU``) and prints the table. In the job, every rank both posts
and aggregates (BytePS' colocated servers; a full-mode allreduce of --mib MiB of
float32 in blocks of --block-mib), or with --servers S the last S ranks are dedicated
servers (PSLD's layout: workers= the others; mode quorum with k = the workers, so a
round starts once every worker posted: synchronous among the workers; the slow ranks
are servers); side by side in one job:

  mpi        MPI_Allreduce through mpi4py (the peer; among the workers with --servers),
             with the interference on
  baseline   balance="static" with nothing slow (no busy processes)
  static     round-robin owners, the slow rank(s) interfered with
  proportional, psld   the same, rebalanced every --every rounds (psld: epsilon 0.1)
  fast servers         (one, two) static over the ranks that are not slow, nothing slow:
                       the baseline with fewer servers
  ideal                the same with the interference on: the best a balancer can do,
                       knowing the slow ranks in advance; what stays is the slow ranks'
                       work as workers (sending and receiving the whole vector)
Each configuration runs --repeat times, in rotated order; the run of median round time
is reported (the machine is shared: its load drifts during a run). Repetition k seeds
every collective with 1 + k, so psld explores in other rounds in each.

Interference (PSLD's "computation interference"): the slow rank is pinned to one CPU
with taskset, the other ranks to the other CPUs (--others; 'free': not pinned), and
while a configuration with interference runs, it starts --hogs busy processes pinned
to the slow rank's CPU (and kills them after). Every rank reports its threads'
affinity and the CPU each last ran on, and its busy processes' (ps's psr), and the
driver says whether the pinning held. --record FILE: rank 0 writes psld's decisions
(every epoch's engine sums, the assignment before and after) for replay. With --link RATE (root), the
job runs across P emulated hosts instead (tests/hosts.py: network namespaces, MPI over
TCP, one rank per host), and the interference is a rate limit (tc tbf) on the slow
ranks' hosts' links only, set and lifted by those ranks. With --quota CPUS (root), the
interference is a CPU quota instead, a container's CPU limit (where ranks share cores,
as here, pinning slows every rank; a quota only the slow ones; harsher than a CPU
shared with busy processes: a throttled rank cannot run until its next period): while
a configuration with interference runs, the slow ranks move themselves into a cgroup
limited to CPUS CPUs (tests/cgroup.py) and back after. Scenarios:
  one        the last rank slow
  two        the last two ranks slow (both pinned to the same CPU, with the hogs)
  transient  the last rank slow for the first third of the rounds, then not: psld must
             give it blocks back (exploration), the others need not
  none       nothing slow: psld (epsilon 0.1) against psld with epsilon 0 and static:
             what exploration costs
Printed per configuration: mean round time over the second half of the rounds (ms; the
round time is the slowest rank's), the ratio to the baseline and to static, the largest
share of the blocks a slow rank holds at the end, and the first round at which it fell below
1/(2P) (for transient: its share over the last third). --json also keeps, per
configuration, every round's time, the slow ranks' share and the blocks each server owns
per round, and the number of switches (rounds whose assignment differs from the last).
Then static / psld per repetition (each repetition runs the configurations back to back,
so the machine's load drifts less between the two than between repetitions) and its
median.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))   # hosts, cgroup


def driver(args) -> None:
    p, slow_cpu = args.np, str(args.cpu)
    slow = {"one": [p - 1], "two": [p - 2, p - 1], "transient": [p - 1], "none": [p - 1]}[args.scenario]
    worker = [sys.executable, HERE, args.scenario, "--worker", "--np", str(p), "--mib", str(args.mib),
              "--link", args.link or "", "--every", str(args.every), "--servers", str(args.servers),
              *(["--verbose"] if args.verbose else []), *(["--run-delay"] if args.run_delay else []),
              "--block-mib", str(args.block_mib), "--rounds", str(args.rounds), "--hogs", str(args.hogs),
              "--repeat", str(args.repeat), "--only", args.only,
              "--cpu", slow_cpu, "--others", args.others, "--record", args.record,
              "--slow", ",".join(map(str, slow))]
    if args.quota and os.geteuid() != 0:
        sys.exit("--quota needs root (it makes a cgroup)")
    env = None
    with contextlib.ExitStack() as up:
        if args.quota:                           # a cgroup the slow ranks join while interfered
            import cgroup
            # a short period (10 ms, or where the quota would be under the kernel's least, 1 ms,
            # the shortest above it): the slow rank runs in slices, as on a CPU shared by turns,
            # not 100 ms at a time
            period = max(10000, math.ceil(1000 / args.quota))
            path = up.enter_context(cgroup.quota_group(args.quota, period_us=period))
            cmd = ["mpiexec", "-n", str(p), *worker, "--quota-path", path]
        elif args.link:                          # one rank per emulated host (tests/hosts.py)
            import hosts
            hosts.remove_stale()
            h = hosts.Hosts(p, tag=f"pch{os.getpid()}b").up()
            up.callback(h.down)
            cmd = h.mpiexec(os.path.join(os.path.dirname(sys.executable), "mpiexec"), p, worker)
            env = dict(os.environ, **h.env())
        else:                                    # the slow ranks pinned to one CPU, the others to the rest
            cmd = ["mpiexec"]
            for r in range(p):
                if cmd[-1] != "mpiexec":
                    cmd.append(":")
                cpu = slow_cpu if r in slow else args.others
                cmd += ["-n", "1"] + (["taskset", "-c", cpu] if cpu else []) + worker
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            sys.exit(f"timed out after {args.timeout} s; the job's last words:\n"
                     f"{(exc.stdout or b'')[-3000:].decode()}{(exc.stderr or b'')[-3000:].decode()}")
    if out.returncode:
        sys.exit(out.stdout[-4000:] + out.stderr[-4000:])
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    res = json.loads(line[7:])
    report(res, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)


def report(res: dict, args) -> None:
    p = res["P"]
    layout = f"ranks {p - args.servers}..{p - 1} dedicated servers" if args.servers else "every rank a server"
    how = (f"links limited to {args.link}, one rank per emulated host" if args.link
           else f"a CPU quota of {args.quota:g} CPUs" if args.quota
           else f"taskset -c {args.cpu}, {res['hogs']} busy processes")
    print(f"scenario {res['scenario']}: P = {p}, {res['mib']} MiB float32, blocks of {res['block_mib']} MiB "
          f"({res['nblocks']} blocks), {res['rounds']} rounds per configuration, slow ranks {res['slow']} "
          f"({how}), rebalance_every {args.every}, "
          f"{layout}; "
          f"each configuration run {args.repeat} "
          f"times in rotated order, the run of median round time shown")
    base = res["configs"]["baseline"]["mean_ms"]
    static = res["configs"].get("static", {}).get("mean_ms")
    print(f"{'config':14} {'round ms':>9} {'x baseline':>10} {'static / x':>10} {'slow share':>10} "
          f"{'< 1/(2P) at':>11}  every run's round ms")
    for name, c in res["configs"].items():
        share = c.get("slow_share")
        print(f"{name:14} {c['mean_ms']:9.1f} {c['mean_ms'] / base:10.2f} "
              f"{(static / c['mean_ms']) if static else float('nan'):10.2f} "
              f"{'' if share is None else f'{share:.3f}':>10} {str(c.get('below_at', '')):>11}  "
              f"{' '.join(f'{v:.1f}' for v in c['all_ms'])}")
    pins = [(name, pin) for name, c in res["configs"].items() for pin in c.get("pinning") or () if pin]
    if pins and not (args.link or args.quota):  # what taskset set, as each rank's threads and busy processes hold it
        want = {r: (tuple(int(c) for c in args.cpu.split(",")) if r in res["slow"] else
                    tuple(int(c) for c in args.others.split(",")) if args.others else None) for r in range(p)}
        bad = [(name, pin) for name, pin in pins
               if (want[pin["rank"]] is not None and pin["threads"] != [list(want[pin["rank"]])])
               or any(h != list(want[pin["rank"]]) for h in pin["hogs"])
               or (want[pin["rank"]] is not None and not set(pin["ran_on"]) <= set(want[pin["rank"]]))]
        hogs = sum(len(pin["hogs_ran_on"]) > 0 for _, pin in pins)
        print(f"pinning: {'HELD' if not bad else 'BROKEN'} in every configuration "
              f"(ranks {[r for r in range(p) if r not in res['slow']]} on CPU {args.others or 'any'}, "
              f"ranks {res['slow']} and their busy processes on CPU {args.cpu}; each rank's threads' "
              f"affinity and the CPU each last ran on; the busy processes of {hogs} runs)"
              f"{'' if not bad else f': {bad}'}")
    if "psld" in res["configs"] and res["configs"]["psld"].get("all_share"):
        n = res["nblocks"]
        print("psld: the slow rank's blocks at the last round per repetition: "
              + " ".join(f"{round(s * n)}/{n}" for s in res["configs"]["psld"]["all_share"] if s is not None))
    for peer in ("ideal",):
        if static and peer in res["configs"]:
            pairs = [a / b for a, b in zip(res["configs"]["static"]["all_ms"], res["configs"][peer]["all_ms"])]
            print(f"static / {peer} per repetition: {' '.join(f'{r:.2f}' for r in pairs)}; "
                  f"median {sorted(pairs)[len(pairs) // 2]:.2f}")
    if static and "psld" in res["configs"]:     # repetition k of each ran back to back (rotated order)
        pairs = [a / b for a, b in zip(res["configs"]["static"]["all_ms"], res["configs"]["psld"]["all_ms"])]
        print(f"static / psld per repetition: {' '.join(f'{r:.2f}' for r in pairs)}; "
              f"median {sorted(pairs)[len(pairs) // 2]:.2f}")
    if res["scenario"] == "transient":
        for name, c in res["configs"].items():
            if "recovered_share" in c:
                print(f"  {name}: slow rank's share while slow {c['slow_share_during']:.3f}, "
                      f"over the last third (recovered) {c['recovered_share']:.3f}")


def limit_link(host: int, rate) -> None:
    """[a rank on an emulated host] Rate-limit this host's link both ways (tbf on its eth0,
    its egress, and on its switch port, its ingress), or lift the limit (rate None). The
    host is this rank's (one rank per host); tests/hosts.py names the switch."""
    sw = os.environ["PCH_TAG"] + "sw"
    for where, dev in ((None, "eth0"), (sw, f"v{host}")):
        cmd = ["tc"] + (["-n", where] if where else []) + ["qdisc"]
        if rate:
            cmd += ["replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
        else:
            cmd += ["del", "dev", dev, "root"]
        subprocess.run(cmd, check=bool(rate), capture_output=True)


# The dedicated servers wait in a barrier while the workers' rounds run: it tests every
# 5 ms, not every 0.2 ms. With 6 ranks on 2 cores, a server whose application thread woke
# 5000 times a second made a collective with a balancer thread (any second Python thread
# did) 1.5 - 2x slower, one without none; at 5 ms neither is.
QUIET = 0.005


def thread_cpu() -> dict:
    """CPU ns of this process's threads so far, by name: the progress thread (pc-progress),
    Python's threads by their names (the balancer: partialcoll-balance), the rest as 'other'."""
    import glob
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(task + "/comm") as f:
                comm = f.read().strip()
            with open(task + "/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:                      # a thread that ended meanwhile
            continue
        name = "pc-progress" if comm == "pc-progress" else names.get(int(task.rsplit("/", 1)[1]), "other")
        name = name if name in ("pc-progress", "partialcoll-balance", "MainThread") else "other"
        out[name] = out.get(name, 0) + ns
    return out


def run_delay(field: int = 1) -> int:
    """ns this process's threads have spent runnable but not running so far (the second
    field of /proc/<tid>/schedstat: the wait the scheduler's other tasks caused, what a
    CPU-starved rank shows directly; idle.c reads the same for its interference test);
    field 0: the ns they ran (CPU time)."""
    import glob
    ns = 0
    for task in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(task) as f:
                ns += int(f.read().split()[field])
        except (OSError, IndexError, ValueError):    # a thread that ended meanwhile
            continue
    return ns


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    import partialcoll as pc
    from partialcoll.algorithms import ps
    from rna import quiet_barrier                # waits without spinning a core

    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    slow = [int(s) for s in args.slow.split(",")]
    # --servers S: the last S ranks are dedicated servers (workers=), the others post (quorum)
    serving = list(range(p - args.servers, p)) if args.servers else list(range(p))
    workers = [r for r in range(p) if r not in serving] if args.servers else None
    posting = workers is None or rank in workers
    among = comm.Split(0 if posting else 1)      # the workers: the peer's communicator
    count = int(args.mib * (1 << 20)) // 4
    block = int(args.block_mib * (1 << 20))
    nblocks = ps.block_count(count, 4, block)
    x = np.full(count, 1.0 + rank, np.float32)
    rounds = args.rounds
    hogs: list = []
    pinned: list = []                            # pinning() once interfered, per configuration
    if args.quota_path:
        import cgroup
        home = cgroup.home()

    def interfere(on: bool) -> None:
        quiet_barrier(comm, QUIET)               # every rank got here (servers run ahead of the workers)
        if args.link or args.quota_path:         # this host's link, both ways (tc tbf); a CPU quota
            if rank in slow and on != bool(hogs):
                if args.link:
                    limit_link(rank, args.link if on else None)
                else:
                    cgroup.join(args.quota_path if on else home)
                hogs[:] = [on] if on else []
        elif rank in slow and on and not hogs:
            for _ in range(args.hogs):
                hogs.append(subprocess.Popen(["taskset", "-c", args.cpu, sys.executable, "-c", "while True: pass"]))
            time.sleep(0.05)                     # the hogs' taskset has set their CPU
        elif not on:
            for h in hogs:
                h.kill()
                h.wait()
            hogs.clear()
        quiet_barrier(comm, QUIET)

    def pinning() -> dict:
        """The CPUs this rank's threads and its busy processes may run on (sched_getaffinity,
        what taskset sets), and the CPU each last ran on (ps's psr: /proc/PID/stat field 39)."""
        def psr(path):
            try:
                with open(path) as f:
                    return int(f.read().rsplit(")", 1)[1].split()[36])
            except (OSError, IndexError, ValueError):
                return -1
        import glob
        tasks = glob.glob("/proc/self/task/*")
        return {"rank": rank,
                "threads": sorted({tuple(sorted(os.sched_getaffinity(int(t.rsplit("/", 1)[1])))) for t in tasks}),
                "ran_on": sorted({psr(t + "/stat") for t in tasks}),
                "hogs": sorted({tuple(sorted(os.sched_getaffinity(h.pid))) for h in hogs if isinstance(h, subprocess.Popen)}),
                "hogs_ran_on": sorted({psr(f"/proc/{h.pid}/stat") for h in hogs if isinstance(h, subprocess.Popen)})}

    decisions: list = []
    if args.record:                              # psld's inputs and outputs, every epoch, as the balancer saw them
        from partialcoll import balance as bal
        times, decide = bal.OwnerTimes, bal.decide

        class Recorded(times):
            def __init__(self, sums, rounds=1):
                super().__init__(sums, rounds)
                self.sums = [int(x) for x in sums]

        def recorded(kind, measured, predictor, servers, current, seed, epoch, epsilon):
            new = decide(kind, measured, predictor, servers, current, seed, epoch, epsilon)
            if kind == "psld":
                decisions.append({"epoch": epoch, "sums": getattr(measured, "sums", None), "current": list(current),
                                  "new": list(new), "seed": seed, "late": list(predictor.late)})
            return new
        bal.OwnerTimes, bal.decide = Recorded, recorded

    def measure(make, interfered, rep) -> dict:
        """Round times (the slowest rank's) and the slow ranks' share per round."""
        if args.verbose:
            print(f"rank {rank}: {make}", file=sys.stderr, flush=True)
        coll = make(rep)
        if args.verbose and coll is not None:    # a hang: what the balancer thread says
            import threading
            dog = threading.Timer(25, lambda: print(f"rank {rank} after 25 s: balancer "
                                                    f"{coll._balancer and coll._balancer.error!r} "
                                                    f"{coll._balancer and coll._balancer.history}",
                                                    file=sys.stderr, flush=True))
            dog.daemon = True
            dog.start()
        quiet_barrier(comm, QUIET)
        decisions.clear()
        pinned.clear()
        ends, waits, runs = [], [], []
        cpu0 = thread_cpu()
        t0 = time.perf_counter()
        for i in range(rounds):
            if args.scenario == "transient" and i == rounds // 3:
                interfere(False)                 # the straggler recovers
            elif i == 0:
                interfere(interfered)
                pinned.append(pinning())
            if not posting:
                continue
            if coll is None:
                out = np.empty_like(x)
                among.Allreduce(x, out, op=MPI.SUM)
            else:
                coll.post(x).wait(timeout=120)
            ends.append(time.perf_counter() - t0)
            if args.run_delay:
                waits.append(run_delay())
                runs.append(run_delay(0))
        interfere(False)                         # its barriers: the servers measure once the rounds are over
        cpu = {k: round((v - cpu0.get(k, 0)) / 1e6 / rounds, 3) for k, v in thread_cpu().items()}   # ms per round
        shares, counts = [], []
        if coll is not None:
            coll.close()
            for i in range(rounds):
                a = coll.assignment(round=i)
                shares.append(max(float(np.count_nonzero(a == s)) / len(a) for s in slow))   # the busiest slow rank
                counts.append(np.bincount(a, minlength=p)[serving].tolist())               # blocks per server
        who = coll.stats() if coll is not None else None     # who is slow, as the rounds saw it
        every = comm.gather(ends if posting else None)
        cpus = comm.gather(cpu)
        delays = comm.gather(np.diff(waits).tolist() if args.run_delay and posting else None)
        ran = comm.gather(np.diff(runs).tolist() if args.run_delay and posting else None)
        pins = comm.gather(pinned[0] if pinned else None)
        if rank:
            return {}
        t = np.max(np.array([e for e in every if e is not None]), axis=0)
        per = np.diff(np.concatenate([[0.0], t]))
        out = {"mean_ms": float(per[rounds // 2:].mean() * 1e3), "per_round_ms": [round(v * 1e3, 2) for v in per],
               "cpu_ms_per_round": {r: cpus[r] for r in range(p)}}      # per rank and thread, over all rounds
        if any(pins):
            out["pinning"] = pins
        if args.run_delay:                       # per rank: ns runnable, not running, in each round
            out["run_delay_ns"] = delays
            out["run_ns"] = ran
        if decisions:
            out["decisions"] = list(decisions)
        if who is not None:
            out["who_is_slow"] = {"stragglers": who.stragglers()[:2],
                                  "lateness_mean_ms": [round(float(v) * 1e3, 2) for v in who.lateness_s["mean"]],
                                  "waited_for_s": [round(float(v), 3) for v in who.waited_for_s]}
        if shares:
            out["slow_share"] = shares[-1]
            below = [i for i, s in enumerate(shares) if s < 1 / (2 * p)]
            out["below_at"] = below[0] if below else None
            out["shares"] = shares
            out["blocks_per_server"] = counts
            out["switches"] = sum(counts[i] != counts[i - 1] for i in range(1, rounds))
            if args.scenario == "transient":
                out["slow_share_during"] = float(np.mean(shares[rounds // 6:rounds // 3]))
                out["recovered_share"] = float(np.mean(shares[2 * rounds // 3:]))
        return out

    def ps_coll(balance, servers=serving, **kw):
        if workers:                              # dedicated servers: every worker's post starts a round
            kw.update(mode="quorum", quorum=len(workers), workers=workers)
        else:                                    # every rank posts and serves: a full allreduce
            kw.update(mode="full")
        # seed: psld's exploration draws, a sequence per repetition (with one seed for all,
        # every repetition explored in the same rounds)
        return lambda rep: pc.PartialAllreduce(count, np.float32, MPI.SUM, comm, algorithm="ps", block_bytes=block,
                                               balance=balance, rebalance_every=args.every, seed=1 + rep,
                                               servers=servers, **kw)

    fast = [r for r in serving if r not in slow]
    configs = {"mpi": (lambda rep: None, True), "baseline": (ps_coll("static"), False)}
    if args.scenario in ("one", "two"):          # where the gap to the baseline comes from
        configs.update({"fast servers": (ps_coll("static", servers=fast), False),
                        "ideal": (ps_coll("static", servers=fast), True)})
    if args.scenario == "none":
        configs.update({"static": (ps_coll("static"), False), "psld eps 0": (ps_coll("psld", epsilon=0.0), False),
                        "psld": (ps_coll("psld"), False), "proportional": (ps_coll("proportional"), False)})
    else:
        configs.update({"static": (ps_coll("static"), True), "proportional": (ps_coll("proportional"), True),
                        "psld": (ps_coll("psld"), True)})
    if args.only:                                # these (and the baseline) alone
        keep = {"baseline", *args.only.split(",")}
        configs = {k: v for k, v in configs.items() if k in keep}
    runs: dict = {name: [] for name in configs}
    names = list(configs)
    for rep in range(args.repeat):                # rotated order: drift on the shared machine spreads evenly
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            make, interfered = configs[name]
            runs[name].append(measure(make, interfered, rep))
    results = {}
    if args.record and rank == 0:
        with open(args.record, "w") as f:
            json.dump({name: [g.get("decisions", []) for g in got] for name, got in runs.items()}, f)
    for name, got in runs.items():               # the repetition of median mean round time
        if rank == 0:
            means = [g["mean_ms"] for g in got]
            results[name] = dict(sorted(got, key=lambda g: g["mean_ms"])[len(got) // 2], all_ms=means,
                                 all_share=[g.get("slow_share") for g in got])
            if args.run_delay:
                results[name]["all_run_delay_ns"] = [g.get("run_delay_ns") for g in got]
                results[name]["all_run_ns"] = [g.get("run_ns") for g in got]
            for g in got:
                g.pop("decisions", None)
    if rank == 0:
        print("RESULT " + json.dumps({"scenario": args.scenario, "P": p, "mib": args.mib, "block_mib": args.block_mib,
                                      "nblocks": nblocks, "rounds": rounds, "slow": slow, "hogs": 0 if args.scenario == "none" else args.hogs,
                                      "configs": results}), flush=True)
    pc.finalize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["one", "two", "transient", "none"])
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--mib", type=float, default=16)
    ap.add_argument("--block-mib", type=float, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--link", help="interference by link instead: run across P emulated hosts (root) and "
                                   "rate-limit the slow ranks' links to LINK, e.g. 500mbit")
    ap.add_argument("--quota", type=float, default=0.0,
                    help="interference by a CPU quota instead (root): the slow ranks' share of a CPU, e.g. 0.05")
    ap.add_argument("--every", type=int, default=2, help="rebalance_every")
    ap.add_argument("--servers", type=int, default=0,
                    help="the last SERVERS ranks are dedicated servers (workers= the others, mode quorum)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every configuration (median reported)")
    ap.add_argument("--only", default="", help="run only these configurations (comma-separated; the "
                                               "baseline always), e.g. static,psld")
    ap.add_argument("--cpu", default=str(max(os.sched_getaffinity(0))))
    ap.add_argument("--others", default=None,
                    help="CPUs the ranks that are not slow are pinned to (taskset -c; default: every CPU "
                         "but --cpu, so no rank shares the slow rank's CPU; 'free': not pinned)")
    ap.add_argument("--record", default="", help="rank 0 writes psld's decisions here (JSON: per "
                                                  "repetition, every epoch's engine sums and the decision)")
    ap.add_argument("--run-delay", action="store_true",
                    help="every rank records, per round, the ns its threads were runnable but not running "
                         "(schedstat; run_delay_ns per rank in --json)")
    ap.add_argument("--timeout", type=float, default=170)
    ap.add_argument("--json", help="driver: also write the results here")
    ap.add_argument("--verbose", action="store_true", help="every rank says what it starts (on stderr)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--slow", default="", help=argparse.SUPPRESS)
    ap.add_argument("--quota-path", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.others is None:
        args.others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if str(c) != args.cpu)
    args.others = "" if args.others == "free" else args.others
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
