"""Hop's three communication graphs, as MPI distributed-graph communicators.

    g = pc.ring_based_graph(MPI.COMM_WORLD)        # collective; a Distgraphcomm
    coll = pc.NeighborAllreduce(n, np.float32, comm=g)

Every graph here is undirected (each edge is an in- and an out-edge at both ends) and
the calling rank is never its own neighbour (NeighborAllreduce always includes it):

    ring         i <-> i +- 1                              (degree 2)
    ring_based   the ring, plus i <-> i + P//2: an edge to the farthest worker
                 (degree 3 for even P; 4 for odd P, where i - P//2 is as far)
    double_ring  the ring, plus the ring of stride 2: i <-> i +- 2   (degree 4)

Small P collapse onto fewer distinct neighbours (P = 3: every graph is the triangle).
`neighbors(kind, size)` is the pure description (tests compute path lengths from it);
the three communicator helpers are thin, collective wrappers around
``comm.Create_dist_graph_adjacent``.
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple, cast

from mpi4py import MPI

from ._errors import ArgumentError
from ._types import check_comm, integer

GRAPHS = ("ring", "ring_based", "double_ring")


def neighbors(kind: str, size: int) -> Dict[int, Tuple[List[int], List[int]]]:
    """{rank: (sources, destinations)} of graph `kind` on `size` ranks (sorted, no self)."""
    size = integer(size, "size", 1)
    if kind not in GRAPHS:
        raise ArgumentError(f"graph must be one of {', '.join(GRAPHS)}, not {kind!r}")
    strides = {"ring": (1,), "ring_based": (1, size // 2), "double_ring": (1, 2)}[kind]
    out = {}
    for r in range(size):
        peers: Set[int] = set()
        for d in strides:
            peers.update(((r + d) % size, (r - d) % size))
        peers.discard(r)
        ordered = sorted(peers)
        out[r] = (ordered, list(ordered))
    return out


def graph(comm: MPI.Comm, kind: str) -> MPI.Distgraphcomm:
    """Hop's graph `kind` over comm's ranks (collective over comm)."""
    check_comm(comm, kind + "_graph")
    sources, destinations = neighbors(kind, comm.Get_size())[comm.Get_rank()]
    intra = cast(MPI.Intracomm, comm)     # check_comm: an intracommunicator
    return intra.Create_dist_graph_adjacent(sources, destinations, reorder=False)


def ring_graph(comm: MPI.Comm = MPI.COMM_WORLD) -> MPI.Distgraphcomm:
    """The ring: i <-> i +- 1 (collective)."""
    return graph(comm, "ring")


def ring_based_graph(comm: MPI.Comm = MPI.COMM_WORLD) -> MPI.Distgraphcomm:
    """The ring plus an edge to the farthest worker, i <-> i + P//2 (collective)."""
    return graph(comm, "ring_based")


def double_ring_graph(comm: MPI.Comm = MPI.COMM_WORLD) -> MPI.Distgraphcomm:
    """Two rings over the same workers: i <-> i +- 1 and i <-> i +- 2 (collective)."""
    return graph(comm, "double_ring")


def distances(adjacency: Dict[int, Tuple[List[int], List[int]]]) -> List[List[float]]:
    """d[i][j]: length of the shortest directed path i -> j along out-edges (inf: none)."""
    size = len(adjacency)
    inf = float("inf")
    d = [[inf] * size for _ in range(size)]
    for i in range(size):
        d[i][i] = 0
        frontier = [i]
        while frontier:
            nxt = []
            for a in frontier:
                for b in adjacency[a][1]:
                    if d[i][b] == inf:
                        d[i][b] = d[i][a] + 1
                        nxt.append(b)
            frontier = nxt
    return d


def bridged(adjacency: Dict[int, Tuple[List[int], List[int]]], failed) -> Dict[int, Tuple[List[int], List[int]]]:
    """The graph over the survivors once the ranks `failed` left (NeighborAllreduce,
    on_failure="shrink"): every edge u -> f -> v through a failed rank f becomes u -> v
    (u != v), so every path between survivors survives it; the failed ranks' own edges
    go. A ring closes over the gap (i - 1 <-> i + 1 once i died); a rank's degree grows
    by the bridges it gains. Ranks keep their numbering; {rank: (sources, destinations)}."""
    out = {r: set(dests) for r, (_, dests) in adjacency.items()}
    for f in sorted(failed):
        through = out.pop(f, set())
        for u, dests in out.items():
            if f in dests:
                dests.discard(f)
                dests.update(v for v in through if v != u)
    sources: Dict[int, List[int]] = {r: [] for r in out}
    for u, dests in out.items():
        for v in dests:
            sources[v].append(u)
    return {r: (sorted(sources[r]), sorted(out[r])) for r in out}
