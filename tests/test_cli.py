"""partialcoll-bench end to end under mpiexec (P = 1, 2, 3, 4), and its pieces without MPI:
the size sweep, the -c checker for every element type, the bandwidths, the schedules."""
import datetime
import json
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import PYTHON, launch, launch_env

BENCH = [*PYTHON, "-m", "partialcoll.bench"]
ALL_MODES = ("mpi", "impi", "solo", "majority", "probe", "quorum", "full")
EVERYONE = ("mpi", "impi", "full")

# Runs main() and prints how each rank exited, so a test can see every rank's status: on
# stderr, so that stdout holds only what rank 0 printed (other ranks' lines could land in it).
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
print(f"EXIT {{MPI.COMM_WORLD.rank}} {{code}}", file=sys.stderr, flush=True)
sys.exit(code)
"""


def run(nprocs, *args, timeout=180, patch=""):
    cmd = launch(nprocs, [*PYTHON, "-c", EVERY_RANK.format(patch=patch), *args])
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PARTIALCOLL_TIMEOUT="120", **launch_env()))


def exits(p):
    """{rank: exit code} as each rank printed it."""
    return {int(r): int(c) for r, c in re.findall(r"EXIT (\d+) (-?\d+)", p.stderr)}


def table(stdout):
    """(column titles, rows as lists of cells) of the printed table: the header is the '#'
    line that starts with 'size'; rows are the lines that are not '#' lines."""
    lines = stdout.splitlines()
    head = next(line for line in lines if re.match(r"#\s+size\s+count", line))
    titles = re.split(r"\s{2,}", head.lstrip("# ").strip())
    rows = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    return titles, rows


def check_row(row, nprocs, itemsize):
    """What every row of either command must satisfy (nccl-tests' definitions)."""
    assert row["count"] * itemsize == row["bytes"], row
    assert row["algbw_gbs"] == pytest.approx(row["bytes"] / row["avg_us" if "avg_us" in row else "latency_us"] / 1e3)
    assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * 2 * (nprocs - 1) / nprocs)
    if row["mode"] in EVERYONE:
        assert row["nap"] == nprocs, row
    else:
        assert 1 <= row["nap"] <= nprocs, row
    assert row["p50_us"] <= row["p90_us"] <= row["p99_us"], row


