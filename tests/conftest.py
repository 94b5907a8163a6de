"""Test helpers: run a script of tests/mpi under mpiexec, with a timeout, and check it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def mpiexec() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(exe):
        return exe
    found = shutil.which("mpiexec")
    if not found:
        pytest.fail("mpiexec not found: install the 'mpich' wheel (pip install -e .)")
    return found


def run_mpi(script: str, nprocs: int, *args: str, timeout: float = 180, env: dict | None = None) -> str:
    """Run tests/mpi/<script> on nprocs ranks; fail with its output unless every rank passed.

    The timeout turns a deadlock into a failure. Every script prints 'PASSED <rank>'
    at its end, so a rank that died silently is caught too.
    """
    cmd = [mpiexec(), "-n", str(nprocs), sys.executable, os.path.join(HERE, "mpi", script), *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    full_env.setdefault("PARTIALCOLL_TIMEOUT", str(max(30, timeout - 30)))
    full_env.update(env or {})
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, env=full_env, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s (deadlock?)\n{out[-6000:]}")
    out = proc.stdout
    passed = len(set(re.findall(r"PASSED (\d+)", out)))     # ranks' lines may interleave
    if proc.returncode != 0 or passed != nprocs:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}, {passed}/{nprocs} ranks passed\n{out[-8000:]}")
    return out


@pytest.fixture
def mpirun():
    return run_mpi
