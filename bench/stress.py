"""Ownership stress: threads post, wait, test, close, abandon and drop at random on three collectives.

Run: flock /tmp/pc-bench.lock nice -n 10 mpiexec -n 3 python bench/soak.py --ops 100000
     (or python bench/stress.py --ops N; every mode, late "latest" and "fold")

Per rank, --threads application threads (4) share three PartialAllreduce collectives
(count 2, float64 SUM) and do --ops operations between them, each one at random. As the
threading contract says, a collective belongs to one thread, which posts to it and closes
it (thread 0 owns A, thread 1 owns B, thread 2 owns L); every thread waits for, tests and
drops the requests of A and B. L is the post+wait loop: its owner posts the same x and
out= each time and mostly waits at once (the post then often takes the result itself,
in one engine call); the others it waits for later, in any order (other threads' waits
would read out while its later requests write it: its requests are its own); none is
dropped (a request never waited for keeps the loop off that path):

- post(x) with out=None, a fresh out=, or out= a buffer the thread lent before (a post
  that names a buffer still lent raises StateError: counted as refused, not wrong;
  --fresh-out: never); with the lent out=, x is the thread's own array, filled anew each
  time: the same x and out as the last post make the post+wait path of one engine call,
  whose post takes the result where the round completes within it (counted: `early`);
  x = [1, v], v a small integer, so data[0] of a result counts the posts inside it;
- wait(timeout) or test() of a request any thread of the rank posted (several threads
  may wait on one request at once: each must get the same Result and the same data;
  --one-waiter: one thread at a time);
- drop a request (never waited for: its data must come back in a later result);
- close() of a collective by its owner thread in the middle of an epoch, while other
  threads may be waiting (StateError, refused, while one is: the contract; the owner
  tries again at each of its next operations, and after its last one until it gets in).
  close() is collective (docs/semantics.md, "Close"): it returns once every rank closes,
  so every rank closes it in the same place of its program: in the epochs the ranks
  planned for it (the same seed on every rank, --close-p), by its owner thread, and
  otherwise in the main thread's close_all. A close() drawn at random per rank instead
  hangs for good, as MPI collectives called in different orders do: rank 0's thread 0
  waits in A.close() for rank 1, whose thread 1 waits in B.close() for rank 0, and each
  rank closes the other collective only in close_all, after joining the waiting thread.
  Mode solo only (--close-p). Or abandon a collective (a ``with`` block left by an
  exception) in the epochs the ranks planned for it, under the other threads' waits.

The ranks run epochs (--epoch-ops operations each): both collectives are created, the
threads run, then the main thread closes what is left (close_all). An epoch is, by a plan
every rank draws from the same seed, either clean or one in which a rank abandons one of
the collectives partway; its peers' calls on it must then raise PeerError.

Checked against what was posted, never against the library itself:

- fold, every collective that was closed: at every rank, the sum of every result it
  took (each request once, however many threads waited on it) plus close()'s equals the
  sum of everything every rank posted (MPI_Allreduce of the posted sums): nothing lost,
  nothing twice;
- every result: data[0] == Result.posts (the reduction and the bookkeeping mask agree),
  data[1] >= data[0] (values are >= 1), rounds == 0 gives the identity;
- two waits of one request: the same round, counts and data;
- every round some rank took alone (rounds == 1): the same data at every rank;
- only the documented exceptions: StateError where the contract says so, PeerError on a
  collective a peer abandoned, Timeout of a wait given a timeout. Anything else is wrong.

A hang is caught by the caller's timeout (mpiexec under tests/conftest.py's run_mpi).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import threading
import time
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

import partialcoll as pc
import soak
from soak import mode_options

MODES = ("solo", "majority", "probe", "quorum", "full")
LATES = ("latest", "fold")
COUNT = 2


class Boom(Exception):
    """Raised inside ``with coll:`` to abandon it."""


class Tally:
    """What one rank saw in one configuration (guarded by its lock; never held across a
    library call)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops = 0
        self.results = 0
        self.wrong: List[str] = []
        self.refused = 0
        self.timeouts = 0
        self.peer_errors = 0
        self.closes = 0                    # planned close()s that returned (mid-epoch)
        self.early = 0                     # posts that took their result (post+wait in one engine call)

    def bad(self, msg: str) -> None:
        with self.lock:
            self.wrong.append(msg)


class Coll:
    """One collective of an epoch, with what this rank posted to it and took from it."""

    def __init__(self, name: str, coll: pc.PartialAllreduce) -> None:
        self.name = name
        self.coll = coll
        self.lock = threading.Lock()
        self.shared: List[pc.PartialRequest] = []      # requests any thread may wait for
        self.posted = np.zeros(COUNT)
        self.received = np.zeros(COUNT)
        self.taken: Dict[int, tuple] = {}              # id(request) -> (round, rounds, posts, data)
        self.keep: Dict[int, object] = {}              # the requests of taken (ids stay unique)
        self.alone: Dict[int, tuple] = {}              # round -> data of results with rounds == 1
        self.closed = False                            # close() began here
        self.abandoned = False                         # abandoned here
        self.peer_gone = False                         # the plan: a peer abandons it this epoch
        self.final = None


