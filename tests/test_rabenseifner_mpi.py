"""Rabenseifner's allreduce and "auto" against MPI_Allreduce under mpiexec, every mode
(tests/mpi/rabenseifner_checks.py): one job of 9 ranks checking P = 1 - 9 in turn, and
one of 24 ranks checking P = 12, 13, 16, 24 (--quick: fewer counts and rounds)."""
import pytest


@pytest.mark.mpiexec
def test_rabenseifner(mpirun):
    """P = 1 - 9 in one launch of 9 ranks (sub-communicators in turn: starting the ranks
    is most of a small check's time)."""
    mpirun("rabenseifner_checks.py", 9, "--sizes=1,2,3,4,5,6,7,8,9", timeout=300)


@pytest.mark.mpiexec
def test_rabenseifner_large_p(mpirun):
    """P = 12, 13, 16 and 24 in one launch of 24 ranks (sub-communicators in turn)."""
    mpirun("rabenseifner_checks.py", 24, "--quick", "--sizes=12,13,16,24", timeout=300)


@pytest.mark.mpiexec
def test_calibrate_caches_what_auto_reads(tmp_path):
    """partialcoll-bench calibrate at P = 2 (one node): the node's link and the engine's
    costs measured, written where model.load() finds them; the network's stay the defaults."""
    import json
    import os
    import subprocess

    from conftest import PYTHON, launch, launch_env
    from partialcoll.algorithms import model
    path = str(tmp_path / "cal.json")
    cmd = launch(2, [*PYTHON, "-m", "partialcoll.bench", "calibrate", "-i", "10", "--output", path,
                     "--json", str(tmp_path / "run.json")])
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PARTIALCOLL_TIMEOUT="120", **launch_env()))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# node (0 <-> 1): alpha" in p.stdout and f"# cached in {path}" in p.stdout, p.stdout
    q = model.load(path)
    assert q.source == path and q.alpha_node > 0 and q.beta_node > 0 and q.gamma > 0
    assert (q.alpha, q.beta) == (model.DEFAULTS.alpha, model.DEFAULTS.beta)
    assert json.load(open(tmp_path / "run.json"))["params"]["alpha_node"] == q.alpha_node
