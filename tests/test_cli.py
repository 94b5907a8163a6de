"""partialcoll-bench end to end under mpiexec (issues 5 and 13), and -c's checker without MPI."""
import json
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import PYTHON, launch, launch_env

BENCH = [*PYTHON, "-m", "partialcoll.bench"]
ALL_MODES = ("mpi", "impi", "solo", "majority", "probe", "quorum", "full")

# Runs main() and prints how each rank exited, so a test can see every rank's status.
EVERY_RANK = """
import sys
from mpi4py import MPI
import partialcoll.bench as bench
{patch}
try:
    bench.main(sys.argv[1:])
    code = 0
except SystemExit as exc:
    code = exc.code
print(f"EXIT {{MPI.COMM_WORLD.rank}} {{code}}", flush=True)
sys.exit(code)
"""


def run(nprocs, *args, timeout=240, patch=""):
    cmd = launch(nprocs, [*PYTHON, "-c", EVERY_RANK.format(patch=patch), *args])
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PARTIALCOLL_TIMEOUT="120", **launch_env()))


def exits(p):
    """{rank: exit code} as each rank printed it."""
    return {int(r): int(c) for r, c in re.findall(r"EXIT (\d+) (-?\d+)", p.stdout)}


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3])
def test_latency_json_csv(tmp_path, nprocs):
    out, csv = tmp_path / "lat.json", tmp_path / "lat.csv"
    modes = ",".join(ALL_MODES)
    p = run(nprocs, "latency", "-m", "8:2K", "-i", "20", "-x", "2", "--modes", modes, "--json", str(out),
            "--csv", str(csv))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("# partialcoll"), p.stdout
    data = json.loads(out.read_text())
    assert [r["bytes"] for r in data["rows"]] == [8, 32, 128, 512, 2048]
    for row in data["rows"]:
        for m in ALL_MODES:
            assert row[f"{m}_avg_us"] > 0 and row[f"{m}_min_us"] <= row[f"{m}_max_us"]
    assert csv.read_text().splitlines()[0].startswith("bytes,")


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,sync", [(2, "none"), (3, "iteration"), (4, "none")])
def test_skew_checked_every_mode(tmp_path, nprocs, sync):
    """Both sync modes run; -c passes for every mode; the JSON has every figure."""
    out = tmp_path / "skew.json"
    p = run(nprocs, "skew", "--sync", sync, "--skew", "linear:0.3ms", "-i", "6", "-x", "2", "-r", "2",
            "-z", "-c", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert exits(p) == {r: 0 for r in range(nprocs)}, p.stdout
    head = p.stdout.splitlines()[:6]
    assert any(("the paper's method" if sync == "iteration" else "free-running") in h for h in head), head
    assert "P50 us" in p.stdout and "valid" in p.stdout and "Fail" not in p.stdout
    data = json.loads(out.read_text())
    assert data["sync"] == sync and data["late"] == "fold" and data["validated"] and data["repetitions"] == 2
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == set(ALL_MODES)
    for m, r in rows.items():
        assert r["valid"] is True and r["errors"] == [], (m, r["errors"])
        assert r["latency_us"] > 0 and r["throughput_its"] > 0 and r["initiator_us"] > 0
        assert 0 <= r["late_fraction"] <= 1 and r["p50_us"] <= r["p99_us"]
        assert len(r["latency_us_per_repetition"]) == 2 and len(r["mpi_over_per_repetition"]) == 2
    for m in ("mpi", "impi", "full"):
        assert rows[m]["nap"] == nprocs and rows[m]["late_fraction"] == 0
    assert 1 <= rows["solo"]["nap"] <= nprocs
    assert rows["solo"]["ideal_us"] == 0 and rows["mpi"]["ideal_us"] > 0
    assert rows["mpi"]["mpi_over"] == 1.0


@pytest.mark.mpiexec
def test_skew_default_is_paper_method_unchecked(tmp_path):
    """Without -c the message stays 8 B and late='latest'; the alternating order shows."""
    out = tmp_path / "skew.json"
    p = run(2, "skew", "--skew", "linear:0.2ms", "-i", "4", "-x", "1", "--modes", "mpi,solo", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert (data["sync"], data["late"], data["bytes"], data["validated"]) == ("iteration", "latest", 8, False)
    assert "valid" not in p.stdout and "P50" not in p.stdout
    order = re.findall(r"repetition (\d)/2: (\w+) done", p.stderr)
    assert order == [("1", "mpi"), ("1", "solo"), ("2", "solo"), ("2", "mpi")], p.stderr


@pytest.mark.mpiexec
def test_skew_wrong_reference_fails_on_every_rank():
    """-c with a deliberately wrong reference (one post's weight off by one) fails, exit 1 everywhere."""
    patch = ("import functools, partialcoll.bench._validate as v\n"
             "s = sys.modules['partialcoll.bench.skew']\n"
             "s.check_results = functools.partial(v.check, weight_of=lambda j: v.weight(j) + (j == 3))")
    p = run(3, "skew", "--skew", "linear:0.2ms", "-i", "6", "-x", "1", "-r", "1", "-c", "--modes", "mpi,solo",
            patch=patch, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert exits(p) == {0: 1, 1: 1, 2: 1}, p.stdout
    assert "Fail" in p.stdout and "# FAIL mpi" in p.stdout and "# FAIL solo" in p.stdout, p.stdout
    assert "wrong results" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.mpiexec
@pytest.mark.parametrize("args", [["latency", "--sizes", "big"], ["latency", "--modes", "mpi,nope"],
                                  ["skew", "--skew", "sideways"], ["skew", "--sync", "sometimes"],
                                  ["skew", "-c", "--late", "latest"],
                                  ["skew", "--quorum", "9"], ["skew", "--rc", "nosuchoption=1"],
                                  ["frobnicate"], ["latency", "--bogus"]])
def test_bad_option_is_a_usage_error_on_every_rank(args):
    p = run(2, *args, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert exits(p) == {0: 2, 1: 2}, p.stdout
    assert "error" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.mpiexec
def test_help_names_both_sync_modes():
    p = run(2, "skew", "--help", timeout=60)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "the paper's method" in text and "free-running" in text and "-z" in text and "-c" in text


@pytest.mark.mpiexec
def test_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[test]')")
    lat, sk = tmp_path / "lat.png", tmp_path / "skew.png"
    p = run(2, "latency", "-m", "8:128", "-i", "10", "-x", "1", "--plot", str(lat))
    assert p.returncode == 0, p.stderr
    p = run(2, "skew", "--skew", "uniform:0:1ms", "-i", "5", "-x", "1", "-r", "1", "--modes", "mpi,solo",
            "--plot", str(sk))
    assert p.returncode == 0, p.stderr
    for f in (lat, sk):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the checker and the ideal model as pure functions (no MPI) ----------------------------

def _fold_run(size=3, rounds=5):
    """Outcomes one rank would receive: round n reads ranks [0, n % size] (the others later)."""
    from partialcoll.bench import _validate as v
    count = v.min_count(size) + 2
    posted = np.zeros(size, int)          # posts read so far, per rank
    outs = []
    for n in range(rounds):
        active = tuple(range(n % size + 1))
        data = np.zeros(count)
        for r in range(size):
            hi = n + 1 if r in active else posted[r]
            for j in range(posted[r], hi):
                data += v.post_values(r, size, count, j, np.float64)
            posted[r] = hi
        outs.append(v.Outcome(n, 1, active, data))
    data = np.zeros(count)                # close(): flush everything left
    for r in range(size):
        for j in range(posted[r], rounds):
            data += v.post_values(r, size, count, j, np.float64)
    outs.append(v.Outcome(rounds, 1, (), data, closing=True))
    return outs, [rounds] * size


def test_checker_accepts_a_correct_run():
    from partialcoll.bench import _validate as v
    outs, posts = _fold_run()
    errors, seen = v.check(outs, 3, posts, rank=0)
    assert errors == [] and seen[4] == (5, 5, 3) and seen[5] == (5, 5, 5)
    assert v.disagreement([seen, dict(seen)]) is None


@pytest.mark.parametrize("corrupt", ["value", "count", "active", "lost", "skipped_round"])
def test_checker_rejects(corrupt):
    from partialcoll.bench import _validate as v
    outs, posts = _fold_run()
    if corrupt == "value":
        outs[2].data[-1] += 1             # a reduction that is off
    elif corrupt == "count":
        outs[1].data[2] += 1              # one more post of rank 2 than was made by then
        outs[1].data[3:] += v.post_values(2, 3, len(outs[1].data), 1, np.float64)[3:]
    elif corrupt == "active":
        outs[0] = v.Outcome(0, 1, (0, 1), outs[0].data)   # claims rank 1, whose post is not in it
    elif corrupt == "lost":
        outs[-1].data[:] = 0              # close() flushes nothing
    else:
        del outs[2]                       # a round never delivered (fold would have folded it)
    errors, _ = v.check(outs, 3, posts, rank=0)
    assert errors, corrupt


def test_checker_finds_ranks_that_disagree():
    from partialcoll.bench import _validate as v
    assert "rank 1 saw" in v.disagreement([{3: (4, 4)}, {3: (4, 3)}])


def test_ideal_model():
    from partialcoll.bench.skew import delays, simulate, start_rule
    p = 8
    d = delays("linear:1ms", p, 16, 0)
    mpi = simulate(d, "iteration", start_rule("mpi", p, 0, 4, 2))
    assert np.isclose(mpi["waits"].mean(), 3.5e-3) and not mpi["late"].any()
    solo = simulate(d, "iteration", start_rule("solo", p, 0, 4, 2))
    assert solo["waits"].max() == 0 and solo["late"][:, 1:].all()
    quorum = simulate(d, "iteration", start_rule("quorum", p, 0, 4, 2))
    assert np.isclose(quorum["waits"].mean(), (3 + 2 + 1) / 8 * 1e-3)
    # free-running under a persistent skew: majority is paced by its slow designated ranks
    free = simulate(d, "none", start_rule("majority", p, 0, 4, 2))
    aligned = simulate(d, "iteration", start_rule("majority", p, 0, 4, 2))
    assert free["waits"].mean() > aligned["waits"].mean()
