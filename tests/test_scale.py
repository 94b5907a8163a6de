"""bench/scale.py: the schedules at scale, simulated; the alpha-beta formulas (P <= 64 here;
the table's P = 1024 and 4096 are in docs/scaling.md)."""
import importlib.util
import math
import os

import pytest

from partialcoll.activation.quorum import binomial_tree
from partialcoll.algorithms import ALGORITHMS, ring

_spec = importlib.util.spec_from_file_location(
    "scale", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "scale.py"))
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

N = 64 * 1024 * 4            # bytes: divisible by every P below


def closed_form_steps(alg, p):
    """Ring: 2(P - 1). Recursive doubling: log2 P' exchanges (P' the largest power of two
    <= P), plus one step where P is not a power of two: the fold-in overlaps the first
    exchange (the partner's message needs no fold), the fold-out adds one."""
    lg = p.bit_length() - 1
    if alg == "ring":
        return 2 * (p - 1)
    return lg + (1 if p & (p - 1) else 0)


@pytest.mark.parametrize("alg", ["ring", "recursive_doubling"])
@pytest.mark.parametrize("p", [2, 5, 8, 12, 16])
def test_whole_graph_steps_are_the_algorithms_rounds(alg, p):
    fam = scale.Family(alg, p, N, 1, 64, 10 ** 9)
    assert fam.how == "whole"
    assert fam.steps()[0] == closed_form_steps(alg, p)


@pytest.mark.parametrize("alg,kind", [("ring", "rotation"), ("recursive_doubling", "xor")])
@pytest.mark.parametrize("p", [16, 64])
def test_symmetric_simulation_equals_the_whole_graph(alg, kind, p):
    """Rank 0 standing for everyone gives the steps and the alpha-beta time of all ranks."""
    whole = scale.Family(alg, p, N, 1, 8, 10 ** 9)
    sym = scale.Family(alg, p, N, 1, 8, 0)
    assert sym.how == f"symmetric ({kind})"
    assert sym.steps()[0] == whole.steps()[0]
    q = scale.Params(alpha=5e-6, beta=3e-10, gamma=2e-10, o=1e-6, round=0.0)
    t_whole = max(t for t in scale.simulate(whole.graph, q.alpha, q.beta, q.gamma, q.o) if not math.isnan(t))
    t_sym = max(t for t in scale.simulate(sym.graph, q.alpha, q.beta, q.gamma, q.o) if not math.isnan(t))
    assert t_sym == pytest.approx(t_whole, rel=1e-12)


def test_symmetry_is_refused_where_it_does_not_hold():
    """The tree's aggregator moves with the region: no rotation or XOR maps rank 0's
    schedule onto the others', and the check says so (its steps are then composed)."""
    fam = scale.Family("tree", 64, N, 8, 16, 0)
    assert fam.graph is None
    assert fam.steps()[1] == "composed"


@pytest.mark.parametrize("p,ppn", [(16, 4), (64, 8), (24, 8)])
def test_composed_tree_steps_equal_the_whole_graph(p, ppn):
    whole = scale.Family("tree", p, N, ppn, 8, 10 ** 9)
    assert whole.how == "whole"
    assert scale.tree_steps(p, N, ppn) == whole.steps()[0]


@pytest.mark.parametrize("alg", ["ring", "recursive_doubling"])
@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_formula_equals_the_simulated_schedules(alg, p):
    """The formulas in docs/scaling.md are what the real schedules cost in the simulator
    (alpha per message, beta per byte, gamma per reduced byte, o per receive and reduction)."""
    q = scale.Params(alpha=5e-6, beta=3e-10, gamma=2e-10, o=1e-6, round=0.0)
    assert scale.simulated(alg, p, N, q) == pytest.approx(scale.formula(alg, p, N, q), rel=1e-9)


