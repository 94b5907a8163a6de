"""Engine microbenchmarks. Run: mpiexec -n 2 python bench/engine.py

(a) round trip of a 2-op persistent schedule (send + recv, 8 bytes) at P = 2, as a
    ratio to an mpi4py Send/Recv ping-pong measured in the same run;
(b) CPU time of a rank whose engine is running but idle for 5 s (a solo allreduce
    waiting for activation: its receives are posted and polled);
(c) per-op overhead of the engine for a 1000-op chain of nops (COMM_SELF).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc


def pingpong_mpi(comm, iters):
    buf = np.zeros(1, np.float64)
    peer = 1 - comm.rank
    comm.Barrier()
    t = MPI.Wtime()
    for _ in range(iters):
        if comm.rank == 0:
            comm.Send(buf, peer)
            comm.Recv(buf, peer)
        else:
            comm.Recv(buf, peer)
            comm.Send(buf, peer)
    return (MPI.Wtime() - t) / iters


def pingpong_schedule(comm, iters):
    buf = np.zeros(1, np.float64)
    peer = 1 - comm.rank
    s = pc.Schedule(comm)
    if comm.rank == 0:
        s.recv(buf, peer, after=s.send(buf, peer))
    else:
        s.send(buf, peer, after=s.recv(buf, peer))
    s.commit(persistent=True)
    for _ in range(100):
        s.start().wait()
    comm.Barrier()
    t = MPI.Wtime()
    for _ in range(iters):
        s.start().wait()
    dt = (MPI.Wtime() - t) / iters
    s.free()
    return dt


def idle_cpu(comm, seconds):
    coll = pc.solo_allreduce(1, np.float64, MPI.SUM, comm)   # armed: activation receives in flight
    comm.Barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    frac = (time.process_time() - c0) / (time.perf_counter() - t0)
    comm.Barrier()
    coll.close()
    return frac


def nop_chain(n, iters):
    s = pc.Schedule(MPI.COMM_SELF)
    last = None
    for _ in range(n):
        last = s.nop(after=last)
    s.commit()
    for _ in range(10):
        s.start().wait()
    t = time.perf_counter()
    for _ in range(iters):
        s.start().wait()
    dt = (time.perf_counter() - t) / iters
    s.free()
    return dt / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run with mpiexec -n 2")
    out = {"progress": pc.rc.progress}
    # interleave the two ping-pongs a few times; report the medians
    mpi, sched = [], []
    for _ in range(3):
        mpi.append(pingpong_mpi(comm, args.iters))
        sched.append(pingpong_schedule(comm, args.iters))
    out["pingpong_mpi_us"] = float(np.median(mpi)) * 1e6
    out["pingpong_schedule_us"] = float(np.median(sched)) * 1e6
    out["pingpong_ratio"] = out["pingpong_schedule_us"] / out["pingpong_mpi_us"]
    out["idle_cpu_fraction"] = comm.allreduce(idle_cpu(comm, args.idle_seconds), op=MPI.MAX)
    out["nop_ns_per_op"] = nop_chain(1000, 2000) * 1e9
    if comm.rank == 0:
        print(f"# partialcoll {pc.__version__}, {pc.info()['mpi_library']}, P=2, progress={pc.rc.progress}")
        print(f"(a) round trip, 8 B:  schedule {out['pingpong_schedule_us']:.2f} us, "
              f"mpi4py Send/Recv {out['pingpong_mpi_us']:.2f} us, ratio {out['pingpong_ratio']:.2f}")
        print(f"(b) idle engine for {args.idle_seconds:g} s: {out['idle_cpu_fraction'] * 100:.2f} % of one core "
              f"(max over ranks)")
        print(f"(c) 1000-op nop chain: {out['nop_ns_per_op']:.1f} ns per op")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
