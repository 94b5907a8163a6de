"""Scale beyond one node: the schedules at P = 64 .. 4096, simulated, and an alpha-beta model.

    python bench/scale.py table                       # every algorithm, P = 64, 256, 1024, 4096
    python bench/scale.py hops                        # the activation's hop count per mode
    python bench/scale.py auto                        # what "auto" picks, against the bounds
    flock /tmp/pc-cpu.lock timeout 600 mpiexec -n 2 python bench/scale.py measure --json m2.json
    python bench/scale.py model m2.json m4.json m8.json   # fit, check, predict P = 1024

table. Every algorithm registered in partialcoll.algorithms.ALGORITHMS (new ones appear by
themselves; the tree gets regions of --ppn ranks, one per node) is built dry, as the
collective builds it, for a vector of --bytes float32: per rank, the data messages and
bytes it sends in one round, the schedule's ops and dependency edges, and its scratch
memory; and, by running the schedules in the event simulator below with unit-cost
messages, the round's steps: the longest chain of messages on the critical path.

How P = 4096 stays cheap. Counts come from a sample of ranks (every rank up to
--all-ranks, else the first node, the middle, the last ranks and a seeded random few;
the table says which). Steps need the whole graph: up to --max-nodes ops in all ranks
(and a minute of building every rank's schedule) it is run whole; above that the
schedule family is checked to be *rank-symmetric*
(rank r's schedule is rank 0's with every peer x renamed g_r(x), for g_r a rotation
x -> x + r mod P, or x -> x XOR r where P is a power of two; checked op by op on the
sampled ranks), and then rank 0 alone stands for everyone: the k-th message rank 0
receives from q is the image of the k-th message rank 0 sends to g_q^-1(0), sent at the
same time. Ring and recursive doubling are symmetric. The tree is not (the aggregator
moves with the region), so above the limit its steps are composed: 2 per level (reduce,
broadcast) plus the steps of the top allreduce among the aggregators, itself simulated;
the composition is checked against the whole-graph simulation where both run.

The event simulator (simulate()) runs the dry schedules of all ranks (or rank 0 and its
symmetry) in time order: an op fires when `need` of its dependencies completed (k of n,
as the engine); a send occupies its rank's out-port for n*beta and reaches the receiver
alpha later, where the in-port takes another message only after the previous one
(single-port, full-duplex); a compute occupies its rank's CPU for n*gamma; every
send/recv/compute costs o on top. alpha = 1, the rest 0: the number of message steps.

The model (see docs/scaling.md for the formulas): alpha, beta from a ping-pong, gamma and
the engine's per-round cost from one-rank schedules, all measured by `measure`; `model`
compares its predictions with full-mode rounds measured in the same runs (P = 2, 4, 8)
and predicts solo/majority/probe rounds at P = 1024 on a 25 Gb/s, 5 us network.
"""
from __future__ import annotations

import argparse
import heapq
import inspect
import json
import math
import os
import random
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from partialcoll._buffers import SLOT_WORK, BufRef
from partialcoll.activation import BUILDERS, quorum, quorum_network
from partialcoll.algorithms import ALGORITHMS, choose, model
from partialcoll.bench.calibrate import median_time as _median_time
from partialcoll.schedule import COMPUTE, RECV, SEND, TRIGGER, Schedule

SIZES = (64, 256, 1024, 4096)
BUILD_SECONDS = 60.0                 # at most this long building every rank's schedule
SUM = 0                              # the engine's op code of MPI_SUM
MODES = ("solo", "majority", "probe", "quorum", "full")


# -- building ------------------------------------------------------------------------
def takes(name: str, keyword: str) -> bool:
    """Whether the registered builder `name` takes keyword= (the tree's groups=, ...)."""
    return keyword in inspect.signature(ALGORITHMS[name]).parameters