def check_result(t: Tally, c: Coll, req, res, where: str) -> None:
    """One Result of req: consistent, and the same as any other wait of req got."""
    data = np.array(res.data, copy=True)
    key = (int(res.round), int(res.rounds), int(res.posts), tuple(data.tolist()))
    if data[0] != res.posts:
        t.bad(f"{where}: {c.name} round {res.round}: data[0] {data[0]} != posts {res.posts} ({data})")
    if res.rounds == 0 and (data.any() or res.posts):
        t.bad(f"{where}: {c.name}: rounds 0 with data {data}, posts {res.posts}")
    if data[1] < data[0]:
        t.bad(f"{where}: {c.name} round {res.round}: data {data}: a value below 1 inside")
    with c.lock:
        seen = c.taken.get(id(req))
        if seen is None:
            c.taken[id(req)] = key
            c.keep[id(req)] = req
            c.received += data
            if res.rounds == 1:
                c.alone[int(res.round)] = key[3]
        elif seen != key:
            t.bad(f"{where}: {c.name} request {req.index}: two waits got {seen} and {key}")
    with t.lock:
        t.results += 1


def close_owned(t: Tally, c: Coll, timeout: float, where: str) -> bool:
    """The owner thread's planned close() of c; False if refused (another thread is
    inside wait() or test(): the contract), to be tried again."""
    c.closed = True
    try:
        c.final = c.coll.close(timeout=timeout)
    except pc.StateError:
        c.closed = False
        with t.lock:
            t.refused += 1
        return False
    except pc.Timeout:
        with t.lock:
            t.timeouts += 1
        t.bad(f"{where}: {c.name}: a planned close() timed out")
        return True
    except Exception as exc:           # noqa: BLE001 - anything else is wrong, and counted
        t.bad(f"{where}: {c.name} close(): {exc!r}")
        return True
    check_result(t, c, c.final, c.final, where + " close()")
    with t.lock:
        t.closes += 1
    return True


