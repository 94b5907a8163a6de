"""Small messages and the idle policy (issue 13): the auto decision as a pure function,
rc validation, info(), and post().wait() against MPI_Allreduce under every policy."""
import os
import shutil
import subprocess

import pytest

import partialcoll as pc

from conftest import PYTHON, run_shared


_DECIDE = """
import sys, partialcoll as pc
from partialcoll._engine import ffi, lib
pc.rc.idle = sys.argv[1]
pc.allreduce_init(1, "f4").close()          # the engine runs (a singleton node is now known)
st = ffi.new("pc_idle_info *")
for ranks, cpus in eval(sys.argv[2]):
    lib.pc_engine_set_node(ffi.new("int64_t[]", max(ranks, 1)), 0, ranks, cpus)
    lib.pc_idle_state(st)
    print(ranks, cpus, "spin" if st.polling else "sleep", ffi.string(st.reason).decode())
"""


@pytest.mark.parametrize("setting", ["auto", "spin", "sleep"])
def test_auto_decision(setting):
    """auto polls where the node's ranks may use two CPUs each (an application and a
    progress thread): the engine's rule (native/idle.c), asked through its C API."""
    cases = [(1, 2, "spin"), (1, 1, "sleep"), (2, 2, "sleep"), (2, 4, "spin"), (3, 5, "sleep"),
             (8, 16, "spin"), (8, 2, "sleep"), (64, 128, "spin"), (4, 0, "sleep")]
    out = subprocess.run([*PYTHON, "-c", _DECIDE, setting, repr([c[:2] for c in cases])], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for line, (ranks, cpus, expect) in zip(out.stdout.splitlines(), cases):
        got = line.split()[2]
        assert got == (expect if setting == "auto" else setting), (ranks, cpus, line)


_BOUND = """
import time, numpy as np, partialcoll as pc
from mpi4py import MPI
pc.rc.idle = "spin"
c = pc.PartialAllreduce(2, np.float32, MPI.SUM, MPI.COMM_SELF, mode="full")
x = np.ones(2, np.float32)
def bound(pause):
    for _ in range(40):
        c.post(x).wait()
        time.sleep(pause)
    return pc.info()["spin_bound_us"]
def steps():                  # a step: four posts 1 ms apart, then a 50 ms pause
    for _ in range(12):
        for pause in (0.001, 0.001, 0.001, 0.001, 0.05):
            c.post(x).wait()
            time.sleep(pause)
    return pc.info()["spin_bound_us"]
print(bound(0.001), bound(0.03), bound(0.001), steps(), pc.rc.spin_us, pc.rc.poll_max_us)
c.close()
"""


def test_spin_bound_follows_idle_periods():
    """Polling lasts a few times the typical idle period after the last event: after 1 ms
    pauses between posts, more than spin_us and at most poll_max_us; after 30 ms pauses
    (longer than polling may last: it would run out before every next event), spin_us
    alone; then back. The events of one post (the post, the round it arms) are no idle
    period. Steps of four posts 1 ms apart and a 50 ms pause: polling follows the 1 ms
    gaps, and the pauses (a fifth of the gaps) do not stretch it towards poll_max_us
    (averaged in, they made it 16 - 20 ms: a spin that ran out at every pause)."""
    out = subprocess.run([*PYTHON, "-c", _BOUND], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    short, long_, again, steps, spin_us, poll_max = map(float, out.stdout.split())
    assert spin_us < short <= poll_max, out.stdout
    assert long_ == spin_us, out.stdout
    assert spin_us < again <= poll_max, out.stdout
    assert spin_us < steps <= poll_max / 2, out.stdout


@pytest.mark.parametrize("limits, expect", [
    ([({0, 1}, 0, "/"), ({0, 1}, 0, "/")], 2),            # two ranks sharing two cores
    ([({0}, 0, "/"), ({1}, 0, "/"), ({2, 3}, 0, "/")], 4),  # pinned ranks: the union
    ([({0, 1, 2, 3}, 1, "/a"), ({0, 1, 2, 3}, 1, "/a")], 1),  # one cgroup of 1 CPU, counted once
    ([({0, 1, 2, 3}, 1, "/a"), ({0, 1, 2, 3}, 1, "/b")], 2),  # a cgroup each
    ([({0, 1, 2, 3}, 1, "/a"), ({0, 1, 2, 3}, 0, "/")], 4),   # one rank without a quota: no cap
])
def test_node_cpus(limits, expect):
    from partialcoll._engine import node_cpus
    assert node_cpus([(frozenset(c), q, p) for c, q, p in limits]) == expect


def test_cpu_budget_follows_affinity():
    """pc.info()["cpu_budget"] is the process's CPUs: under taskset -c 0, one."""
    code = "import partialcoll as pc; print(pc.info()['cpu_budget'])"
    out = subprocess.run([*PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and int(out.stdout) == len(os.sched_getaffinity(0)), out
    if shutil.which("taskset") is None:
        pytest.skip("no taskset here")
    out = subprocess.run(["taskset", "-c", "0", *PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and int(out.stdout) == 1, out


def test_cpu_budget_follows_the_cgroup_quota():
    """Inside a cgroup with a 1-CPU quota (made here, as root), cpu_budget is 1 and auto
    sleeps, saying so; the affinity mask still lists every core."""
    from cgroup import Unavailable, quota_cgroup
    code = ("import os, partialcoll as pc; pc.rc.idle = 'auto'; pc.allreduce_init(1, 'f4').close(); i = pc.info();"
            "print(i['cpu_budget'], len(os.sched_getaffinity(0)), i['idle']); print(i['idle_reason'])")
    try:
        with quota_cgroup(1) as inside:
            out = subprocess.run([*inside, *PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    except Unavailable as exc:
        pytest.skip(str(exc))
    assert out.returncode == 0, out.stderr
    budget, affinity, idle = out.stdout.split("\n")[0].split()
    assert (int(budget), int(affinity), idle) == (1, len(os.sched_getaffinity(0)), "sleep"), out.stdout


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
            "print(i['idle'], i['idle_setting'], i['ranks_on_node'], i['cpu_budget'], i['node_cpus'])\n"
            "print(i['idle_reason'])\n")
    budget = len(os.sched_getaffinity(0))
    for want in ("spin", "sleep", "auto"):
        env = dict(os.environ, WANT=want)
        env.pop("PARTIALCOLL_IDLE", None)
        out = subprocess.run([*PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        first, reason = out.stdout.splitlines()[:2]
        active, setting, ranks, cpus, node_cpus = first.split()
        # a singleton: one rank on the node, which may use this process's CPUs
        expect = want if want != "auto" else ("spin" if 2 <= budget else "sleep")
        assert (active, setting, int(cpus)) == (expect, want, budget), out.stdout
        assert reason.startswith(expect + ":"), reason
        if want == "auto":
            assert (int(ranks), int(node_cpus)) == (1, budget), out.stdout


@pytest.mark.mpiexec
@pytest.mark.shared_job("small_checks.py")
@pytest.mark.parametrize("nprocs", [1, 2, 3, 5])
def test_small_messages_auto(mpirun, request, nprocs):
    """post(x, out=y).wait() against MPI_Allreduce, policy auto (sleep here at P >= 2)."""
    run_shared(mpirun, request, nprocs)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,idle", [(1, "spin"), (2, "sleep"), (3, "spin")])   # auto sleeps at 2, 3, 5
def test_small_messages_forced(mpirun, idle, nprocs):
    mpirun("small_checks.py", nprocs, env={"PARTIALCOLL_IDLE": idle}, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.parametrize("idle", ["spin", "sleep"])
def test_small_messages_inline(mpirun, idle):
    """The same without a progress thread: test/wait drive progress."""
    mpirun("small_checks.py", 2, env={"PARTIALCOLL_IDLE": idle, "PARTIALCOLL_PROGRESS": "inline"}, timeout=240)