def check_run_info(data, nprocs, command, warmup):
    assert data["P"] == nprocs and command in data["command_line"]
    assert data["mpi_library"] and re.match(r"\d+\.\d+$", data["mpi_version"]), data
    assert datetime.datetime.fromisoformat(data["date"]).tzinfo is not None
    assert data["warmup"] == warmup and data["mpi4py"]


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_latency_every_mode_checked(tmp_path, nprocs):
    """Powers of 2, one row per (size, mode), every column, -c passes, JSON and CSV complete."""
    out, csv = tmp_path / "lat.json", tmp_path / "lat.csv"
    p = run(nprocs, "latency", "-m", "8:512", "-i", "12", "-x", "2", "--modes", ",".join(ALL_MODES), "-z", "-c",
            "--json", str(out), "--csv", str(csv), timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert exits(p) == {r: 0 for r in range(nprocs)}, p.stderr
    assert p.stdout.startswith("# partialcoll"), p.stdout
    data = json.loads(out.read_text())
    check_run_info(data, nprocs, "latency", 2)
    sizes = [8, 16, 32, 64, 128, 256, 512]
    assert [(r["bytes"], r["mode"]) for r in data["rows"]] == [(b, m) for b in sizes for m in ALL_MODES]
    small = 4 * (nprocs + 1)              # below this, partial modes cannot carry per-rank counts
    for row in data["rows"]:
        check_row(row, nprocs, 4)
        assert row["type"] == "float32" and row["iterations"] == 12 and row["warmup"] == 2
        if row["mode"] in EVERYONE or row["bytes"] >= small:
            assert row["wrong"] == 0, row
        else:
            assert row["wrong"] is None, row
        if row["mode"] == "mpi":
            assert row["ratio_to_mpi"] == 1.0
    titles, rows = table(p.stdout)
    assert titles == ["size", "count", "type", "mode", "avg us", "min us", "max us", "iters", "P50 us", "P90 us",
                      "P99 us", "algbw GB/s", "busbw GB/s", "NAP", "mode/MPI", "#wrong"], titles
    assert len(rows) == len(data["rows"]) and all(len(r) == len(titles) for r in rows), rows
    assert "# -c: 0 wrong elements OK" in p.stdout
    assert csv.read_text().splitlines()[0].startswith("bytes,count,type,mode,")


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_types_in_both_commands(tmp_path, nprocs, dtype):
    """Every dtype runs in every benchmark: MPI_Allreduce only where this MPI can sum the
    type (never bfloat16: no MPI datatype), skipped with a note otherwise; -z -c -f."""
    from partialcoll.bench._common import element_type, reference_unsupported
    cannot = reference_unsupported(element_type(dtype))      # float16: MPICH sums it, Open MPI 5 does not
    if dtype == "bfloat16":
        assert cannot and "no MPI datatype for bfloat16" in cannot, cannot
    lat, sk = tmp_path / "lat.json", tmp_path / "skew.json"
    p = run(nprocs, "latency", "--dtype", dtype, "-m", "8:128", "-f", "4", "-i", "10", "-x", "2",
            "--modes", "mpi,full,solo,quorum", "-z", "-c", "--json", str(lat))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    q = run(nprocs, "skew", "--dtype", dtype, "--skew", "linear:0.2ms", "-m", "8:32", "-f", "4", "-i", "4",
            "-x", "1", "-r", "1", "--modes", "mpi,impi,solo,full", "-z", "-c", "--json", str(sk))
    assert q.returncode == 0 and "Traceback" not in q.stderr, q.stdout + q.stderr
    for proc, path, skipped in ((p, lat, ["mpi"]), (q, sk, ["mpi", "impi"])):
        data = json.loads(path.read_text())
        modes = {r["mode"] for r in data["rows"]}
        assert data["dtype"] == dtype and {r["type"] for r in data["rows"]} == {dtype}
        if cannot:
            assert data["skipped_modes"] == skipped and not modes & set(skipped), data["skipped_modes"]
            assert f"{', '.join(skipped)} skipped:" in proc.stdout, proc.stdout
        else:
            assert data["skipped_modes"] == [] and set(skipped) <= modes
        for row in data["rows"]:
            check_row(row, nprocs, 2)
            assert row["wrong"] in (0, None), row
        assert "# -c: 0 wrong elements OK" in proc.stdout
    assert [r["bytes"] for r in json.loads(lat.read_text())["rows"] if r["mode"] == "full"] == [8, 32, 128]


@pytest.mark.mpiexec
def test_iterations_and_warmup_that_drop_are_printed(tmp_path):
    out = tmp_path / "lat.json"
    p = run(2, "latency", "-m", "4K:1M", "-f", "16", "-i", "40", "-x", "5", "--modes", "mpi", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["bytes"], r["iterations"], r["warmup"]) for r in rows] == [(4096, 40, 5), (65536, 20, 5),
                                                                          (1 << 20, 20, 3)]
    head = " ".join(line for line in p.stdout.splitlines() if line.startswith("#"))
    assert "iterations: 40 up to 8192 B" in head and "warm-up: 5, 3 from 1048576 B (capped)" in head, head
    assert [r[7] for r in table(p.stdout)[1]] == ["40", "20", "20"]


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,sync", [(2, "none"), (3, "iteration"), (4, "none")])
def test_skew_checked_every_mode(tmp_path, nprocs, sync):
    """Both sync modes run; -c passes for every mode; the JSON has every figure."""
    out = tmp_path / "skew.json"
    p = run(nprocs, "skew", "--sync", sync, "--skew", "linear:0.3ms", "-i", "6", "-x", "2", "-r", "2",
            "-z", "-c", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert exits(p) == {r: 0 for r in range(nprocs)}, p.stderr
    head = p.stdout.splitlines()[:6]
    assert any(("the paper's method" if sync == "iteration" else "free-running") in h for h in head), head
    titles, lines = table(p.stdout)
    assert titles[:6] == ["size", "count", "type", "mode", "iters", "latency us"] and titles[-1] == "#wrong"
    assert "P90 us" in titles and "busbw GB/s" in titles and len(lines) == len(ALL_MODES)
    data = json.loads(out.read_text())
    check_run_info(data, nprocs, "skew", 2)
    assert data["sync"] == sync and data["late"] == "fold" and data["validated"] and data["repetitions"] == 2
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == set(ALL_MODES)
    for m, r in rows.items():
        assert r["wrong"] == 0 and r["valid"] is True and r["errors"] == [], (m, r["errors"])
        assert r["bytes"] == 4 * (nprocs + 1) and r["count"] == nprocs + 1      # grown for -c
        assert r["latency_us"] > 0 and r["throughput_its"] > 0 and r["initiator_us"] > 0
        assert 0 <= r["late_fraction"] <= 1 and r["p50_us"] <= r["p90_us"] <= r["p99_us"]
        assert len(r["latency_us_per_repetition"]) == 2 and len(r["mpi_over_per_repetition"]) == 2
        check_row(r, nprocs, 4)
    for m in EVERYONE:
        assert rows[m]["late_fraction"] == 0
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
    assert "#wrong" not in p.stdout and "P50" not in p.stdout
    order = re.findall(r"8 B, repetition (\d)/2: (\w+) done", p.stderr)
    assert order == [("1", "mpi"), ("1", "solo"), ("2", "solo"), ("2", "mpi")], p.stderr
    # the policy auto chose by the end (the header shows it before the engine decided)
    end = re.search(r"^# idle at the end \(rank 0's node\): (\w+) \((.+)\)$", p.stdout, re.M)
    assert end and end.group(1) == data["info"]["idle"] and end.group(2) == data["info"]["idle_reason"], p.stdout
    assert end.group(2) != "not started yet", p.stdout


# one element of one result on rank 1 is off by one, in the benchmark's own copy of it
CORRUPT = """
import numpy as np, partialcoll.bench._common as c
_call = c.Collective.call_result
def call_result(self, x, y):
    res, late = _call(self, x, y)
    self.seen = getattr(self, "seen", 0) + 1
    if MPI.COMM_WORLD.rank == 1 and self.mode == {mode!r} and self.seen == 3:
        d = np.asarray(res.data)
        d[-1] += 1
    return res, late
c.Collective.call_result = call_result
"""


@pytest.mark.mpiexec
@pytest.mark.parametrize("command,mode", [("latency", "mpi"), ("latency", "solo"), ("skew", "full")])
def test_a_wrong_element_fails_on_every_rank(command, mode):
    """-c counts exactly the one wrong element, names it, and every rank exits 1."""
    args = (["-m", "64:64", "-i", "6", "-x", "1"] if command == "latency"
            else ["--skew", "linear:0.2ms", "-i", "6", "-x", "1", "-r", "1"])
    p = run(3, command, *args, "-c", "--modes", f"impi,{mode}", patch=CORRUPT.format(mode=mode), timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert exits(p) == {0: 1, 1: 1, 2: 1}, p.stderr
    titles, rows = table(p.stdout)
    wrong = {r[3]: r[titles.index("#wrong")] for r in rows}
    assert wrong == {"impi": "0", mode: "1"}, p.stdout
    assert f"# FAIL {mode} at" in p.stdout and "this is rank 1" in p.stdout, p.stdout
    assert "# -c: 1 wrong elements FAILED" in p.stdout
    assert "wrong results" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.mpiexec
def test_skew_wrong_reference_fails_on_every_rank():
    """-c with a deliberately wrong reference (one post's weight off by one) fails, exit 1 everywhere."""
    patch = ("import functools, partialcoll.bench._validate as v\n"
             "v.Checker = functools.partial(v.Checker, weight_of=lambda j: v.weight(j) + (j == 3))")
    p = run(3, "skew", "--skew", "linear:0.2ms", "-i", "6", "-x", "1", "-r", "1", "-c", "--modes", "mpi,solo",
            patch=patch, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert exits(p) == {0: 1, 1: 1, 2: 1}, p.stderr
    assert "# FAIL mpi" in p.stdout and "# FAIL solo" in p.stdout, p.stdout
    assert "wrong results" in p.stderr and "Traceback" not in p.stderr, p.stderr


BAD_OPTIONS = [["latency", "--sizes", "big"], ["latency", "--modes", "mpi,nope"], ["latency", "-f", "1"],
               ["latency", "--dtype", "bool"], ["latency", "--dtype", "float128x"], ["latency", "-c", "--late", "latest"],
               ["skew", "--skew", "sideways"], ["skew", "--sync", "sometimes"], ["skew", "--quorum", "9"],
               ["skew", "--rc", "nosuchoption=1"], ["frobnicate"], ["latency", "--bogus"],
               ["latency", "--algorithm", "nope"], ["skew", "--algorithm", "rings"]]

# Every bad option in one process without mpiexec (argparse and the option checks need no
# peer): main() of each in turn, its exit code, stdout and stderr captured.
ALL_BAD = """
import contextlib, io, json, sys
import partialcoll.bench as bench
out = []
for args in json.loads(sys.argv[1]):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            bench.main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:
            code, e = -1, io.StringIO(f"Traceback: {exc!r}")
    out.append([code, o.getvalue(), e.getvalue()])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bad_option_runs():
    p = subprocess.run([*PYTHON, "-c", ALL_BAD, json.dumps(BAD_OPTIONS)], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, **launch_env()))
    assert p.returncode == 0, p.stderr
    return {tuple(args): run for args, run in zip(BAD_OPTIONS, json.loads(p.stdout.splitlines()[-1]))}


@pytest.mark.parametrize("args", BAD_OPTIONS)
def test_bad_option_is_a_usage_error(bad_option_runs, args):
    """Refused before anything is measured (no table), exit status 2."""
    code, out, err = bad_option_runs[tuple(args)]
    assert code == 2, (code, out, err)
    assert "error" in err and "Traceback" not in err, err
    assert "avg us" not in out, out


@pytest.mark.mpiexec
@pytest.mark.parametrize("args", [["latency", "--modes", "mpi,nope"], ["skew", "--quorum", "9"]])
def test_bad_option_is_a_usage_error_on_every_rank(args):
    """Under mpiexec: exit status 2 on every rank, no table."""
    p = run(2, *args, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert exits(p) == {0: 2, 1: 2}, p.stderr
    assert "error" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "avg us" not in p.stdout, p.stdout


@pytest.mark.mpiexec
@pytest.mark.parametrize("command", ["latency", "skew"])
def test_help_explains_every_column(command):
    """--help (printed once, by rank 0) names every column the table can have."""
    p = run(2, command, "--help", timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("usage:") == 1, p.stdout
    text = p.stdout.split("columns:", 1)[1]
    explained = set()
    for line in text.splitlines():
        name = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0] if line.startswith("  ") and line[2] != " " else ""
        explained.update(name.replace("/", " ").split())
    from partialcoll.bench import parser
    from partialcoll.bench.latency import latency_table
    from partialcoll.bench.skew import skew_table
    args = parser().parse_args([command, "-z", "-c"])
    cols = (latency_table(args, with_mpi=True) if command == "latency" else skew_table(args)).cols
    for title, *_ in cols:
        assert title.split()[0].split("/")[0] in explained, (title, sorted(explained))
    flat = " ".join(p.stdout.split())
    assert "powers of 2" in flat and "-f" in flat and "-z" in flat and "-c" in flat
    if command == "skew":
        assert "the paper's method" in flat and "free-running" in flat


@pytest.mark.mpiexec
def test_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[test]')")
    lat, sk = tmp_path / "lat.png", tmp_path / "skew.png"
    p = run(2, "latency", "-m", "8:128", "-f", "4", "-i", "10", "-x", "1", "--plot", str(lat))
    assert p.returncode == 0, p.stderr
    p = run(2, "skew", "--skew", "uniform:0:1ms", "-i", "5", "-x", "1", "-r", "1", "--modes", "mpi,solo",
            "--plot", str(sk))
    assert p.returncode == 0, p.stderr
    for f in (lat, sk):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the pieces as pure functions (no mpiexec) ---------------------------------------------

def test_sizes_are_osu_ranges_in_powers_of_two():
    from partialcoll.bench._common import sizes
    assert sizes("8:1K", 2, 4, 8, 1 << 20) == ([2, 4, 8, 16, 32, 64, 128, 256], "")
    assert sizes("8:1K", 4, 4, 8, 1 << 20)[0] == [2, 8, 32, 128, 256]
    assert sizes("64", 2, 4, 8, 1 << 20)[0] == [2, 4, 8, 16]              # -m MAX: from the default MIN
    assert sizes("512K:", 2, 4, 8, 1 << 20)[0] == [1 << 17, 1 << 18]      # -m MIN: to the default MAX
    assert sizes("8:100", 2, 4, 8, 1 << 20)[0] == [2, 4, 8, 16, 25]       # MAX always included
    counts, note = sizes("8:64", 2, 16, 8, 8)                             # complex128: 8 B is no element
    assert counts == [1, 2, 4] and "8 B rounded down" in note
    for bad in [("0:8", 2), ("64:8", 2), ("8:1K", 1), ("x", 2)]:
        with pytest.raises(ValueError):
            sizes(bad[0], bad[1], 4, 8, 8)


def test_bandwidths_are_nccl_tests():
    from partialcoll.bench._common import bandwidths
    assert bandwidths(1 << 30, 1.0, 1) == (pytest.approx(1.073741824), 0.0)
    algbw, busbw = bandwidths(10 ** 9, 0.5, 4)
    assert algbw == 2.0 and busbw == 3.0


def test_iteration_schedule():
    from partialcoll.bench.latency import iterations, warmup
    assert [iterations(b, 1000) for b in (8, 8192, 16384, 1 << 20, 1 << 26)] == [1000, 1000, 500, 20, 20]
    assert [iterations(b, 10) for b in (8, 1 << 20)] == [10, 10]
    assert [warmup(b, 100) for b in (8, (1 << 20) - 1, 1 << 20)] == [100, 100, 3]


def _fold_run(values, rounds=5, corrupt=None):
    """Results one rank would receive: round n reads ranks [0, n % size] (the others later),
    each computed in the element type as the engine would; then close()."""
    from partialcoll.bench import _validate as v
    size = values.size
    posted = np.zeros(size, int)          # posts read so far, per rank
    out = []

    def result(reads):
        data = np.zeros(values.count, values.dtype)
        for r, (lo, hi) in enumerate(reads):
            for j in range(lo, hi):
                data = (data + values.post(r, j)).astype(values.dtype)
        return data

    for n in range(rounds):
        active = tuple(range(n % size + 1))
        reads = [(posted[r], n + 1 if r in active else posted[r]) for r in range(size)]
        posted = np.array([hi for _, hi in reads])
        out.append([n, 1, active, result(reads), False])
    out.append([rounds, 1, (), result([(posted[r], rounds) for r in range(size)]), True])
    if corrupt:
        corrupt(out)
    checker = v.Checker(values, rank=0, posts=[rounds] * size)
    for args in out:
        checker.add(*args[:4], closing=args[4])
    return checker


DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint16", "int64", "complex64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_checker_accepts_a_correct_run(dtype):
    from partialcoll.bench import _validate as v
    from partialcoll.bench._common import element_type
    checker = _fold_run(v.Values(3, 9, element_type(dtype)))
    assert (checker.wrong, checker.errors, checker.unchecked) == (0, [], 0), checker.errors
    assert checker.checked == 6 and checker.seen[4] == (5, 5, 3) and checker.seen[5] == (5, 5, 5)
    assert v.disagreement([checker.seen, dict(checker.seen)]) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("corrupt", ["value", "count", "active", "lost", "skipped_round"])
def test_checker_rejects(dtype, corrupt):
    from partialcoll.bench import _validate as v
    from partialcoll.bench._common import element_type
    values = v.Values(3, 9, element_type(dtype))

    def change(outs):
        data = outs[2][3]
        if corrupt == "value":
            data[-1] += 1                 # a reduction that is off by one
        elif corrupt == "count":          # one more post of rank 2 than was made by then
            outs[1][3] = (outs[1][3] + values.post(2, 1)).astype(values.dtype)
        elif corrupt == "active":
            outs[0][2] = (0, 1)           # claims rank 1, whose post is not in it
        elif corrupt == "lost":
            outs[-1][3][:] = 0            # close() flushes nothing
        else:
            del outs[2]                   # a round never delivered (fold would have folded it)
    checker = _fold_run(values, corrupt=change)
    assert checker.wrong >= 1 and checker.errors, (dtype, corrupt)
    if corrupt == "value":
        assert checker.wrong == 1 and "element 8" in checker.errors[0], checker.errors


def test_checker_beyond_the_exact_range():
    """bfloat16 sums past 256 may round (by at most terms x eps), integers wrap as MPI_SUM's."""
    from partialcoll.bench import _validate as v
    from partialcoll.bench._common import element_type
    bf16 = v.Values(2, 3, element_type("bfloat16"))
    expect = np.array([300.0, 300.0, 100.0])
    got = expect.astype(bf16.dtype)                         # 300 rounds to 300 (exact), ok
    assert not bf16.wrong(got, expect, 2).any()
    near = np.array([302.0, 300.0, 100.0]).astype(bf16.dtype)
    assert not bf16.wrong(near, np.array([300.0, 300.0, 100.0]), 2)[0]      # within 2 x 2^-7 x 300
    assert bf16.wrong(np.array([300.0, 300.0, 101.0]).astype(bf16.dtype), expect, 2).tolist() == [0, 0, 1]
    int8 = v.Values(2, 3, np.dtype(np.int8))
    assert not int8.wrong(np.array([44, 1, 2], np.int8), np.array([300.0, 1, 2]), 2).any()    # 300 wraps to 44
    assert int8.wrong(np.array([127, 1, 2], np.int8), np.array([300.0, 1, 2]), 2).tolist() == [1, 0, 0]


def test_checker_without_counts():
    """Fewer than P + 1 elements: results where every rank is active are checked (mpi, full);
    after one where a rank is not, the counts are unknown and the rest is unchecked."""
    from partialcoll.bench import _validate as v
    values = v.Values(4, 2, np.dtype(np.float32))
    assert not values.counted
    ok = v.Checker(values, 0, [3] * 4)
    for n in range(3):
        ok.add(n, 1, (0, 1, 2, 3), sum(values.post(r, n) for r in range(4)))
    assert (ok.wrong, ok.checked, ok.unchecked) == (0, 3, 0)
    bad = v.Checker(values, 0, [3] * 4)
    bad.add(0, 1, (0, 1, 2, 3), sum(values.post(r, 0) for r in range(3)))      # rank 3's post missing
    assert bad.wrong == 2
    partial = v.Checker(values, 0, [3] * 4)
    partial.add(0, 1, (0, 1), values.post(0, 0) + values.post(1, 0))
    partial.add(1, 1, (0, 1, 2, 3), sum(values.post(r, n) for r in range(4) for n in range(2)))
    assert (partial.wrong, partial.unchecked) == (0, 2)


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


@pytest.mark.mpiexec
def test_skew_report_and_report_command(tmp_path):
    """skew --report prints the who-is-slow table after each partial mode (none for mpi);
    --json keeps them; `report FILE --plot` reads them back and draws one."""
    out, png = tmp_path / "skew.json", tmp_path / "who.png"
    p = run(3, "skew", "--skew", "linear:2ms", "-i", "6", "-x", "1", "-r", "1", "--modes", "mpi,full,solo",
            "--report", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    heads = re.findall(r"^#   who is slow in PartialAllreduce mode=(\w+): (\d+) rounds", p.stdout, re.M)
    assert sorted(m for m, _ in heads) == ["full", "solo"], p.stdout
    tables = json.loads(out.read_text())["stats"]
    assert sorted(t["mode"] for t in tables) == ["full", "solo"] and all(t["size"] == 3 for t in tables), tables
    q = subprocess.run([*BENCH, "report", str(out), "--index", "0", "--plot", str(png)], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, **launch_env()))
    assert q.returncode == 0, q.stdout + q.stderr
    assert q.stdout.count("who is slow in PartialAllreduce") == 2, q.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([*BENCH, "report", str(tmp_path / "nothing.json")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, **launch_env()))
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