def worker(rank: int, tid: int, seed: int, epoch: int, nops: int, colls: List[Coll], t: Tally,
           abandon_at: Optional[tuple], timeout: float, shared_waits: bool,
           reuse_out: bool, close_at: Dict[str, int]) -> None:
    rng = np.random.default_rng([seed, rank, epoch, tid])
    mine: Dict[str, np.ndarray] = {c.name: np.empty(COUNT) for c in colls}    # the out= this thread lends again
    xs: Dict[str, np.ndarray] = {c.name: np.empty(COUNT) for c in colls}      # ... with this x, filled anew
    private: Dict[str, list] = {c.name: [] for c in colls}                     # requests posted with it
    owned = colls[tid] if tid < len(colls) else None
    close_op = close_at.get(owned.name) if owned is not None else None
    closing = False                     # the planned close is due (refused so far)
    for op in range(nops):
        if close_op is not None and (op == close_op or closing):
            closing = not close_owned(t, owned, timeout, f"rank {rank} thread {tid} epoch {epoch} op {op}")
            continue
        c = colls[int(rng.integers(len(colls)))]
        r = rng.random()
        owner = tid < len(colls) and colls[tid] is c
        if not owner and (r < 0.40 or r >= 0.995):
            r = 0.40 + 0.595 * rng.random()     # the contract: only its owner thread posts and closes
        where = f"rank {rank} thread {tid} epoch {epoch} op {op}"
        with t.lock:
            t.ops += 1
        try:
            if abandon_at is not None and abandon_at[:2] == (tid, op):
                target = next(x for x in colls if x.name == abandon_at[2])
                target.abandoned = True
                try:
                    with target.coll:
                        raise Boom()
                except Boom:
                    pass
                continue
            if c.abandoned:
                continue
            if r < 0.40:                                    # post
                v = float(rng.integers(1, 9))
                x = np.array([1.0, v])
                kind = rng.random()
                if c.name == "L" or (kind < 0.25 and reuse_out):
                    out = mine[c.name]
                    x = xs[c.name]             # the engine copied the last post's x: fill it anew
                    x[:] = (1.0, v)
                    try:
                        req = c.coll.post(x, out=out)
                    except pc.StateError:
                        with t.lock:
                            t.refused += 1     # out still lent, or the collective closing
                        continue
                    if req._result is not None:
                        with t.lock:
                            t.early += 1
                    if c.name == "L" and kind < 0.7:     # the loop: post, then wait at once
                        check_result(t, c, req, req.wait(timeout=timeout), where)
                    else:
                        private[c.name].append(req)
                else:
                    req = c.coll.post(x, out=None if kind < 0.6 else np.empty(COUNT))
                    with c.lock:
                        c.shared.append(req)
                with c.lock:
                    c.posted += x
            elif r < 0.85:                                  # wait or test a request
                own = private[c.name]
                if own and rng.random() < 0.3:
                    req = own.pop(int(rng.integers(len(own))))
                    mine_req = True
                else:
                    with c.lock:
                        if not c.shared:
                            continue
                        k = int(rng.integers(len(c.shared)))
                        # one waiter at a time: taken off the list while this thread waits
                        req = c.shared[k] if shared_waits else c.shared.pop(k)
                    mine_req = False
                try:
                    if rng.random() < 0.3:
                        done = req.test()
                        res = req.wait() if done else None
                    else:
                        res = req.wait(timeout=float(rng.choice([0.0, 0.002, 0.02, 0.2])))
                except pc.Timeout:
                    res = None
                    with t.lock:
                        t.timeouts += 1
                if res is None:
                    if mine_req:
                        own.append(req)
                    elif not shared_waits:
                        with c.lock:
                            c.shared.append(req)
                    continue
                check_result(t, c, req, res, where)
                if not mine_req:
                    with c.lock:
                        if req in c.shared:
                            c.shared.remove(req)
            elif c.name != "L":                             # drop a request
                with c.lock:
                    if c.shared:
                        c.shared.pop(int(rng.integers(len(c.shared))))
                own = private[c.name]
                if own and rng.random() < 0.5:
                    own.pop(int(rng.integers(len(own))))
        except pc.Timeout:
            with t.lock:
                t.timeouts += 1
        except pc.PeerError as exc:
            if c.peer_gone:
                with t.lock:
                    t.peer_errors += 1
            else:
                t.bad(f"{where}: {c.name}: {exc!r}")
        except pc.StateError as exc:
            if c.closed or c.abandoned or c.peer_gone:
                with t.lock:
                    t.refused += 1         # the collective is closing here, or was dropped
            else:
                t.bad(f"{where}: {c.name}: {exc!r}")
        except Exception as exc:           # noqa: BLE001 - anything else is wrong, and counted
            t.bad(f"{where}: {c.name}: {exc!r}")
    while closing:                      # refused until now: the others' waits end (they time out)
        time.sleep(0.001)
        closing = not close_owned(t, owned, timeout, f"rank {rank} thread {tid} epoch {epoch} end")


def close_plan(seed: int, epoch: int, nops: int, close_p: float, abandon: Optional[tuple]) -> Dict[str, int]:
    """The same on every rank: the collectives that their owner thread closes in this
    epoch, each with the operation at which it does (never the one abandoned)."""
    rng = np.random.default_rng([seed, 104729, epoch])
    plan = {}
    for name in "AB":
        p, op = rng.random(), int(rng.integers(nops))
        if p < close_p and (abandon is None or abandon[3] != name):
            plan[name] = op
    return plan


