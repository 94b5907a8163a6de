"""The examples in examples/ run as the docs show them (shortened), under mpiexec, and
print what they promise: they are a user's first program, and must not rot."""
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
