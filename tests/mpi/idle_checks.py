"""A rank whose round is armed must not take a core from a rank that computes (found
across emulated hosts), nor spend one on a late peer: python idle_checks.py

Under `pytest --hosts` each emulated host runs one rank, so MPI sees a node with a core
for the rank and one for its progress thread, and the idle policy "auto" picked "spin".
But the hosts share this machine's cores: the spinning progress threads took the cores
of the ranks that had to compute or answer (Fig. 9 across 4 hosts on 2 cores: MPI/solo
1.0x with auto, 11x with sleep). Auto now spins only while the machine has no more
runnable threads than cores (native/progress.c, auto_poll_ok).

The check: rank 0 computes (pure Python) for a second while the others sleep, first with
no collective, then with every rank's next round armed (its receives posted, nobody
posting). Rank 0's application thread must get at least 3/4 of the CPU it got the first
time (the mean of two windows), whatever the policy chose.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _util import run_module

WINDOW_S = 1.0


def share_of_a_core(comm) -> float:
    """Rank 0 computes for WINDOW_S while the others sleep; its thread's CPU / wall time."""
    comm.Barrier()
    if comm.rank != 0:
        time.sleep(WINDOW_S)
        share = 0.0
    else:
        c0, t0 = time.thread_time(), time.perf_counter()
        while time.perf_counter() - t0 < WINDOW_S:
            sum(range(2000))
        share = (time.thread_time() - c0) / (time.perf_counter() - t0)
    comm.Barrier()
    return comm.bcast(share, root=0)


def test_armed_ranks_leave_the_cores_to_a_computing_rank(comm):
    alone = share_of_a_core(comm)
    coll = pc.PartialAllreduce(2, np.float32, MPI.SUM, comm, mode="solo", late="fold")
    coll.post(np.ones(2, np.float32)).wait(timeout=60)        # the next round is armed now
    armed = [share_of_a_core(comm) for _ in range(2)]
    policy = comm.allgather((pc.info()["idle"], pc.info()["ranks_on_node"], pc.info()["idle_reason"]))
    coll.close(timeout=60)
    # The policy itself, against what this rank sees: the ranks on its node (MPI's shared-
    # memory split) and the CPUs it may run on. "auto" with fewer than two CPUs per rank
    # (an application and a progress thread each) must not poll (a forced "spin" would).
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    on_node = node.size
    node.Free()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert all(ranks == on_node for _, ranks, _ in policy), (on_node, policy)
    if 2 * on_node > cpus:
        assert all(idle == "sleep" for idle, _, _ in policy), \
            f"{on_node} ranks on {cpus} CPUs, yet the idle policy polls: {policy}"
    # Whatever the policy chose, the armed ranks leave rank 0 its CPU: where the node has
    # two CPUs per rank they poll on spare ones, elsewhere they sleep. Both windows count.
    mean = sum(armed) / len(armed)
    assert mean >= 0.75 * alone, \
        f"rank 0 computed on {armed} of a core with the others armed, {alone:.2f} without; " \
        f"idle policy, ranks seen on the node and why, per rank: {policy}"


LATE_S = 0.15


def waiting_cpu_ms(comm, count: int, reps: int = 3) -> float:
    """Rank 0's CPU (all threads, ms; the median of reps) over a full round of count
    float32 that it posts and waits in while the other ranks post LATE_S later; before,
    eight rounds in which every rank posts at once (what the engine learns the moving
    transfers from)."""
    x = np.ones(count, np.float32)
    coll = pc.PartialAllreduce(count, np.float32, MPI.SUM, comm, mode="full")
    for _ in range(8):
        comm.Barrier()
        coll.post(x).wait(timeout=60)
    spent = []
    for _ in range(reps):
        comm.Barrier()
        if comm.rank == 0:
            c0 = time.process_time()
            res = coll.post(x).wait(timeout=60)
            spent.append((time.process_time() - c0) * 1e3)
        else:
            time.sleep(LATE_S)
            res = coll.post(x).wait(timeout=60)
        assert np.all(res.data == comm.size), "the round is wrong"
    coll.close(timeout=60)
    return comm.bcast(sorted(spent)[len(spent) // 2] if spent else 0.0, root=0)


def test_a_late_peer_is_not_waited_for_yielding(comm):
    """A message of busy_bytes or more keeps the engine yielding instead of sleeping, since
    a large transfer needs polling while it moves: but only a few times as long as the
    balanced rounds' large messages took to show progress, not busy_cap_us (10 ms) after
    every post. A rank whose 1 MiB round waits LATE_S for its peers spends no more than
    half of busy_cap_us more CPU than one whose 8 B round waits as long (it was the whole
    busy_cap_us: a core yielded through for nothing at every late peer); that CPU holds
    the round's own work too (a 1 MiB copy and reduction: about 1 ms)."""
    if comm.size == 1:
        pytest.skip("needs a late peer: P >= 2")
    small, large = waiting_cpu_ms(comm, 2), waiting_cpu_ms(comm, 1 << 18)
    extra, limit = large - small, 0.5 * pc.rc.busy_cap_us / 1e3
    assert extra < limit, \
        f"waiting {LATE_S * 1e3:.0f} ms with a 1 MiB round took {large:.1f} ms of CPU, with 8 B {small:.1f} ms: " \
        f"{extra:.1f} ms more (at most {limit:.1f}); idle {pc.info()['idle']}, busy bound " \
        f"{pc.info()['busy_bound_us']:.0f} us"


if __name__ == "__main__":
    run_module(__file__)
