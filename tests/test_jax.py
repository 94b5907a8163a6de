"""JAX integration under mpiexec (jax_checks.py, one job per P): mpi4jax's allreduce inside
and outside jit against MPI_Allreduce (and mpi4jax where installed) for float32, float64
and bfloat16, its derivatives and vmap, partial_allreduce, the optax transformation, bad
input on every rank and a peer's failure out of a jitted call; importing partialcoll
leaves jax unimported. Skipped, with the reason printed, where jax or optax is missing."""
import os
import re

import pytest

from conftest import run_python

pytest.importorskip("jax", reason="jax is not installed (pip install -e '.[test]' installs its CPU build)")
pytest.importorskip("optax", reason="optax is not installed (pip install -e '.[test]' installs it)")

FAKECUPY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecupy")


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_jax_integration(mpirun, nprocs):
    """jax_checks.py at P; the P = 2 job also runs the GPU path on the host, with the
    stand-in CuPy of tests/fakecupy on PYTHONPATH."""
    env = {"JAX_PLATFORMS": "cpu"}
    if nprocs == 2:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [FAKECUPY, os.environ.get("PYTHONPATH")]))
    out = mpirun("jax_checks.py", nprocs, timeout=300, env=env)
    assert "test_optax_full_same_update_everywhere passed" in out


@pytest.mark.mpiexec
def test_digits_example(mpirun):
    """examples/jax_digits.py, shortened: each trainer's line with its steps/s and accuracy."""
    pytest.importorskip("sklearn", reason="the digits example loads scikit-learn's digits (pip install -e '.[test]')")
    out = mpirun("example.py", 2, "jax_digits.py", "--epochs", "1", "--batch", "64", "--slow-ms", "5", timeout=240,
                 env={"JAX_PLATFORMS": "cpu"})
    for row in ("full", "solo", "sync"):
        assert len(re.findall(rf"^{row}\b.*\s+\d+\s+[\d.]+\s+[01]\.\d+$", out, re.M)) == 1, (row, out[-2000:])


def test_import_is_lazy():
    """`import partialcoll` (and partialcoll.integrations) imports neither jax nor optax."""
    proc = run_python("""
        import sys
        import partialcoll, partialcoll.integrations
        print(sorted(m for m in ("jax", "optax", "jaxlib") if m in sys.modules))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
