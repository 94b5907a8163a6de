"""Rabenseifner's allreduce (reduce-scatter by halving, allgather by doubling) and the
model "auto" chooses by: dry builds run in the pure-Python executor (no MPI), against
NumPy's reduction of the same data; and the bounds "auto" keeps at P = 64 .. 4096."""
import importlib.util
import json
import math
import os

import numpy as np
import pytest

from partialcoll._buffers import BufRef
from partialcoll.algorithms import choose, explain, model, rabenseifner, tree
from partialcoll.schedule import SEND, Schedule
from simulate import run

SIZES = list(range(1, 10)) + [12, 13, 16, 24]
COUNTS = [0, 1, 2, 5, 7, 16, 100, 1001]

_spec = importlib.util.spec_from_file_location(
    "scale", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "scale.py"))
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)


def data(p, count, dtype=np.float64):
    return [((np.arange(count) * (r + 3) + 7 * r) % 29 - 11).astype(dtype) for r in range(p)]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_allreduce_with_divisor_and_max(p, count):
    """SUM divided by 3 (each element divided once, on the path that makes its sum) and
    MAX, every rank, against NumPy."""
    for op, divisor, fold in [(0, 3.0, np.sum), (3, 1.0, np.max)]:
        xs = data(p, count)
        bufs = [x.copy() for x in xs]
        scheds = []
        for r in range(p):
            s = Schedule(rank=r, size=p)
            rabenseifner.allreduce(s, BufRef.of(bufs[r], writable=True), op, divisor=divisor)
            scheds.append(s)
        run(scheds)
        want = fold(np.stack(xs), axis=0) / divisor if count else np.zeros(0)
        for r in range(p):
            assert np.array_equal(bufs[r], want), (p, count, op, r)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("count", [0, 3, 7, 100])
def test_halves_on_their_own(p, count):
    """reduce_scatter alone leaves each new rank its owned block of the sum (the owned
    blocks tile the vector); allgather alone, given every owned block, rebuilds the vector."""
    if p == 1:
        return
    xs = data(p, count)
    bufs = [x.copy() for x in xs]
    plans, scheds = [], []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        plans.append(rabenseifner.reduce_scatter(s, BufRef.of(bufs[r], writable=True), 0).plan)
        scheds.append(s)
    run(scheds)
    want = np.sum(np.stack(xs), axis=0) if count else np.zeros(0)
    owned = sorted(pl.owned for pl in plans if pl.owned is not None)
    assert len(owned) == 1 << (p.bit_length() - 1)
    assert [lo for lo, _ in owned] == [0] + [hi for _, hi in owned[:-1]] and owned[-1][1] == count
    for r, pl in enumerate(plans):
        if pl.owned is not None:
            lo, hi = pl.owned
            assert np.array_equal(bufs[r][lo:hi], want[lo:hi]), (p, count, r)
    # allgather alone: each new rank starts with its block of `want` only
    bufs = [np.full(count, np.nan) for _ in range(p)]
    scheds = []
    for r, pl in enumerate(plans):
        if pl.owned is not None:
            bufs[r][pl.owned[0]:pl.owned[1]] = want[pl.owned[0]:pl.owned[1]]
        s = Schedule(rank=r, size=p)
        rabenseifner.allgather(s, BufRef.of(bufs[r], writable=True))
        scheds.append(s)
    run(scheds)
    for r in range(p):
        assert np.array_equal(bufs[r], want), (p, count, r)


@pytest.mark.parametrize("p", [2, 3, 7, 8, 12, 64])
def test_messages_bytes_and_scratch(p):
    """Per rank: 2 log2 P' data messages (+1 in, +1 out for a folding pair); a rank of the
    P' sends (1 - 1/P') of the vector in each phase; scratch under one vector (two where a
    rank folds an extra rank in)."""
    count = 1 << 12
    pof2 = 1 << (p.bit_length() - 1)
    lg = pof2.bit_length() - 1
    for r in range(p):
        s = Schedule(rank=r, size=p)
        rabenseifner.allreduce(s, BufRef.slot_ref(1, count, np.float32), 0)
        sends = [op.bufs[0].nbytes for op in s.ops if op.kind == SEND]
        pl = rabenseifner.Plan(r, p, count)
        if pl.role == "extra":
            assert sends == [4 * count]
            continue
        assert len(sends) == 2 * lg + (pl.role == "proxy"), (p, r)
        assert sum(sends) == 2 * (pof2 - 1) * count * 4 // pof2 + (4 * count if pl.role == "proxy" else 0)
        assert s.scratch_bytes <= 4 * count * (2 if pl.role == "proxy" else 1) + 128


def test_dump_reads_like_the_algorithm():
    s = Schedule(rank=1, size=7)
    rabenseifner.allreduce(s, BufRef.of(np.zeros(9), writable=True), 0)
    text = s.dump()
    assert "fold in: the extra rank's vector" in text and "keep = tmp (op) keep" in text
    assert "reduce-scatter 1" in text and "allgather 0" in text and "fold out" in text