def epoch_plan(seed: int, epoch: int, size: int, threads: int, nops: int, abandon_p: float):
    """The same on every rank: None (a clean epoch) or (rank, thread, op, collective): the
    collective's owner thread abandons it."""
    rng = np.random.default_rng([seed, 7919, epoch])
    if size < 2 or rng.random() >= abandon_p:
        return None
    which = int(rng.integers(2))
    return (int(rng.integers(size)), which, int(rng.integers(max(1, nops // 2), max(2, nops))), "AB"[which])


def run_config(comm, mode: str, late: str, ops: int, args) -> dict:
    rank, size = comm.rank, comm.size
    t = Tally()
    epochs = max(1, (ops + args.epoch_ops - 1) // args.epoch_ops)
    per_thread = max(1, ops // (epochs * args.threads))
    lost = 0
    agree_bad = 0
    t0 = time.perf_counter()
    for epoch in range(epochs):
        plan = epoch_plan(args.seed, epoch, size, args.threads, per_thread, args.abandon_p)
        colls = [Coll(name, pc.PartialAllreduce(COUNT, np.float64, MPI.SUM, comm, mode=mode, late=late,
                                                seed=args.seed + epoch, **mode_options(mode, size)))
                 for name in "ABL"]
        abandon_at = None
        if plan is not None:
            gone = next(c for c in colls if c.name == plan[3])
            if plan[0] == rank:
                abandon_at = (plan[1], plan[2], plan[3])
            else:
                gone.peer_gone = True
        close_at = close_plan(args.seed, epoch, per_thread, args.close_p if mode == "solo" else 0.0, plan)
        threads = [threading.Thread(target=worker, args=(rank, k, args.seed, epoch, per_thread, colls, t,
                                                         abandon_at, args.timeout,
                                                         not args.one_waiter, not args.fresh_out, close_at))
                   for k in range(args.threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        # the main thread closes what is left, all together (uneven posts: close_all)
        left = [c for c in colls if not c.closed and not c.abandoned and not c.peer_gone]
        if left:
            finals = pc.close_all([c.coll for c in left], timeout=args.timeout)
            for c, f in zip(left, finals):
                c.final = f
                c.closed = True
                check_result(t, c, f, f, f"rank {rank} epoch {epoch} close_all")
        for c in colls:
            if c.peer_gone and not c.closed:
                try:
                    c.coll.close(timeout=args.timeout)
                    t.bad(f"rank {rank} epoch {epoch}: {c.name}: close() after a peer abandoned it returned")
                except pc.PeerError:
                    t.peer_errors += 1
                except pc.PartialcollError as exc:
                    t.bad(f"rank {rank} epoch {epoch}: {c.name}: close() after a peer abandoned it: {exc!r}")
        # nothing lost, nothing twice (fold); the same rounds everywhere (both)
        for c in colls:
            clean = plan is None or c.name != plan[3]
            everything = np.empty(COUNT)
            comm.Allreduce(c.posted, everything, op=MPI.SUM)
            if late == "fold" and clean and not np.array_equal(c.received, everything):
                lost += 1
                t.bad(f"rank {rank} epoch {epoch} {c.name}: received {c.received} + close != posted {everything}")
            rows = comm.allgather(c.alone)
            for rnd, data in c.alone.items():
                for other in rows:
                    if rnd in other and other[rnd] != data:
                        agree_bad += 1
                        t.bad(f"rank {rank} epoch {epoch} {c.name} round {rnd}: {data} here, {other[rnd]} elsewhere")
                        break
    seconds = time.perf_counter() - t0
    row = {"mode": mode, "late": late, "P": size, "ops_per_rank": t.ops, "results": t.results,
           "wrong": len(t.wrong), "lost": lost, "disagree": agree_bad, "refused": t.refused,
           "timeouts": t.timeouts, "peer_errors": t.peer_errors, "closes": t.closes, "early": t.early, "epochs": epochs, "seconds": round(seconds, 2)}
    for msg in t.wrong[:10]:
        print("WRONG", msg, flush=True)
    rows = comm.gather(row, root=0)
    ok = comm.allreduce(len(t.wrong) == 0, op=MPI.LAND)
    summary = None
    if rank == 0:
        summary = dict(rows[0])
        for key in ("ops_per_rank", "results", "refused", "timeouts", "peer_errors", "closes", "early"):
            summary[key] = [r[key] for r in rows]
        for key in ("wrong", "lost", "disagree"):
            summary[key] = sum(r[key] for r in rows)
        summary["seconds"] = max(r["seconds"] for r in rows)
        summary["ok"] = bool(ok)
        print(json.dumps(summary), flush=True)
    return {"ok": ok, "row": summary}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=2000, help="operations per rank per configuration")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--lates", default=",".join(LATES))
    ap.add_argument("--threads", type=int, default=4, help="application threads per rank")
    ap.add_argument("--epoch-ops", type=int, default=2000, help="operations per rank between re-creations")
    ap.add_argument("--abandon-p", type=float, default=0.25, help="probability that an epoch abandons a collective")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--one-waiter", action="store_true",
                    help="at most one thread waits for or tests a request at a time")
    ap.add_argument("--timeout", type=float, default=60.0, help="the longest wait()/close(), seconds")
    ap.add_argument("--close-p", type=float, default=0.5,
                    help="probability that an epoch has a collective's owner thread close it (every rank at the "
                         "same planned operation; mode solo)")
    ap.add_argument("--fresh-out", action="store_true", help="never lend an out= buffer twice")
    ap.add_argument("--json", help="rank 0 writes the rows here")
    ap.add_argument("--dump-after", type=float, default=0, help="print every thread's stack after this many seconds")
    return ap


def run(comm, args) -> bool:
    if comm.rank == 0:
        print(f"# stress: P={comm.size} ops={args.ops} per rank x {args.threads} threads, epochs of {args.epoch_ops}, "
              f"abandon p={args.abandon_p}, seed {args.seed}, idle {pc.rc.idle}", flush=True)
    rows, ok = [], True
    for mode in args.modes.split(","):
        for late in args.lates.split(","):
            r = run_config(comm, mode, late, args.ops, args)
            ok = ok and r["ok"]
            rows.append(r["row"])
    soak.finish(comm, "stress", rows, ok, args.json)
    return ok


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.dump_after:
        faulthandler.dump_traceback_later(args.dump_after, exit=False)    # where a hang hangs, every thread
    ok = run(MPI.COMM_WORLD, args)
    pc.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
