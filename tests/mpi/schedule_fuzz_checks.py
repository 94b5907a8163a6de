"""Random schedules against their sequential meaning: python schedule_fuzz_checks.py [CASES]

Each case is a random program drawn on rank 0 (seeded: the same cases every run) and
broadcast: a sequence of global steps, each a message (a send on one rank, its receive
on another; sizes from 0 to 70000 int64, so MPI's eager and rendezvous paths), a
compute (a rank adds a message it received into one of its accumulators) or a gate (a
NOP on one rank that needs all, any or k of some of its earlier ops). Every op depends
on earlier ops of its rank only: its data's producers (need "all": the receive a
compute reads; the computes and sends an accumulator's earlier writes and reads order)
plus, at random, a gate. So no cycle can form, every message is matched in the order
both ranks issue it, and whatever the gates let run early, the data are those of
running the steps one after the other: which each rank checks, bit for bit, for every
buffer, after each of three executions of the persistent schedule.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from _util import ARGS, run_module

CASES = int(ARGS[0]) if ARGS else 40
SIZES = [0, 1, 7, 300, 70000]
ACCS = 2


def draw(rng: np.random.Generator, p: int) -> list:
    """The steps of one program: ("msg", src, dst, size, what) with what -1 (the
    sender's own buffer) or an accumulator; ("add", rank, acc, msg); ("gate", rank,
    need, how many earlier ops)."""
    steps, received = [], {r: [] for r in range(p)}       # per rank: messages it received
    for _ in range(int(rng.integers(4, 40))):
        kind = rng.choice(["msg", "msg", "add", "gate"]) if p > 1 else rng.choice(["add", "gate"])
        if kind == "msg":
            src, dst = (int(v) for v in rng.choice(p, 2, replace=False))
            size = int(rng.choice(SIZES))
            steps.append(("msg", src, dst, size, int(rng.integers(-1, ACCS)), len(steps)))
            received[dst].append(len(steps) - 1)
        elif kind == "add":
            r = int(rng.integers(p))
            if received[r]:
                steps.append(("add", r, int(rng.integers(ACCS)), int(rng.choice(received[r]))))
        else:
            steps.append(("gate", int(rng.integers(p)), str(rng.choice(["all", "any", "k"])),
                          int(rng.integers(1, 5))))
    return steps


def expected(steps: list, p: int, rank: int, size_of_acc: int) -> dict:
    """Every buffer of `rank` after running the steps one after the other."""
    own = [np.arange(size_of_acc, dtype=np.int64) * (r + 1) + 1000 * r for r in range(p)]
    accs = [[np.zeros(size_of_acc, np.int64) for _ in range(ACCS)] for _ in range(p)]
    got = {}
    for i, st in enumerate(steps):
        if st[0] == "msg":
            _, src, dst, size, what, _ = st
            payload = own[src] if what < 0 else accs[src][what]
            got[i] = payload[:size].copy()
        elif st[0] == "add":
            _, r, acc, msg = st
            n = steps[msg][3]
            accs[r][acc][:n] += got[msg]
    return {"accs": accs[rank], "recv": {i: v for i, v in got.items() if steps[i][2] == rank}}


def build(comm, steps: list, size_of_acc: int, rng: np.random.Generator):
    """This rank's schedule of the steps, and its buffers."""
    r = comm.rank
    own = np.arange(size_of_acc, dtype=np.int64) * (r + 1) + 1000 * r
    accs = [np.zeros(size_of_acc, np.int64) for _ in range(ACCS)]
    recv = {i: np.full(st[3], -1, np.int64) for i, st in enumerate(steps) if st[0] == "msg" and st[2] == r}
    s = pc.Schedule(comm)
    mine: list = []                              # this rank's ops so far
    ops_of: dict = {}                            # step -> this rank's op
    writes = {a: None for a in range(ACCS)}      # the last compute into each accumulator
    reads = {a: [] for a in range(ACCS)}         # the sends of it since

    def gated(deps):
        if mine and rng.random() < 0.3:          # and a gate, at random
            return deps + [mine[int(rng.integers(len(mine)))]]
        return deps

    for i, st in enumerate(steps):
        if st[0] == "msg":
            _, src, dst, size, what, _ = st
            if src == r:
                buf = own[:size] if what < 0 else accs[what][:size]
                deps = [] if what < 0 or writes[what] is None else [writes[what]]
                op = s.send(buf, dst, after=gated(deps) or None, label=f"step {i}")
                if what >= 0:
                    reads[what].append(op)
            elif dst == r:
                op = s.recv(recv[i], src, after=gated([]) or None, label=f"step {i}")
            else:
                continue
        elif st[0] == "add":
            _, rank, acc, msg = st
            if rank != r:
                continue
            n = steps[msg][3]
            deps = [ops_of[msg]] + ([writes[acc]] if writes[acc] is not None else []) + reads[acc]
            op = s.compute(MPI.SUM, recv[msg], accs[acc][:n], out=accs[acc][:n], after=gated(deps),
                           label=f"step {i}")
            writes[acc], reads[acc] = op, []
        else:
            _, rank, need, k = st
            if rank != r or not mine:
                continue
            earlier = [mine[int(j)] for j in rng.choice(len(mine), min(k, len(mine)), replace=False)]
            want = {"all": "all", "any": "any", "k": max(1, len(earlier) - 1)}[need]
            op = s.nop(after=earlier, need=want, label=f"step {i}")
        ops_of[i] = op
        mine.append(op)
    return s, accs, recv


def test_random_schedules_match_their_sequential_meaning(comm):
    p = comm.size
    for case in range(CASES):
        seed = comm.bcast(int(np.random.default_rng(case).integers(2 ** 31)) if comm.rank == 0 else None)
        steps = draw(np.random.default_rng(seed), p)
        size_of_acc = max(SIZES)
        want = expected(steps, p, comm.rank, size_of_acc)
        s, accs, recv = build(comm, steps, size_of_acc, np.random.default_rng([seed, comm.rank]))
        with s.commit(persistent=True):
            for execution in range(3):
                for a in accs:
                    a[:] = 0
                for v in recv.values():
                    v[:] = -1
                s.start().wait(timeout=60)
                what = f"case {case} (seed {seed}, execution {execution}, rank {comm.rank}): {steps}"
                for a, w in zip(accs, want["accs"]):
                    assert np.array_equal(a, w), what
                for i, v in recv.items():
                    assert np.array_equal(v, want["recv"][i]), (i, what)


if __name__ == "__main__":
    run_module(__file__)
