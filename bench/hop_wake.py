"""What a neighbour's update costs the receiving rank while it computes (NeighborAllreduce).

    flock /tmp/pc-bench.lock mpiexec -n 8 python bench/hop_wake.py [--compute-ms 20]

Ring graph, standard mode. Every iteration a rank posts its update, then "computes"
(sleeps --compute-ms: the update of its in-neighbours arrives meanwhile), then waits.
Per iteration and rank:

- delay: from the later of its in-neighbours' posts of iteration k to the moment the
  library had combined their updates into iteration k's result (the time the result was
  made; one monotonic clock orders the processes of one host). Work done by Python in
  wait() shows as a delay of about the compute time; work done by the engine while the
  application computes, as the message's transfer time.
- wake-ups: blocking engine calls that returned to Python inside wait() (each is Python
  woken to handle something); engine calls inside wait() (Python handling messages); and
  engine calls made between post() returning and wait() being called (the application
  computes: always 0 here).
- early: iterations whose result was complete before wait() was called.

The engine calls are counted by a proxy in front of the binding (partialcoll._engine.lib);
the completion time is NeighborResult.completed_ns where the library reports it, else the
time of the library's own combine step (wrapped). Only rank 0 prints.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll import _engine
from partialcoll import neighbor as nb

BLOCKING = ("pc_sched_wait_some", "pc_hop_wait")     # engine calls that may sleep


class Counting:
    """The binding, counting calls: all of them, and the wake-ups (blocking calls, timeout >
    0, that returned without the result: pc_sched_wait_some always hands back to Python's
    own loop; pc_hop_wait only when it timed out)."""

    def __init__(self, lib):
        self._lib, self.calls, self.blocking = lib, 0, 0

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not callable(fn):
            return fn
        me = self

        def call(*args):
            me.calls += 1
            out = fn(*args)
            # a wake-up: a blocking call that returns to Python without the wait's result
            if name in BLOCKING and any(isinstance(a, float) and a > 0 for a in args) and \
                    (name != "pc_hop_wait" or out == me._lib.PC_ERR_TIMEOUT):
                me.blocking += 1
            return out
        return call


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-i", "--iterations", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--count", type=int, default=16384)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    g = pc.ring_graph(comm)
    coll = pc.NeighborAllreduce(args.count, np.float32, comm=g)
    made = {}                                  # iteration -> when its result was made (ns)
    if hasattr(coll, "_complete"):             # the library combines in Python: time that step
        inner = coll._complete

        def timed(req, ready):
            inner(req, ready)
            made[req.iteration] = time.monotonic_ns()
        coll._complete = timed
    proxy = Counting(_engine.lib)
    _engine.lib = proxy
    x = np.ones(args.count, np.float32)
    posted, delays_of, wakes, between, inwait, early = [], {}, [], [], [], 0
    for k in range(args.warmup + args.iterations):
        t_post = time.monotonic_ns()
        req = coll.post(x)
        c0 = proxy.calls
        time.sleep(args.compute_ms * 1e-3)
        between.append(proxy.calls - c0)
        b0, c1 = proxy.blocking, proxy.calls
        res = req.wait(timeout=60)
        wakes.append(proxy.blocking - b0)
        inwait.append(proxy.calls - c1)
        done = getattr(res, "completed_ns", 0) or made[k]
        early += k >= args.warmup and bool(getattr(res, "early", False))
        posted.append(t_post)
        delays_of[k] = done
    _engine.lib = proxy._lib
    coll.close()
    every_post = comm.allgather(posted)
    sources = list(coll.sources)
    w = args.warmup
    delays = [(delays_of[k] - max(every_post[s][k] for s in sources)) * 1e-6 for k in range(w, w + args.iterations)]
    rows = comm.gather((delays, wakes[w:], between[w:], early, inwait[w:]), root=0)
    if comm.rank == 0:
        d = np.array([v for r in rows for v in r[0]])
        wk = np.array([v for r in rows for v in r[1]])
        bt = np.array([v for r in rows for v in r[2]])
        print(f"# NeighborAllreduce ({nb.__name__}), P = {comm.size}, ring, {args.count * 4} B updates, "
              f"{args.compute_ms} ms compute after each post, {args.iterations} iterations x {comm.size} ranks")
        print(f"  delay (ms): median {np.median(d):.2f}, p90 {np.percentile(d, 90):.2f}, max {d.max():.2f}")
        print(f"  wake-ups in wait() per iteration: mean {wk.mean():.2f}, max {wk.max()}")
        cw = np.array([v for r in rows for v in r[4]])
        print(f"  engine calls inside wait() per iteration: mean {cw.mean():.2f}, max {cw.max()}")
        print(f"  engine calls between post and wait: {bt.max()}")
        print(f"  iterations complete before wait(): {sum(r[3] for r in rows)} of {len(d)}")
    g.Free()


if __name__ == "__main__":
    main()
