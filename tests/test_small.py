"""Small messages and the idle policy (issue 13): the auto decision as a pure function,
rc validation, info(), and post().wait() against MPI_Allreduce under every policy."""
import os
import subprocess

import pytest

import partialcoll as pc
from partialcoll._engine import idle_policy

from conftest import PYTHON


@pytest.mark.parametrize("ranks, cores, expect", [
    (1, 2, "spin"),        # one rank: a core for the application, one for the progress thread
    (1, 1, "sleep"),       # one core: the progress thread would take it from the application
    (2, 2, "sleep"),       # this CI machine at P = 2: four threads on two cores
    (2, 4, "spin"),
    (3, 5, "sleep"),
    (8, 16, "spin"),       # one rank per GPU on a 16-core host
    (8, 2, "sleep"),       # the oversubscribed test runs
    (64, 128, "spin"),
    (None, 64, "sleep"),   # node not known yet: sleep
    (0, 4, "sleep"),
    (4, 0, "sleep"),
])
def test_auto_decision(ranks, cores, expect):
    assert idle_policy("auto", ranks, cores) == expect


@pytest.mark.parametrize("forced", ["spin", "sleep"])
@pytest.mark.parametrize("ranks, cores", [(1, 64), (64, 1), (None, 1)])
def test_forced_policy_ignores_the_node(forced, ranks, cores):
    assert idle_policy(forced, ranks, cores) == forced


def test_rc_idle_validation():
    assert pc.rc.idle == os.environ.get("PARTIALCOLL_IDLE", "auto")
    old = pc.rc.idle
    try:
        for value in ("auto", "spin", "sleep"):
            pc.rc.idle = value
            assert pc.rc.idle == value
        for bad in ("fast", "", None, 1, "Spin"):
            with pytest.raises(ValueError, match="idle must be one of 'auto', 'spin', 'sleep'"):
                pc.rc.idle = bad
        with pytest.raises(ValueError, match="idle must be one of"):
            pc.rc(idle="poll")
        assert pc.rc.idle == "sleep"                 # a rejected value changes nothing
        with pytest.raises(AttributeError, match="unknown partialcoll option 'idle_policy'"):
            pc.rc.idle_policy = "spin"
    finally:
        pc.rc.idle = old


def test_rc_idle_from_environment():
    code = "import partialcoll as pc; print(pc.rc.idle)"
    env = dict(os.environ, PARTIALCOLL_IDLE="spin")
    out = subprocess.run([*PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "spin", out
    env["PARTIALCOLL_IDLE"] = "never"
    out = subprocess.run([*PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "idle must be one of" in out.stderr, out


def test_info_reports_the_policy():
    code = ("import numpy as np, partialcoll as pc, os\n"
            "pc.rc.idle = os.environ['WANT']\n"
            "c = pc.allreduce_init(2, np.float32)\n"
            "assert c.post(np.ones(2, np.float32)).wait().data.tolist() == [1, 1]\n"
            "i = pc.info(); c.close()\n"
            "print(i['idle'], i['idle_setting'], i['ranks_on_node'], i['cores'])\n")
    cores = len(os.sched_getaffinity(0))
    for want in ("spin", "sleep", "auto"):
        env = dict(os.environ, WANT=want)
        env.pop("PARTIALCOLL_IDLE", None)
        out = subprocess.run([*PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        active, setting, ranks, ncores = out.stdout.split()
        expect = idle_policy(want, 1, cores)            # a singleton: one rank on the node
        assert (active, setting, ranks, int(ncores)) == (expect, want, "1" if want == "auto" else ranks, cores)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [1, 2, 3, 5])
def test_small_messages_auto(mpirun, nprocs):
    """post(x, out=y).wait() against MPI_Allreduce, policy auto (sleep here at P >= 2)."""
    mpirun("small_checks.py", nprocs, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.parametrize("idle", ["spin", "sleep"])
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_small_messages_forced(mpirun, idle, nprocs):
    mpirun("small_checks.py", nprocs, env={"PARTIALCOLL_IDLE": idle}, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.parametrize("idle", ["spin", "sleep"])
def test_small_messages_inline(mpirun, idle):
    """The same without a progress thread: test/wait drive progress."""
    mpirun("small_checks.py", 2, env={"PARTIALCOLL_IDLE": idle, "PARTIALCOLL_PROGRESS": "inline"}, timeout=240)
