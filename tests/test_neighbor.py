"""NeighborAllreduce (issue 15, Hop): Hop's graphs, exact averages, Theorems 1 and 2,
tokens, occupancy, Fig. 3, late updates, skipping, bad input (tests/mpi/neighbor_checks.py)."""
import pytest

from partialcoll import topology


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_neighbor_graphs(mpirun, nprocs):
    """Every graph, every mode, at P = 1, 2, 3, 4, 5, 8; bad input raises on every rank; 12
    random graphs, arguments and programs (neighbor_fuzz_checks.py)."""
    mpirun(["neighbor_checks.py", "neighbor_fuzz_checks.py"], nprocs, "graphs", "errors", "12", timeout=180)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,idle", [(1, "auto"), (2, "spin"), (3, "auto"), (5, "spin"), (8, "auto")])
def test_neighbor_engine(mpirun, nprocs, idle):
    """The engine does Hop's work: depth requests outstanding, and an iteration completes
    while the application computes (its result is in out before wait() is called);
    requests waited for on two other threads at once, close() refused meanwhile. And 6
    random graphs, arguments and programs (neighbor_fuzz_checks.py). One idle policy per
    P, each at an odd and another P (what the policy changes does not depend on P)."""
    mpirun(["neighbor_checks.py", "neighbor_fuzz_checks.py"], nprocs, "engine", "6", env={"PARTIALCOLL_IDLE": idle},
           timeout=150)


@pytest.mark.mpiexec
def test_neighbor_fig3(mpirun):
    """Hop's Fig. 3: one of three workers stalls (standard, backup workers, tokens)."""
    mpirun("neighbor_checks.py", 3, "fig3", timeout=90)


@pytest.mark.mpiexec
def test_neighbor_inline_progress(mpirun):
    """The same when test/wait drive progress (no progress thread), random uses included."""
    mpirun(["neighbor_checks.py", "neighbor_fuzz_checks.py"], 4, "graphs", "6", env={"PARTIALCOLL_PROGRESS": "inline"},
           timeout=180)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("kind", topology.GRAPHS)
def test_graph_shapes(kind, size):
    """Undirected, no self-loops, connected; the degrees Hop's graphs have."""
    adj = topology.neighbors(kind, size)
    for r, (src, dst) in adj.items():
        assert r not in src and src == dst == sorted(set(src))
        for d in dst:
            assert r in adj[d][0]
    dist = topology.distances(adj)
    assert all(d < float("inf") for row in dist for d in row)
    degree = len(adj[0][0])
    expected = {"ring": 2, "ring_based": 3 if size % 2 == 0 else 4, "double_ring": 4}[kind]
    assert degree == min(expected, size - 1)


def test_distances_directed():
    """Path lengths follow out-edges: a one-way ring 0 -> 1 -> 2 -> 0."""
    adj = {0: ([2], [1]), 1: ([0], [2]), 2: ([1], [0])}
    d = topology.distances(adj)
    assert d[0][1] == 1 and d[1][0] == 2 and d[0][2] == 2


def test_bad_graph_kind():
    with pytest.raises(ValueError, match="graph must be"):
        topology.neighbors("torus", 4)
