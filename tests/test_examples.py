"""The examples in examples/ run as the docs show them (shortened), under mpiexec, and
print what they promise: they are a user's first program, and must not rot."""
import math
import re

import pytest


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [1, 4])
def test_quickstart(mpirun, nprocs):
    out = mpirun("example.py", nprocs, "quickstart.py", timeout=120)
    assert re.search(r"MPI_Allreduce\s+[\d.]+ ms/step", out), out[-2000:]
    assert "nothing lost: sum checked" in out, out[-2000:]


@pytest.mark.mpiexec
@pytest.mark.parametrize("script,args,rows", [
    ("eager_sgd_hyperplane.py", ["--epochs", "2", "--steps", "8", "--delay-ms", "3", "--dim", "256"],
     ["synch-SGD", "eager-SGD solo", "eager-SGD majority"]),
    ("eager_sgd_digits.py", ["--epochs", "1", "--trainers", "synch,solo"], ["synch", "solo"]),
], ids=["hyperplane", "digits"])
def test_eager_sgd_examples(mpirun, script, args, rows):
    pytest.importorskip("torch", reason="the eager-SGD examples train with PyTorch (pip install -e '.[torch]')")
    if script == "eager_sgd_digits.py":
        pytest.importorskip("sklearn", reason="the digits example loads scikit-learn's digits (pip install -e '.[torch]')")
    out = mpirun("example.py", 3, script, *args, timeout=240)
    for row in rows:     # each trainer's line: its steps/s and speedup
        assert re.search(rf"^\s*{re.escape(row)}\s+[\d.]+\s+[\d.]+\s", out, re.M), (row, out[-2000:])



@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2])
def test_horovod_ports(mpirun, nprocs):
    """Horovod's pytorch_mnist.py and pytorch_synthetic_benchmark.py with their imports
    changed (examples/horovod/), run as they are (tests/mpi/horovod_port.py): on every rank,
    every loss the MNIST script printed (each step's, the test's) and its test accuracy
    equal those of the same script over Horovod's calls written on mpi4py's MPI_Allreduce
    (tests/mpi/_hvd_reference.py): to every printed digit at P = 2, where both sums are a + b (at
    P = 3 the two sums' order may differ in the last printed digit: run horovod_port.py by
    hand; the calls themselves are checked at P = 2, 3, 4 by horovod_checks); the synthetic benchmark (a BatchNorm CNN) prints
    Horovod's img/sec lines, and every rank ends."""
    pytest.importorskip("torch", reason="the Horovod examples train with PyTorch (pip install -e '.[torch]')")
    pytest.importorskip("sklearn", reason="small_vision loads scikit-learn's digits (pip install -e '.[torch]')")
    out = mpirun("horovod_port.py", nprocs, timeout=240)
    steps = math.ceil(math.ceil(1437 / nprocs) / 32)   # DistributedSampler's share of 1,437 digits, batches of 32
    compared = re.findall(r"COMPARED rank=(\d+) values=(\d+)/(\d+) maxdiff=(inf|[\d.]+(?:e[-+]?\d+)?)", out)
    assert sorted(int(r) for r, *_ in compared) == list(range(nprocs)), out[-3000:]
    for r, n_port, n_ref, diff in compared:
        assert int(n_port) == int(n_ref) == steps + (2 if r == "0" else 0), (r, n_port, n_ref)
        assert float(diff) <= (0.0 if nprocs == 2 else 2e-5), (r, diff)
    assert re.search(r"Img/sec per CPU: [\d.]+ \+-[\d.]+", out), out[-2000:]
    assert re.search(rf"Total img/sec on {nprocs} CPU\(s\): [\d.]+", out), out[-2000:]
