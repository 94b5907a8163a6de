"""partialcoll-bench end to end under mpiexec (issue 5)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import mpiexec

BENCH = [sys.executable, "-m", "partialcoll.bench"]


def run(nprocs, *args, timeout=240):
    cmd = [mpiexec(), "-n", str(nprocs), *BENCH, *args]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PARTIALCOLL_TIMEOUT="120"))


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_latency_json_csv(tmp_path, nprocs):
    out, csv = tmp_path / "lat.json", tmp_path / "lat.csv"
    modes = "mpi,impi,full,solo,majority,probe,quorum"
    p = run(nprocs, "latency", "-m", "8:2K", "-i", "20", "-x", "2", "--modes", modes, "--json", str(out),
            "--csv", str(csv))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("# partialcoll"), p.stdout
    data = json.loads(out.read_text())
    assert [r["bytes"] for r in data["rows"]] == [8, 32, 128, 512, 2048]
    for row in data["rows"]:
        for m in modes.split(","):
            assert row[f"{m}_avg_us"] > 0 and row[f"{m}_min_us"] <= row[f"{m}_max_us"]
    assert csv.read_text().splitlines()[0].startswith("bytes,")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [3, 4])
def test_skew_json(tmp_path, nprocs):
    out = tmp_path / "skew.json"
    p = run(nprocs, "skew", "--skew", "linear:0.5ms", "-i", "10", "-x", "1", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"mpi", "impi", "solo", "majority", "probe", "quorum", "full"}
    assert rows["mpi"]["nap"] == nprocs and rows["full"]["nap"] == nprocs
    assert 1 <= rows["solo"]["nap"] <= nprocs
    assert rows["solo"]["ideal_us"] == 0 and rows["mpi"]["ideal_us"] > 0
    for r in rows.values():
        assert r["latency_us"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("args", [["latency", "--sizes", "big"], ["latency", "--modes", "mpi,nope"],
                                  ["skew", "--skew", "sideways"], ["frobnicate"], ["latency", "--bogus"]])
def test_bad_option_is_a_usage_error(args):
    p = run(2, *args, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "error" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.mpi
def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    lat, sk = tmp_path / "lat.png", tmp_path / "skew.png"
    p = run(2, "latency", "-m", "8:128", "-i", "10", "-x", "1", "--plot", str(lat))
    assert p.returncode == 0, p.stderr
    p = run(2, "skew", "--skew", "uniform:0:1ms", "-i", "5", "-x", "1", "--modes", "mpi,solo", "--plot", str(sk))
    assert p.returncode == 0, p.stderr
    for f in (lat, sk):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