# -- the model ------------------------------------------------------------------------------
def test_model_equals_the_simulated_schedules():
    """model.predict is what the real schedules cost in bench/scale.py's event simulator
    (P a power of two; off them the fold overlaps the first step: at most one alpha more)."""
    q = scale.Params(alpha=5e-6, beta=3e-10, gamma=2e-10, o=1e-6, round=0.0)
    n = 4 * 4096 * 3
    for p in (2, 4, 8, 16, 32):
        for alg in ("rabenseifner", "recursive_doubling", "ring"):
            assert scale.simulated(alg, p, n, q) == pytest.approx(scale.formula(alg, p, n, q), rel=1e-9), (alg, p)
    for p in (3, 6, 12):
        sim, f = scale.simulated("rabenseifner", p, n, q), scale.formula("rabenseifner", p, n, q)
        assert f - q.alpha - 1e-12 <= sim <= f + 1e-12, p


@pytest.mark.parametrize("p", scale.SIZES)
def test_auto_within_the_bounds_at_scale(p):
    """At P = 64 .. 4096 and 8 B .. 256 MiB, one rank per node on a 25 Gb/s, 5 us network:
    "auto"'s predicted time within 1.1x of the alpha-beta lower bound and never above
    MPICH's model; on its dry-built schedules at most 2 ceil(log2 P) + 4 data messages per
    rank and, from 64 KiB, at most 1.15 x 2 (P - 1)/P n bytes."""
    q = scale.network()
    for nbytes in scale.AUTO_BYTES:
        r = scale.auto_row(p, nbytes, q)
        assert r["over_bound"] <= 1.1 and r["predicted_us"] <= r["mpi_us"] * (1 + 1e-12), r
        assert r["messages_max"] <= r["messages_limit"], r
        if nbytes >= 64 << 10:
            assert r["bytes_max"] <= 1.15 * r["bytes_optimal"], r
        lg = math.ceil(math.log2(p))
        assert r["round_us"] == pytest.approx(r["predicted_us"] + lg * (q.alpha + q.o) * 1e6)
        # the flood's hops are what the round adds (bench/scale.py hops; P a power of two)
    assert scale.activation_hops(min(p, 256), "solo")["hops_max"] == math.ceil(math.log2(min(p, 256)))


def test_auto_by_size_and_by_p():
    """Small vectors: recursive doubling (fewest steps); large ones: Rabenseifner (ring's
    bytes in 2 log2 P steps); ring where P is not a power of two and the fold's extra
    vector costs more than ring's extra steps; a named algorithm is kept."""
    assert choose("auto", 8, 64) == "recursive_doubling"
    assert choose("auto", 16 << 20, 64) == "rabenseifner"
    assert choose("auto", 16 << 20, 8) == "rabenseifner"
    assert choose("auto", 16 << 20, 6) == "ring"
    assert choose("auto", 0, 8) == "recursive_doubling" and choose("auto", 8, 1) == "recursive_doubling"
    assert choose("ring", 8, 64) == "ring"
    name, why = explain("auto", 1 << 20, 64)
    assert why.startswith("rabenseifner: the least predicted time") and "recursive_doubling" in why
    with pytest.raises(ValueError, match="unknown algorithm"):
        choose("no_such_algorithm", 8, 4)


def test_auto_takes_the_tree_across_nodes_of_several_ranks():
    """Nodes of 8 ranks, on a network slower than their shared memory: "auto" takes the
    node-aware tree (reduce inside the node, the flat algorithm among the nodes'
    aggregators, broadcast inside) where the model predicts it faster, and never where
    the regions are trivial (one node, or a node per rank)."""
    from partialcoll.algorithms import auto_may_choose_tree
    slow = model.DEFAULTS._replace(alpha=50e-6)
    nodes = tree.normalize_groups([r // 8 for r in range(64)], 64)
    for nbytes in (8, 1 << 20):
        name, why = explain("auto", nbytes, 64, nodes, slow)
        assert name == "tree" and why.startswith("tree: the least predicted time"), why
        assert choose("auto", nbytes, 64, None, slow) != "tree"
    for trivial in (list(range(64)), [0] * 64):
        assert choose("auto", 1 << 20, 64, tree.normalize_groups(trivial, 64), slow) != "tree"
    assert auto_may_choose_tree("auto", 1 << 20, 64, slow) and not auto_may_choose_tree("ring", 1 << 20, 64, slow)
    assert not auto_may_choose_tree("auto", 1 << 20, 2, slow) and not auto_may_choose_tree("auto", 0, 64, slow)


def test_calibration_cache(tmp_path, monkeypatch):
    """load(): the cached parameters, or the defaults where the cache is missing or broken."""
    path = str(tmp_path / "cal.json")
    monkeypatch.setenv("PARTIALCOLL_CALIBRATION", path)
    assert model.cache_path() == path and model.load() == model.DEFAULTS
    mine = model.DEFAULTS._replace(alpha=2e-6, beta_node=1e-10)
    model.save(mine)
    assert model.load() == mine._replace(source=path)
    with open(path, "w") as f:
        json.dump({"alpha": -1.0}, f)
    assert model.load() == model.DEFAULTS
    with open(path, "w") as f:
        f.write("{not json")
    assert model.load() == model.DEFAULTS
    # the choice follows the parameters: a network whose messages cost nothing -> ring's
    # bytes are as cheap as Rabenseifner's at P = 6 (no fold)
    free = model.DEFAULTS._replace(alpha=0.0, alpha_node=0.0, o=0.0)
    assert model.best(6, 1 << 20, 6, free)[0] == "ring"