def regions(p: int, ppn: int) -> List[int]:
    """One region per node of ppn consecutive ranks (what host_groups finds under mpiexec)."""
    return [r // ppn for r in range(p)]


def build(name: str, rank: int, p: int, nbytes: int, ppn: int) -> Schedule:
    """Rank's dry schedule of one allreduce of nbytes of float32 by algorithm `name`."""
    s = Schedule(rank=rank, size=p)
    kw = {"groups": [regions(p, ppn)]} if takes(name, "groups") and ppn > 1 else {}
    ALGORITHMS[name](s, BufRef.slot_ref(SLOT_WORK, nbytes // 4, np.float32), SUM, **kw)
    return s


def census(s: Schedule) -> dict:
    """One rank's round: data messages and bytes sent, empty (control) messages, ops, edges, scratch."""
    sends = [op for op in s.ops if op.kind == SEND]
    data = [op.bufs[0].nbytes for op in sends if op.bufs[0].nbytes > 0]
    return {"messages": len(data), "bytes": sum(data), "control": len(sends) - len(data), "ops": len(s.ops),
            "edges": sum(len(op.deps) for op in s.ops), "scratch": s.scratch_bytes}


def sample_ranks(p: int, ppn: int, all_ranks: int, seed: int = 0) -> List[int]:
    """Every rank up to all_ranks; else the first node, the middle, the last two nodes' ends
    and 8 seeded random ranks."""
    if p <= all_ranks:
        return list(range(p))
    some = set(range(min(ppn, p))) | {p // 2, p // 2 + 1, p - 2, p - 1, p - ppn}
    some |= set(random.Random(seed).sample(range(p), min(8, p)))
    return sorted(r for r in some if 0 <= r < p)


# -- the event simulator ---------------------------------------------------------------
class Graph:
    """The ops of several ranks' schedules as one graph: kind, bytes, need, successors, the
    rank whose ports and CPU an op uses, and each message's other end (send <-> recv)."""

    def __init__(self) -> None:
        self.kind: List[int] = []
        self.nbytes: List[int] = []
        self.need: List[int] = []
        self.succ: List[List[int]] = []
        self.rank: List[int] = []
        self.peer_op: List[int] = []        # send -> its recv, recv -> its send (-1: none)
        self.first: List[int] = []          # rank i's ops are first[i] .. first[i] + len - 1

    def _add(self, s: Schedule, rank: int) -> int:
        base = len(self.kind)
        self.first.append(base)
        for op in s.ops:
            self.kind.append(op.kind)
            self.nbytes.append(op.bufs[0].nbytes if op.bufs else 0)
            self.need.append(op.need)
            self.succ.append([])
            self.rank.append(rank)
            self.peer_op.append(-1)
        for op in s.ops:
            for d in op.deps:
                self.succ[base + d].append(base + op.index)
        return base

    @classmethod
    def whole(cls, scheds: Sequence[Schedule]) -> "Graph":
        """Every rank: the k-th message from a to b is a's k-th send to b and b's k-th receive
        from a (creation order, as the engine's tags match them)."""
        g = cls()
        sends: Dict[Tuple[int, int], List[int]] = {}
        recvs: Dict[Tuple[int, int], List[int]] = {}
        for r, s in enumerate(scheds):
            base = g._add(s, r)
            for op in s.ops:
                if op.kind == SEND:
                    sends.setdefault((r, op.peer), []).append(base + op.index)
                elif op.kind == RECV:
                    recvs.setdefault((op.peer, r), []).append(base + op.index)
        for pair, ss in sends.items():
            for a, b in zip(ss, recvs.get(pair, ())):
                g.peer_op[a], g.peer_op[b] = b, a
        return g

    @classmethod
    def symmetric(cls, s0: Schedule, inverse: Callable[[int], int]) -> "Graph":
        """Rank 0 standing for every rank of a rank-symmetric family: its k-th receive from q
        mirrors its own k-th send to inverse(q) = g_q^-1(0)."""
        g = cls()
        g._add(s0, 0)
        sends: Dict[int, List[int]] = {}
        recvs: Dict[int, List[int]] = {}
        for op in s0.ops:
            if op.kind == SEND:
                sends.setdefault(op.peer, []).append(op.index)
            elif op.kind == RECV:
                recvs.setdefault(op.peer, []).append(op.index)
        for q, rs in recvs.items():
            for a, b in zip(sends.get(inverse(q), ()), rs):
                g.peer_op[a], g.peer_op[b] = b, a
        return g


def simulate(g: Graph, alpha: float = 1.0, beta: float = 0.0, gamma: float = 0.0, o: float = 0.0,
             starts: Optional[Sequence[int]] = None) -> List[float]:
    """Completion time of every op (nan: never fired). Ops without dependencies fire at 0,
    except triggers: only those in `starts` (a post) fire, at 0."""
    n = len(g.kind)
    got = [0] * n
    done = [math.nan] * n
    posted = [math.nan] * n           # recv: when its own dependencies were met
    arrival = [math.nan] * n          # recv: when its message is in
    out_free: Dict[int, float] = {}
    in_free: Dict[int, float] = {}
    cpu_free: Dict[int, float] = {}
    heap: List[Tuple[float, int, int]] = []   # (time, order, op): op's dependencies are met
    order = 0
    start_set = set(starts or ())
    for i in range(n):
        if (g.kind[i] == TRIGGER and i in start_set) or (g.kind[i] != TRIGGER and g.need[i] == 0):
            heap.append((0.0, order, i))
            order += 1
    heapq.heapify(heap)

    def complete(i: int, t: float) -> None:
        nonlocal order
        heapq.heappush(heap, (t, order, ~i))  # ~i: a completion (propagated in time order)
        order += 1

    while heap:
        t, _, i = heapq.heappop(heap)
        if i < 0:                             # op ~i completes at t
            i = ~i
            if not math.isnan(done[i]):
                continue
            done[i] = t
            for j in g.succ[i]:
                got[j] += 1
                if got[j] == g.need[j] and g.kind[j] != TRIGGER:
                    heapq.heappush(heap, (t, order, j))
                    order += 1
            continue
        kind, r, nb = g.kind[i], g.rank[i], g.nbytes[i]
        if kind == SEND:
            begin = max(t, out_free.get(r, 0.0))
            out_free[r] = begin + nb * beta
            complete(i, begin + nb * beta + o)
            j = g.peer_op[i]
            if j >= 0:
                rr = g.rank[j]
                inb = max(begin + alpha, in_free.get(rr, 0.0))
                in_free[rr] = arrival[j] = inb + nb * beta
                if not math.isnan(posted[j]):
                    complete(j, max(posted[j], arrival[j]) + o)
        elif kind == RECV:
            posted[i] = t
            if not math.isnan(arrival[i]):
                complete(i, max(t, arrival[i]) + o)
        elif kind == COMPUTE:
            begin = max(t, cpu_free.get(r, 0.0))
            cpu_free[r] = begin + nb * gamma + o
            complete(i, cpu_free[r])
        else:                                 # nop, trigger, take, deliver
            complete(i, t)
    return done


def steps(g: Graph) -> int:
    """Messages on the critical path (alpha = 1, nothing else costs)."""
    done = [t for t in simulate(g) if not math.isnan(t)]
    return int(round(max(done, default=0.0)))


# -- symmetry ----------------------------------------------------------------------------
def symmetry_of(s0: Schedule, others: Dict[int, Schedule], p: int) -> Optional[str]:
    """'rotation' or 'xor' if every schedule in others is s0 with peers renamed by that
    map (op by op: kind, need, dependencies, bytes), else None."""
    maps = {"rotation": lambda r, x: (x + r) % p}
    if p & (p - 1) == 0:
        maps["xor"] = lambda r, x: x ^ r
    for name, g in maps.items():
        if all(_renamed(s0, s, lambda x, r=r: g(r, x)) for r, s in others.items() if r != 0):
            return name
    return None


def _renamed(a: Schedule, b: Schedule, rename: Callable[[int], int]) -> bool:
    if len(a.ops) != len(b.ops):
        return False
    for x, y in zip(a.ops, b.ops):
        if (x.kind, x.need, x.deps) != (y.kind, y.need, y.deps):
            return False
        if (x.bufs[0].nbytes if x.bufs else 0) != (y.bufs[0].nbytes if y.bufs else 0):
            return False
        if x.peer >= 0 and rename(x.peer) != y.peer:
            return False
    return True


def inverse_of(kind: str, p: int) -> Callable[[int], int]:
    """q -> g_q^-1(0): the rank that rank 0's k-th send goes to, mirroring q's k-th send to 0."""
    return (lambda q: (-q) % p) if kind == "rotation" else (lambda q: q)


# -- the table ----------------------------------------------------------------------------
class Family:
    """One algorithm at one P: the sampled ranks' schedules, and its simulation graph."""

    def __init__(self, name: str, p: int, nbytes: int, ppn: int, all_ranks: int, max_nodes: int) -> None:
        self.name, self.p, self.nbytes, self.ppn, self.max_nodes = name, p, nbytes, ppn, max(max_nodes, 1_500_000)
        self.ranks = sample_ranks(p, ppn, all_ranks)
        t0 = time.perf_counter()
        self.scheds = {r: build(name, r, p, nbytes, ppn) for r in self.ranks}
        per_build = (time.perf_counter() - t0) / len(self.ranks)
        per_rank = max(len(s.ops) for s in self.scheds.values())
        self.how = ""
        self.graph: Optional[Graph] = None
        # the whole graph where it is small enough and every rank builds within BUILD_SECONDS
        if p * per_rank <= max_nodes and (p - len(self.ranks)) * per_build <= BUILD_SECONDS:
            every = [self.scheds.get(r) or build(name, r, p, nbytes, ppn) for r in range(p)]
            self.graph, self.how = Graph.whole(every), "whole"
        else:
            kind = symmetry_of(self.scheds[0], self.scheds, p)
            if kind:
                self.graph, self.how = Graph.symmetric(self.scheds[0], inverse_of(kind, p)), f"symmetric ({kind})"

    def counts(self) -> dict:
        rows = [census(s) for s in self.scheds.values()]
        out = {"ranks": len(rows), "sampled": len(rows) < self.p}
        for key in rows[0]:
            vals = [row[key] for row in rows]
            out[key + "_max"], out[key + "_mean"] = max(vals), sum(vals) / len(vals)
        return out

    def steps(self) -> Tuple[Optional[int], str]:
        if self.graph is not None:
            return steps(self.graph), self.how
        if self.name == "tree" or takes(self.name, "groups"):
            return tree_steps(self.p, self.nbytes, self.ppn, self.max_nodes), "composed"
        return None, "not simulated (over --max-nodes, not rank-symmetric)"


def tree_steps(p: int, nbytes: int, ppn: int, max_nodes: int = 1_500_000) -> int:
    """The tree with one level of regions: reduce (1 step), the top allreduce among the
    p / ppn aggregators of a chunk (simulated, by symmetry), broadcast (1 step)."""
    from partialcoll.algorithms import tree
    levels = tree.normalize_groups([regions(p, ppn)], p)
    chunks = tree.default_chunks(nbytes // 4, 4, levels)
    top_p = len(set(levels[0]))
    chunk = nbytes // chunks
    top = choose("auto", chunk, top_p)
    if top_p == 1:
        return 2
    return 2 + Family(top, top_p, chunk, 1, 0, max_nodes).steps()[0]


def table(sizes: Sequence[int], nbytes: int, ppn: int, all_ranks: int, max_nodes: int,
          algorithms: Optional[Sequence[str]] = None) -> List[dict]:
    rows = []
    for name in algorithms or sorted(ALGORITHMS):
        for p in sizes:
            t0 = time.perf_counter()
            try:
                fam = Family(name, p, nbytes, ppn, all_ranks, max_nodes)
                row = {"algorithm": name, "P": p, **fam.counts()}
                row["steps"], row["steps_how"] = fam.steps()
            except Exception as exc:  # noqa: BLE001 - a new algorithm that cannot be built dry here
                row = {"algorithm": name, "P": p, "error": f"{type(exc).__name__}: {exc}"}
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(_table_line(row), flush=True)
    return rows


def _size(x: float) -> str:
    """Bytes as B, KiB or MiB."""
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if x >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f} B"


def _table_header(nbytes: int, ppn: int) -> str:
    return (f"# one allreduce of {_size(nbytes)} of float32 per round; tree: regions of {ppn} ranks (nodes)\n"
            f"# {'algorithm':<18} {'P':>5} {'msgs/rank':>11} {'sent/rank':>21} {'steps':>6} "
            f"{'ops/rank':>13} {'edges/rank':>13} {'scratch/rank':>19}  how (ranks counted)")


def _table_line(row: dict) -> str:
    if "error" in row:
        return f"  {row['algorithm']:<18} {row['P']:>5}  {row['error']}"
    def mm(key: str, fmt=lambda v: f"{v:.0f}") -> str:
        lo, hi = row[key + "_mean"], row[key + "_max"]
        return fmt(hi) if abs(hi - lo) < 1e-9 else f"{fmt(lo)}/{fmt(hi)}"
    steps_text = "-" if row["steps"] is None else str(row["steps"])
    return (f"  {row['algorithm']:<18} {row['P']:>5} {mm('messages'):>11} {mm('bytes', _size):>21} "
            f"{steps_text:>6} {mm('ops'):>13} {mm('edges'):>13} {mm('scratch', _size):>19}  "
            f"{row['steps_how']} ({row['ranks']}{' sampled' if row['sampled'] else ''})")


# -- "auto" against the bounds --------------------------------------------------------------
AUTO_BYTES = (8, 64 << 10, 1 << 20, 25 << 20, 256 << 20)


def network(q: Optional[model.Params] = None) -> model.Params:
    """NETWORK's links between nodes (one rank per node), the engine's gamma and o from q
    (default: the model's defaults)."""
    q = q or model.DEFAULTS
    return q._replace(alpha=NETWORK["alpha"], beta=NETWORK["beta"], alpha_node=NETWORK["alpha"],
                      beta_node=NETWORK["beta"], source="network")


def auto_row(p: int, nbytes: int, q: model.Params, ppn: int = 1) -> dict:
    """What "auto" picks at (P, bytes) one rank per node, its predicted time against the
    alpha-beta lower bound and MPICH's model, a partial round's time (the data's, plus the
    flood's ceil(log2 P) hops of alpha + o), and, counted on the chosen algorithm's
    dry-built schedules (sampled ranks), the data messages and bytes a rank sends."""
    name, _ = model.best(p, nbytes, ppn, q)
    t, bound, mpi = model.predict(name, p, nbytes, ppn, q), model.lower_bound(p, nbytes, q), \
        model.predict("mpi", p, nbytes, ppn, q)
    lg = math.ceil(math.log2(p))
    rows = [census(build(name, r, p, nbytes, 1)) for r in sorted({0, 1, p // 2 + 1, p - 1})]
    return {"P": p, "bytes": nbytes, "algorithm": name, "predicted_us": t * 1e6, "bound_us": bound * 1e6,
            "over_bound": t / bound, "mpi_us": mpi * 1e6, "over_mpi": t / mpi,
            "round_us": (t + lg * (q.alpha + q.o)) * 1e6,
            "messages_max": max(r["messages"] for r in rows), "messages_limit": 2 * lg + 4,
            "bytes_max": max(r["bytes"] for r in rows), "bytes_optimal": 2 * (p - 1) / p * nbytes}


def auto_table(sizes: Sequence[int], byte_list: Sequence[int], q: model.Params) -> List[dict]:
    print(f"# auto, one rank per node: {q.describe()}")
    print(f"# {'P':>5} {'bytes':>10} {'algorithm':<18} {'predicted us':>13} {'bound us':>11} {'x bound':>8} "
          f"{'MPICH us':>11} {'x MPICH':>8} {'round us':>11} {'msgs/rank':>9} {'limit':>6} {'x 2(P-1)n/P':>11}")
    rows = []
    for p in sizes:
        for nbytes in byte_list:
            r = auto_row(p, nbytes, q)
            rows.append(r)
            print(f"  {p:>5} {nbytes:>10} {r['algorithm']:<18} {r['predicted_us']:>13.1f} {r['bound_us']:>11.1f} "
                  f"{r['over_bound']:>8.3f} {r['mpi_us']:>11.1f} {r['over_mpi']:>8.3f} {r['round_us']:>11.1f} "
                  f"{r['messages_max']:>9} {r['messages_limit']:>6} {r['bytes_max'] / r['bytes_optimal']:>11.3f}",
                  flush=True)
    return rows


# -- the activation ---------------------------------------------------------------------
# quorum as the model chooses it, and each of its two builders on its own
QUORUM_BUILDERS = {"quorum": BUILDERS["quorum"], "q-leader": quorum.activation, "q-network": quorum_network.activation}


def activation_hops(p: int, mode: str, seed: int = 0, quorum: Optional[int] = None) -> dict:
    """Round 0's activation at every rank, from the posts that start it: hops (message
    steps) until each rank is activated, and activation messages per rank.

    solo: the worst initiator (every rank is tried where P is not a power of two; where it
    is, the hypercube looks the same from every rank and rank 0 stands for all); majority:
    the designated rank candidates(seed, 0, p, 1); probe: the first of candidates(seed, 0,
    p, 2); quorum(k = p/2): ranks 0..k-1 post at once; full: no activation (every rank's
    own post). The simulator fires only those triggers."""
    from partialcoll.activation.candidates import candidates
    if mode == "full":
        return {"mode": mode, "P": p, "hops_max": 0, "hops_mean": 0.0, "sent_max": 0, "received_max": 0,
                "initiators": "every rank's own post"}
    k = quorum or max(1, p // 2)
    scheds, active, triggers = [], [], []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        trig = s._trigger()               # the op the round builder starts a round with
        if mode in QUORUM_BUILDERS:
            go = QUORUM_BUILDERS[mode](s, trig, k=k)
        else:
            go = BUILDERS[mode](s, trig)
        scheds.append(s)
        active.append(go.index)
        triggers.append(trig.index)
    if mode == "solo":
        starts = [[0]] if p & (p - 1) == 0 else [[r] for r in range(p)]
    elif mode in QUORUM_BUILDERS:
        starts = [list(range(k))]
    else:
        starts = [[candidates(seed, 0, p, 1 if mode == "majority" else min(2, p))[0]]]
    g = Graph.whole(scheds)
    worst: List[float] = []
    for who in starts:
        done = simulate(g, starts=[g.first[r] + triggers[r] for r in who])
        hops = [done[g.first[r] + active[r]] for r in range(p)]
        if not worst or max(hops) > max(worst):
            worst, first = hops, who
    sent = [sum(op.kind == SEND for op in s.ops) for s in scheds]
    got = [sum(op.kind == RECV for op in s.ops) for s in scheds]
    return {"mode": mode, "P": p, "hops_max": int(max(worst)), "hops_mean": float(np.mean(worst)),
            "sent_max": max(sent), "received_max": max(got),
            "initiators": ",".join(map(str, first[:4])) + ("..." if len(first) > 4 else "")}


def hops_table(sizes: Sequence[int]) -> List[dict]:
    rows = []
    print("# activation of round 0: message steps until each rank joins (max / mean over ranks), "
          "activation messages per rank (most sent, most received)")
    print(f"# {'mode':<9} {'P':>5} {'hops max':>9} {'hops mean':>10} {'sent/rank':>10} {'recv/rank':>10}  started by")
    for p in sizes:
        for mode in MODES[:3] + tuple(QUORUM_BUILDERS) + MODES[4:]:
            row = activation_hops(p, mode)
            rows.append(row)
            print(f"  {mode:<9} {p:>5} {row['hops_max']:>9} {row['hops_mean']:>10.2f} {row['sent_max']:>10} "
                  f"{row['received_max']:>10}  {row['initiators']}", flush=True)
    return rows


# -- measurements (under mpiexec) ---------------------------------------------------------
MEASURE_SIZES = (8, 1024, 65536, 1 << 20, 16 << 20)
PINGPONG_SIZES = (8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20)


def _iters(nbytes: int, base: int) -> int:
    return max(6, min(base, base * 16384 // max(nbytes, 16384)))



def measure(comm, base_iters: int = 200) -> dict:
    """What the model takes (rank 0 and 1's ping-pong; rank 0's one-rank schedules) and what
    it is checked against (full-mode rounds of every algorithm, solo rounds, MPI_Allreduce)."""
    from mpi4py import MPI
    import partialcoll as pc
    rank, p = comm.rank, comm.size
    out = {"P": p, "cores": os.cpu_count(), "info": pc.info() if rank == 0 else None}
    # alpha, beta: half the round trip of a ping-pong between ranks 0 and 1 (mpi4py, NumPy buffers)
    pingpong = []
    if p >= 2:
        for nbytes in PINGPONG_SIZES:
            buf = np.zeros(nbytes, np.uint8)
            iters = _iters(nbytes, 4 * base_iters)

            def once():
                if rank == 0:
                    comm.Send(buf, 1)
                    comm.Recv(buf, 1)
                elif rank == 1:
                    comm.Recv(buf, 0)
                    comm.Send(buf, 0)
            comm.Barrier()
            once()
            t = _median_time(once, iters) / 2 if rank < 2 else 0.0
            pingpong.append({"bytes": nbytes, "seconds": comm.bcast(t, root=0)})
    out["pingpong"] = pingpong
    # gamma, o: rank 0's engine on one-rank schedules (COMM_SELF), while the others wait
    local = {}
    if rank == 0:
        with pc.Schedule(MPI.COMM_SELF) as s:
            s.nop()
            s.commit()
            local["empty_schedule_s"] = _median_time(lambda: s.start().wait(), base_iters * 5)
        with pc.Schedule(MPI.COMM_SELF) as s:
            last = None
            for _ in range(64):
                last = s.nop(after=last)
            s.commit()
            chain = _median_time(lambda: s.start().wait(), base_iters * 5)
        local["op_s"] = max(0.0, (chain - local["empty_schedule_s"]) / 63)
        computes = []
        for nbytes in (1 << 20, 4 << 20, 16 << 20):
            a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
            with pc.Schedule(MPI.COMM_SELF) as s:
                s.compute(MPI.SUM, a, b, out=b)
                s.commit()
                computes.append({"bytes": nbytes, "seconds": _median_time(lambda: s.start().wait(),
                                                                           _iters(nbytes, base_iters))})
        local["compute"] = computes
        with pc.PartialAllreduce(2, np.float32, MPI.SUM, MPI.COMM_SELF, mode="full") as c:
            x = np.ones(2, np.float32)
            local["round_s"] = _median_time(lambda: c.post(x).wait(), base_iters * 5)
    comm.Barrier()
    out["local"] = comm.bcast(local, root=0)
    # full-mode rounds of every algorithm (tree: regions of two ranks), solo rounds, MPI_Allreduce
    pairs = [r // 2 for r in range(p)]
    rounds = []
    for nbytes in MEASURE_SIZES:
        count = nbytes // 4
        x = np.arange(count, dtype=np.float32) % 97 + rank
        y = np.empty_like(x)
        iters = _iters(nbytes, base_iters)
        comm.Allreduce(x, y)
        expect = y.copy()
        runs = [("mpi", None)] + [(a, "full") for a in sorted(ALGORITHMS)] + [("recursive_doubling", "solo")]
        for alg, mode in runs:
            if mode is None:
                def call():
                    comm.Allreduce(x, y)
                coll = None
            else:
                kw = {"groups": pairs} if alg == "tree" else {}
                if mode == "full" and not _can_build(alg, p):
                    continue
                coll = pc.PartialAllreduce(count, np.float32, MPI.SUM, comm, mode=mode,
                                           algorithm=alg if p > 1 else "auto", **kw)
                def call(coll=coll):
                    coll.post(x, out=y).wait()
            for _ in range(3):
                call()
            if mode != "solo":
                assert np.array_equal(y, expect), f"{alg} {mode}: wrong result at {nbytes} B"
            comm.Barrier()
            mine = _median_time(call, iters)
            comm.Barrier()
            if coll is not None:
                coll.close()
            rounds.append({"algorithm": alg, "mode": mode or "mpi", "bytes": nbytes,
                           "seconds": comm.allreduce(mine) / p, "iterations": iters})
            if rank == 0:
                print(f"# P={p} {alg:<18} {mode or 'mpi':<5} {nbytes:>9} B {rounds[-1]['seconds'] * 1e6:10.1f} us",
                      flush=True)
    out["rounds"] = rounds
    return out


def _can_build(alg: str, p: int) -> bool:
    return p > 1 or alg == "recursive_doubling"


# -- the model ----------------------------------------------------------------------------
class Params(SimpleNamespace):
    """alpha (s), beta (s/B), gamma (s/B of float32 SUM), o (s per op), round (s per round)."""


def fit(m: dict) -> Params:
    """alpha, beta: least squares of t = alpha + n beta on the ping-pong, relative errors;
    gamma: the slope of the compute times; o, round: the one-rank schedules."""
    pp = m["pingpong"]
    n = np.array([r["bytes"] for r in pp], float)
    t = np.array([r["seconds"] for r in pp], float)
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([1 / t, n / t], 1), np.ones_like(t), rcond=None)
    comp = m["local"]["compute"]
    cn = np.array([r["bytes"] for r in comp], float)
    ct = np.array([r["seconds"] for r in comp], float)
    gamma = float(np.polyfit(cn, ct, 1)[0])
    return Params(alpha=float(alpha), beta=float(beta), gamma=gamma, o=m["local"]["op_s"],
                  round=m["local"]["round_s"])


def as_model(q: Params) -> model.Params:
    """q as the library model's parameters: one kind of link (the node's is the network's)."""
    return model.Params(alpha=q.alpha, beta=q.beta, gamma=q.gamma, o=q.o, alpha_node=q.alpha, beta_node=q.beta,
                        source="bench")


def formula(alg: str, p: int, n: float, q: Params, ppn: int = 2, local: Optional[Params] = None) -> float:
    """The analytic alpha-beta-gamma time of one allreduce of n bytes (docs/scaling.md):
    each step on the critical path costs alpha + bytes * beta, plus bytes * gamma where it
    reduces, plus o per receive and per reduction."""
    g, o = q.gamma, q.o
    if p == 1:
        return 0.0
    if alg in model.FLAT or alg == "mpi":     # the library's own model (one network, no nodes)
        return model.predict(alg, p, n, 1, as_model(q))
    if alg == "tree":                # local: the links inside a region (default: q's)
        k = min(ppn, p)
        regions_n = -(-p // k)
        c = n / k
        lq = local or q
        inside = 2 * lq.alpha + 2 * (k - 1) * c * lq.beta + (k - 1) * (c * g + o) + 2 * o
        top = min((formula(a, regions_n, c, q) for a in model.FLAT), default=0.0) if regions_n > 1 else 0.0
        return inside + top
    raise ValueError(f"no formula for {alg!r}")


def hops(p: int, mode: str) -> int:
    """The activation's message steps to the farthest rank: the flood from any initiator
    crosses ceil(log2 P) hypercube edges; quorum: a notification, then the binomial tree
    (as deep as the most bits set in a rank below P)."""
    if mode == "full" or p == 1:
        return 0
    if mode == "quorum":
        k = max(1, p // 2)
        net = quorum_network.depth(p, k) if quorum_network.choose(p, k) == "network" else 0
        return 1 + net + max(bin(r).count("1") for r in range(p))
    return (p - 1).bit_length()


def simulated(alg: str, p: int, n: int, q: Params, ppn: int = 2, max_nodes: int = 1_500_000) -> Optional[float]:
    """The same allreduce run in the event simulator on the real schedules (ports, CPU, o per op)."""
    if p == 1:
        return 0.0
    fam = Family(alg, p, n, ppn, 0, max_nodes)
    if fam.graph is None:
        return None
    done = [t for t in simulate(fam.graph, q.alpha, q.beta, q.gamma, q.o) if not math.isnan(t)]
    return max(done, default=0.0)


def activation_time(p: int, mode: str, q: Params) -> float:
    """The activation simulated on the real builders: when the last rank joins, with
    alpha + o per message (quorum: ranks 0..P/2-1 post; the others: rank 0)."""
    if mode == "full" or p == 1:
        return 0.0
    scheds, active, trig = [], [], []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        t = s._trigger()
        go = BUILDERS[mode](s, t, k=max(1, p // 2)) if mode == "quorum" else BUILDERS[mode](s, t)
        scheds.append(s)
        active.append(go.index)
        trig.append(t.index)
    g = Graph.whole(scheds)
    who = list(range(max(1, p // 2))) if mode == "quorum" else [0]
    done = simulate(g, q.alpha, 0.0, 0.0, q.o, starts=[g.first[r] + trig[r] for r in who])
    return max(done[g.first[r] + active[r]] for r in range(p))


def round_time(p: int, nbytes: int, mode: str, q: Params, alg: Optional[str] = None,
               how: str = "formula") -> Optional[float]:
    """One partial round: the engine's per-round cost, the activation, then the data
    allreduce beside the bitmask allreduce (recursive doubling of 2 ceil(P/64) words,
    packed into the data's messages up to 8 KiB). how: "formula" or "simulated"."""
    alg = alg or choose("auto", nbytes, p)
    mask = 16 * -(-p // 64)
    packed = alg == "recursive_doubling" and nbytes <= 8192
    n = nbytes + mask if packed else nbytes
    data = formula(alg, p, n, q) if how == "formula" else simulated(alg, p, n, q)
    if data is None:
        return None
    if not packed:
        data = max(data, formula("recursive_doubling", p, mask, q))
    kind = "quorum" if mode == "quorum" else "full" if mode == "full" else "solo"
    act = hops(p, kind) * (q.alpha + q.o) if how == "formula" else activation_time(p, kind, q)
    return q.round + act + data


def check(measurements: Sequence[dict], ref: Params) -> List[dict]:
    """Every measured round (and MPI_Allreduce) against the formula and the simulation: with
    ref's parameters, and with those fitted in the same run (same P: what the machine gives
    a message and a reduction when P ranks share its cores)."""
    rows = []
    for m in measurements:
        p = m["P"]
        own = fit(m) if m["pingpong"] else ref
        for r in m["rounds"]:
            if r["mode"] == "mpi":
                f, s, fo = (formula("mpi", p, r["bytes"], q) for q in (ref, ref, own))
            elif r["algorithm"] not in FORMULAS:     # a new algorithm: simulated only
                f = fo = math.nan
                s = round_time(p, r["bytes"], r["mode"], ref, r["algorithm"], how="simulated")
            else:
                f = round_time(p, r["bytes"], r["mode"], ref, r["algorithm"])
                s = round_time(p, r["bytes"], r["mode"], ref, r["algorithm"], how="simulated")
                fo = round_time(p, r["bytes"], r["mode"], own, r["algorithm"])
            rows.append({"P": p, "cores": m.get("cores"), "algorithm": r["algorithm"], "mode": r["mode"],
                         "bytes": r["bytes"], "measured_us": r["seconds"] * 1e6, "formula_us": f * 1e6,
                         "simulated_us": None if s is None else s * 1e6, "formula_own_us": fo * 1e6,
                         "measured_over_formula": r["seconds"] / f if f > 0 else float("nan"),
                         "measured_over_own": r["seconds"] / fo if fo > 0 else float("nan")})
    return rows


NETWORK = {"alpha": 5e-6, "beta": 8 / 25e9}          # 25 Gb/s links, 5 us latency
FORMULAS = ("recursive_doubling", "rabenseifner", "ring", "tree", "mpi")  # what formula() knows


def predict(ref: Params, p: int = 1024, sizes=(8, 1 << 20, 25 << 20), skew: str = "linear:1ms",
            iterations: int = 64) -> List[dict]:
    """solo/majority/probe rounds (and full, an allreduce's shape) at P on the network:
    its alpha and beta, this machine's gamma and engine costs; and Fig. 9's mean latency
    under the skew from those round times (fig9_latency)."""
    net = Params(alpha=NETWORK["alpha"], beta=NETWORK["beta"], gamma=ref.gamma, o=ref.o, round=ref.round)
    rows = []
    for nbytes in sizes:
        alg = choose("auto", nbytes, p)
        full = round_time(p, nbytes, "full", net, alg)
        for mode in ("solo", "majority", "probe", "full"):
            t = round_time(p, nbytes, mode, net, alg)
            s = round_time(p, nbytes, mode, net, alg, how="simulated")
            row = {"P": p, "bytes": nbytes, "algorithm": alg, "mode": mode, "round_us": t * 1e6,
                   "round_simulated_us": None if s is None else s * 1e6}
            if mode != "full":
                row.update(fig9_latency(mode, p, t, full, skew, iterations))
            rows.append(row)
    return rows


def fig9_latency(mode: str, p: int, t_round: float, t_mpi: float, skew: str, iterations: int) -> dict:
    """Fig. 9 (the paper's method: every iteration starts aligned) with a round that costs
    t_round from the initiating post to its completion everywhere, and an MPI_Allreduce
    that costs t_mpi after the last arrival: rank r's latency is max(arrive_r, start +
    t_round) - arrive_r (start: the eligible post that starts the round), MPI's is
    last arrival + t_mpi - arrive_r. Means over ranks and iterations."""
    from partialcoll.bench.skew import delays, ideal, start_rule
    d = delays(skew, p, iterations, 0)
    rule = start_rule(mode, p, 0, max(1, p // 2), 2)
    lat, mpi = [], []
    for i in range(iterations):
        eligible, k = rule(i)
        start = float(np.sort(d[i, list(eligible)])[k - 1])
        lat.append(np.maximum(d[i], start + t_round) - d[i])
        mpi.append(d[i].max() + t_mpi - d[i])
    mean, mean_mpi = float(np.mean(lat)), float(np.mean(mpi))
    ideal_s = ideal(mode, d, 0, max(1, p // 2), 2)
    return {"fig9_latency_us": mean * 1e6, "fig9_mpi_us": mean_mpi * 1e6,
            "mpi_over_mode": mean_mpi / mean if mean > 0 else float("inf"),
            "ideal_us": ideal_s * 1e6, "over_ideal": mean / ideal_s if ideal_s > 0 else float("nan")}


def print_model(measurements: Sequence[dict], out: Optional[str]) -> dict:
    ref_m = min(measurements, key=lambda m: m["P"] if m["P"] >= 2 else 99)
    ref = fit(ref_m)
    print(f"# fitted on P = {ref_m['P']} ({ref_m['cores']} cores): alpha {ref.alpha * 1e6:.2f} us, "
          f"beta {ref.beta * 1e9:.3f} ns/B ({1 / ref.beta / 1e9:.1f} GB/s), gamma {ref.gamma * 1e9:.3f} ns/B "
          f"({1 / ref.gamma / 1e9:.1f} GB/s), o {ref.o * 1e6:.2f} us per op, round {ref.round * 1e6:.1f} us")
    for m in measurements:
        if m["pingpong"] and m is not ref_m:
            q = fit(m)
            print(f"# fitted on P = {m['P']} (same run): alpha {q.alpha * 1e6:.2f} us, beta {q.beta * 1e9:.3f} ns/B, "
                  f"gamma {q.gamma * 1e9:.3f} ns/B, o {q.o * 1e6:.2f} us, round {q.round * 1e6:.1f} us")
    rows = check(measurements, ref)
    print(f"# measured vs predicted: the formula and the event simulation with the P = {ref_m['P']} fit, "
          "and the formula with the same run's fit")
    print(f"# {'P':>2} {'algorithm':<18} {'mode':<5} {'bytes':>9} {'measured us':>12} {'formula us':>11} "
          f"{'simulated us':>13} {'meas/formula':>13} {'own-fit us':>11} {'meas/own':>9}")
    for r in rows:
        sim = "-" if r["simulated_us"] is None else f"{r['simulated_us']:.1f}"
        print(f"  {r['P']:>2} {r['algorithm']:<18} {r['mode']:<5} {r['bytes']:>9} {r['measured_us']:>12.1f} "
              f"{r['formula_us']:>11.1f} {sim:>13} {r['measured_over_formula']:>13.2f} "
              f"{r['formula_own_us']:>11.1f} {r['measured_over_own']:>9.2f}")
    pred = predict(ref)
    print(f"# predicted at P = 1024 on a network of {1 / NETWORK['beta'] * 8 / 1e9:g} Gb/s, "
          f"{NETWORK['alpha'] * 1e6:g} us (gamma, o, round: this machine's); Fig. 9: linear:1ms, 64 iterations")
    print(f"# {'bytes':>9} {'algorithm':<18} {'mode':<9} {'round us':>10} {'simulated':>10} "
          f"{'Fig9 us':>9} {'MPI/mode':>9} {'x ideal':>8}")
    for r in pred:
        sim = "-" if r["round_simulated_us"] is None else f"{r['round_simulated_us']:.1f}"
        fig = ""
        if "fig9_latency_us" in r:
            over = "-" if math.isnan(r["over_ideal"]) else f"{r['over_ideal']:.3f}"
            fig = f"{r['fig9_latency_us']:>9.1f} {r['mpi_over_mode']:>9.3g} {over:>8}"
        print(f"  {r['bytes']:>9} {r['algorithm']:<18} {r['mode']:<9} {r['round_us']:>10.1f} {sim:>10} {fig}")
    net = Params(alpha=NETWORK["alpha"], beta=NETWORK["beta"], gamma=ref.gamma, o=ref.o, round=ref.round)
    # the tree: 128 nodes of 8 ranks; inside a node this machine's shared memory; the top
    # allreduces of a node's 8 chunks run at once through its one link (beta x 8)
    shared = Params(**dict(vars(net), beta=net.beta * 8))
    print("# one allreduce at P = 1024 by algorithm (formula, us): one rank per node; tree: 128 nodes of 8 "
          "ranks (shared memory inside, a node's 8 top allreduces share its link)")
    print(f"# {'bytes':>9} " + " ".join(f"{a:>18}" for a in ("recursive_doubling", "rabenseifner", "ring", "tree",
                                                              "mpi (MPICH)")))
    alternatives = []
    for nbytes in (8, 65536, 1 << 20, 25 << 20):
        row = {"bytes": nbytes, "recursive_doubling": formula("recursive_doubling", 1024, nbytes, net) * 1e6,
               "rabenseifner": formula("rabenseifner", 1024, nbytes, net) * 1e6,
               "ring": formula("ring", 1024, nbytes, net) * 1e6,
               "tree": formula("tree", 1024, nbytes, shared, ppn=8, local=ref) * 1e6,
               "mpi": formula("mpi", 1024, nbytes, net) * 1e6}
        alternatives.append(row)
        print(f"  {nbytes:>9} " + " ".join(f"{row[a]:>18.1f}" for a in ("recursive_doubling", "rabenseifner", "ring",
                                                                        "tree", "mpi")))
    result = {"fit_P": ref_m["P"], "alternatives": alternatives, "params": vars(ref), "check": rows, "predict": pred, "network": NETWORK}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("table", help="messages, bytes, steps, schedule size, scratch per algorithm and P")
    t.add_argument("--sizes", default=",".join(map(str, SIZES)))
    t.add_argument("--bytes", default=str(25 << 20), help="vector size in bytes (default 25 MiB)")
    t.add_argument("--ppn", type=int, default=8, help="ranks per node: the tree's regions (default 8)")
    t.add_argument("--algorithms", default=None, help="comma list (default: every registered one)")
    t.add_argument("--all-ranks", type=int, default=256, help="count every rank up to this P (default 256)")
    t.add_argument("--max-nodes", type=int, default=1_500_000,
                   help="simulate the whole graph up to this many ops in all ranks (default 1.5M)")
    t.add_argument("--json")
    au = sub.add_parser("auto", help='what "auto" picks at P = 64 .. 4096, 8 B .. 256 MiB, against the bounds')
    au.add_argument("--sizes", default=",".join(map(str, SIZES)))
    au.add_argument("--bytes", default=",".join(map(str, AUTO_BYTES)))
    au.add_argument("--json")
    h = sub.add_parser("hops", help="the activation's hop count per mode")
    h.add_argument("--sizes", default=",".join(map(str, SIZES)))
    h.add_argument("--json")
    m = sub.add_parser("measure", help="under mpiexec: what the model takes and is checked against")
    m.add_argument("--iterations", type=int, default=200, help="base iteration count (default 200)")
    m.add_argument("--json", required=True)
    mo = sub.add_parser("model", help="fit on the smallest P >= 2, check every P, predict P = 1024")
    mo.add_argument("files", nargs="+", help="JSON files written by measure")
    mo.add_argument("--json")
    args = ap.parse_args(argv)
    if args.command == "measure":
        from mpi4py import MPI
        res = measure(MPI.COMM_WORLD, args.iterations)
        if MPI.COMM_WORLD.rank == 0:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    if args.command == "model":
        print_model([json.load(open(f)) for f in args.files], args.json)
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.command == "table":
        nbytes = int(args.bytes)
        print(_table_header(nbytes, args.ppn))
        rows = table(sizes, nbytes, args.ppn, args.all_ranks, args.max_nodes,
                     args.algorithms.split(",") if args.algorithms else None)
    elif args.command == "auto":
        rows = auto_table(sizes, [int(b) for b in args.bytes.split(",")], network())
    else:
        rows = hops_table(sizes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