@pytest.mark.parametrize("p", [3, 6, 12])
def test_formula_bounds_recursive_doubling_off_powers_of_two(p):
    """Off powers of two the fold-in overlaps the first exchange: the formula (fold-in,
    exchanges, fold-out in sequence) is an upper bound, at most one alpha above."""
    q = scale.Params(alpha=5e-6, beta=3e-10, gamma=2e-10, o=1e-6, round=0.0)
    sim, f = scale.simulated("recursive_doubling", p, N, q), scale.formula("recursive_doubling", p, N, q)
    assert f - q.alpha - 1e-12 <= sim <= f + 1e-12


@pytest.mark.parametrize("p", [8, 12, 64])
def test_census_counts(p):
    """Per rank: ring sends 2(P-1) messages of N/P bytes and keeps two segments of scratch;
    recursive doubling (P a power of two) log2 P messages of N bytes and one vector."""
    r = scale.Family("ring", p, N, 1, 64, 10 ** 9).counts()
    bounds = ring.segments(N // 4, p)
    assert r["messages_max"] == r["messages_mean"] == 2 * (p - 1)
    assert r["bytes_max"] <= 2 * (p - 1) * (bounds[1] - bounds[0]) * 4
    assert r["scratch_max"] <= 2 * (bounds[1] - bounds[0]) * 4 + 64
    if p & (p - 1) == 0:
        d = scale.Family("recursive_doubling", p, N, 1, 64, 10 ** 9).counts()
        assert d["messages_max"] == d["messages_mean"] == p.bit_length() - 1
        assert d["bytes_max"] == (p.bit_length() - 1) * N and d["scratch_max"] == N


@pytest.mark.parametrize("p", [1, 2, 5, 8, 13, 64])
def test_activation_hops(p):
    """The flood reaches every rank within ceil(log2 P) hops from the worst initiator, exactly
    that on a hypercube (P a power of two); quorum adds the notification to the leader."""
    lg = (p - 1).bit_length()
    for mode in ("solo", "majority", "probe"):
        row = scale.activation_hops(p, mode)
        assert row["hops_max"] <= lg, (mode, row)
        if mode == "solo" or p & (p - 1) == 0:
            assert row["hops_max"] == lg, (mode, row)
        assert row["sent_max"] == lg
    q = scale.activation_hops(p, "quorum")
    k = max(1, p // 2)

    def depth(r):                 # in the binomial tree rooted at the leader
        parent = binomial_tree(r, p)[0]
        return 0 if parent is None else 1 + depth(parent)
    assert q["hops_max"] == max(depth(r) for r in range(p)) + (1 if k > 1 else 0), q
    assert q["received_max"] == p - 1
    assert scale.activation_hops(p, "full")["hops_max"] == 0


def test_table_picks_up_a_registered_algorithm(monkeypatch):
    """A new algorithm appears in the table by being registered, nothing else."""
    monkeypatch.setitem(ALGORITHMS, "ring_again", ring.allreduce)
    rows = scale.table([8], N, 8, 64, 10 ** 6)
    again = [r for r in rows if r["algorithm"] == "ring_again"]
    plain = [r for r in rows if r["algorithm"] == "ring"]
    assert again and again[0]["steps"] == plain[0]["steps"] == 14
    assert again[0]["messages_max"] == plain[0]["messages_max"]


@pytest.mark.parametrize("mode", ["majority", "probe", "solo"])
def test_fig9_prediction_with_a_free_round_is_the_ideal(mode):
    """With a round that costs nothing the predicted Fig. 9 latency is the benchmark's own
    ideal (the same zero-cost simulation); a round that costs t adds at most t."""
    free = scale.fig9_latency(mode, 16, 0.0, 0.0, "linear:1ms", 16)
    assert free["fig9_latency_us"] == pytest.approx(free["ideal_us"], abs=1e-6)
    cost = scale.fig9_latency(mode, 16, 1e-4, 1e-4, "linear:1ms", 16)
    assert free["fig9_latency_us"] <= cost["fig9_latency_us"] <= free["fig9_latency_us"] + 100.0 + 1e-6
