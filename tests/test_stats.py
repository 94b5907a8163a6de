"""Who is slow (issue 55): pc.Stats from hand-made records (the attribution, worked by
hand), and under mpiexec at P = 3, 8 with injected delays (tests/mpi/stats_checks.py)."""
import json

import numpy as np
import pytest

import partialcoll as pc
from partialcoll import _stats


def _record(rank, size, rows, late_posts=0, missed=None, rounds=None):
    """rows: (round, post_us, take_us, done_us, late_us, wait_us, flags)"""
    ring = np.array(rows, np.float64).reshape(-1, 7)
    totals = np.zeros(8)
    totals[0] = rounds if rounds is not None else len(rows)
    totals[1] = sum(1 for r in rows if int(r[6]) & 2)
    totals[3] = late_posts
    return {"rank": rank, "totals": totals, "missed": np.array(missed or [0] * size, np.int64), "ring": ring}


def _full(n, wait_ms):
    return (n, 1000.0, 1000.0, 1000.0 + wait_ms * 1e3, 0.0, wait_ms * 1e3, 1 | 2 | 4)


def test_full_round_blames_the_last_arrivals():
    """Waits 30, 10, 25 ms: rank 0 came first, rank 2 5 ms later, rank 1 20 ms later. Rank 0
    waited 5 ms alone (rank 2's), then ranks 0 and 2 waited 15 ms (rank 1's): 5 and 30 ms."""
    recs = [_record(0, 3, [_full(0, 30)]), _record(1, 3, [_full(0, 10)]), _record(2, 3, [_full(0, 25)])]
    s = _stats.build(recs, 3, _stats.Books(3), True, 0)
    assert s.waited_for_s == pytest.approx([0.0, 0.030, 0.005])
    # every rank's waiting, summed: the last arrival minus each one's arrival (20 + 0 + 15 ms)
    assert s.waited_for_s.sum() == pytest.approx(0.020 + 0.0 + 0.015)
    assert s.lateness[:, 0] == pytest.approx([0.0, 0.020, 0.005])
    assert s.stragglers() == [1, 2, 0]
    assert list(s.late) == [0, 1, 0]                     # rank 1 arrived last


def test_books_carry_between_calls():
    """A second stats() adds only rounds it has not attributed yet."""
    books = _stats.Books(2)
    r0 = [_full(0, 10), _full(1, 10)]
    r1 = [_full(0, 0), _full(1, 0)]
    s = _stats.build([_record(0, 2, r0), _record(1, 2, r1)], 2, books, True, 0)
    assert s.waited_for_s == pytest.approx([0.0, 0.020])
    r0.append(_full(2, 4))
    r1.append(_full(2, 0))
    s = _stats.build([_record(0, 2, r0), _record(1, 2, r1)], 2, books, True, 0)
    assert s.waited_for_s == pytest.approx([0.0, 0.024])


def test_partial_rounds_rank_by_late_then_lateness():
    """No full round: nobody is waited for; late (joined late or missed) orders, then
    the mean lateness."""
    def row(n, late_ms, inside=True):
        return (n, 2000.0, 1000.0, 1500.0, late_ms * 1e3, 0.0, 1 | (4 if inside else 0))
    recs = [_record(0, 3, [row(0, 0), row(1, 0)], missed=[0, 1, 2]),
            _record(1, 3, [row(0, 3), row(1, 0)], late_posts=1),
            _record(2, 3, [row(0, 9), row(1, 5)], late_posts=2)]
    s = _stats.build(recs, 3, _stats.Books(3), True, 0)
    assert not s.waited_for_s.any()
    assert list(s.late) == [0, 1, 2]
    assert s.lateness_s["mean"] == pytest.approx([0.0, 0.0015, 0.007])
    assert s.stragglers() == [2, 1, 0]
    assert s.blame() == pytest.approx(s.lateness_s["mean"])


def test_table_dict_and_plot(tmp_path):
    recs = [_record(0, 3, [_full(0, 30)]), _record(1, 3, [_full(0, 10)]), _record(2, 3, [_full(0, 25)])]
    s = _stats.build(recs, 3, _stats.Books(3), True, 0, "PartialAllreduce mode=full")
    text = str(s)
    lines = text.splitlines()
    assert lines[0].startswith("who is slow in PartialAllreduce mode=full: 1 rounds (1 full) at P = 3")
    assert lines[2].split()[0] == "1" and "30.0 ms" in lines[2] and "85.7%" in lines[2], text
    d = json.loads(json.dumps(s.to_dict()))
    assert d["stragglers"] == [1, 2, 0]
    assert pc.Stats.from_dict(d).to_dict() == s.to_dict()
    path = tmp_path / "who.json"
    _stats.save(s, str(path))
    assert [x.to_dict() for x in _stats.load(str(path))] == [s.to_dict()]
    png = tmp_path / "who.png"
    s.plot(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rank 1" in s.summary() and "waited for 30.0 ms" in s.summary()


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [3, 8])
def test_who_is_slow(mpirun, nprocs):
    """One rank delayed 20 ms +- 5 ms, nobody, two (20 and 10 ms), one phase-shifted, in
    every mode (tests/mpi/stats_checks.py); at an odd P and a power of two (who is slow
    is read from the rounds' records, the same at every P; each check's sleeps are most
    of its time)."""
    mpirun("stats_checks.py", nprocs, "20", timeout=300)


@pytest.mark.mpiexec
def test_ddp_hook_reports_the_slow_rank(mpirun):
    """partial_ddp(report_every=5): the logged table names the rank that sleeps before
    each backward, in the full and the solo mode (tests/mpi/torch_stats_checks.py)."""
    pytest.importorskip("torch")
    mpirun("torch_stats_checks.py", 3, timeout=300)
