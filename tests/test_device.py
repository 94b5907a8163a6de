"""Device buffers (issue 7).

Emulated: partialcoll's device path with NumPy standing in for CuPy (tests/mpi/_devices.py)
runs everywhere, so CI covers the staging protocol; fakecupy: the real CupyBackend over a
stand-in CuPy module on host memory (tests/fakecupy), so CI runs its calls too. GPU: the
same checks with CuPy on a real GPU, skipped (not failed) where CuPy finds none; run them
on a GPU machine with `pytest -m gpu` (bench/device.sh).
"""
import importlib.util
import json
import os
import subprocess

import pytest

from conftest import PYTHON

MODES = ["solo", "majority", "probe", "quorum", "full"]


def _gpu() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy
    return bool(cupy.cuda.is_available())


GPU = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs a GPU (CuPy and a CUDA device)")]


def runs(emulated_nprocs, fake_nprocs=(), gpu_nprocs=(2, 4)):
    """(kind, nprocs) pairs: emulated and fakecupy run everywhere, cupy runs are gpu-marked."""
    return ([pytest.param("emulated", n, id=f"emulated-{n}") for n in emulated_nprocs]
            + [pytest.param("fakecupy", n, id=f"fakecupy-{n}") for n in fake_nprocs]
            + [pytest.param("cupy", n, marks=GPU, id=f"cupy-{n}") for n in gpu_nprocs])


def env_of(kind: str) -> dict:
    if kind == "fakecupy":
        fake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecupy")
        return {"PC_TEST_BUFFERS": "cupy", "PYTHONPATH": os.pathsep.join(filter(None, [fake,
                                                                             os.environ.get("PYTHONPATH")]))}
    return {"PC_TEST_BUFFERS": kind}


@pytest.mark.mpiexec
@pytest.mark.parametrize("kind,nprocs", runs([1, 2, 3, 4, 5, 8], fake_nprocs=(2, 3)))
def test_device_buffers(mpirun, kind, nprocs):
    mpirun("device_checks.py", nprocs, env=env_of(kind), timeout=300)


@pytest.mark.mpiexec
@pytest.mark.parametrize("kind,nprocs", runs([3]))
def test_partial_semantics(mpirun, kind, nprocs):
    """Issue 4's checks (nothing lost, agreement, liveness...) with device posts and results,
    every mode (one in-rank check each); at P = 3 (device_checks.py's own partial checks
    run at P = 1 - 8 in test_device_buffers)."""
    mpirun("partial_checks.py", nprocs, ",".join(MODES), "40", env=env_of(kind), timeout=600)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [pytest.param(n, marks=GPU) for n in (2, 4)])
def test_torch_cuda_tensors(mpirun, nprocs):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (torch has no CUDA device here)")
    mpirun("torch_checks.py", nprocs, env={"PC_TEST_TORCH_DEVICE": "cuda"}, timeout=300)


def test_info_names_the_gpu_path():
    out = subprocess.run([*PYTHON, "-c", "import json, partialcoll as pc; print(json.dumps(pc.info()))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["gpu_path"] == ("staging" if _gpu() else None), info
    assert info["mpi_cuda_aware"] in (True, False, None)
    assert ("CuPy" in info["buffers"]) and ("staged" in info["buffers"]) == _gpu(), info
