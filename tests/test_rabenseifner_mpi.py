"""Rabenseifner's allreduce and "auto" against MPI_Allreduce under mpiexec, every mode
(tests/mpi/rabenseifner_checks.py): one job of 9 ranks checking P = 1 - 9 in turn (and the
quorum network's checks), and one of 16 ranks checking P = 12, 13, 16 (--quick: fewer
counts and rounds)."""
import pytest


@pytest.mark.mpiexec
def test_rabenseifner(mpirun):
    """P = 1 - 9 in one launch of 9 ranks (sub-communicators in turn: starting the ranks
    is most of a small check's time); in the same launch, the quorum through the sorting
    network in boxes at P = 2, 3, 4, 5, 8 (quorum_network_checks.py): the k-th post starts the round
    and not the (k - 1)-th, results equal the posters' values summed in the check, and with
    late="fold" MPI_Allreduce of everything posted."""
    mpirun(["rabenseifner_checks.py", "quorum_network_checks.py"], 9, "--sizes=1,2,3,4,5,6,7,8,9",
           "--quorum-sizes=2,3,4,5,8", timeout=300)


@pytest.mark.mpiexec
def test_rabenseifner_large_p(mpirun):
    """P = 12, 13 and 16 in one launch of 16 ranks (sub-communicators in turn): P - 2^k
    ranks folded in, 4 and 5 of them, and none."""
    mpirun("rabenseifner_checks.py", 16, "--quick", "--sizes=12,13,16", timeout=300)


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
