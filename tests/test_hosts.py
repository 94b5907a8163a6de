"""A few multi-rank checks across 4 emulated hosts (network namespaces, MPICH over TCP;
tests/hosts.py), made and removed by this module: placement, every mode, MPI_Allreduce
against the engine, close with uneven posts, 1 ms link delay, cleanup by pid. Skipped,
with the reason, without root or ip netns; `pytest --hosts N` runs the whole multi-rank
suite this way."""
import os
import shutil
import subprocess
import time

import pytest

import hosts

from conftest import PYTHON

WHY = hosts.unavailable()
needs_hosts = pytest.mark.skipif(WHY is not None, reason=f"{WHY}")


def test_without_root_the_tests_skip_and_say_why():
    """pytest --hosts as a user who may not make namespaces: the multi-rank tests skip,
    and -rs prints the reason (here os.geteuid is patched to a non-root uid)."""
    code = ("import os, sys, pytest; os.geteuid = lambda: 1000; "
            "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', '--hosts', '2', "
            "'tests/test_engine.py::test_failed_execution[thread]']))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([*PYTHON, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and "1 skipped" in p.stdout and "--hosts needs root" in p.stdout, p.stdout + p.stderr


@pytest.fixture(scope="module")
def four():
    hosts.remove_stale()
    h = hosts.Hosts(4, tag=f"pch{os.getpid()}t").up()
    yield h
    h.down()


@needs_hosts
@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,ppn", [(4, 1), (3, 1), (6, 2), (5, 1)])
def test_placement_and_modes(mpirun_on, four, nprocs, ppn):
    """Ranks land on hosts in blocks of ppn (wrapping: 5 ranks on 4 hosts); every mode agrees."""
    before = four.eth0_bytes()
    mpirun_on(four, "hosts_checks.py", nprocs, str(ppn), "4", ppn=ppn, timeout=60)
    grew = [b - a for a, b in zip(before, four.eth0_bytes())]
    used = min(4, -(-nprocs // ppn))
    assert all(g > 10000 for g in grew[:used]), f"little traffic on the hosts' eth0: {grew}"


@needs_hosts
@pytest.mark.mpiexec
@pytest.mark.parametrize("script,nprocs,args", [
    ("allreduce_checks.py", 4, ("recursive_doubling,ring",)),     # "auto" picks one of them
    ("partial_checks.py", 4, ("probe", "40")),
    ("close_checks.py", 3, ("solo", "fold,latest", "1")),
    ("idle_checks.py", 4, ()),          # one rank per host: MPI sees cores to spare, auto spun
])
def test_suite_across_hosts(mpirun_on, four, script, nprocs, args):
    mpirun_on(four, script, nprocs, *args, timeout=120)


@needs_hosts
@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3])
def test_torch_store_across_hosts(mpirun_on, four, nprocs):
    """torch.distributed (gloo) under mpiexec with no MASTER_ADDR: rank 0's store is reached
    at an address of its host that the other hosts can reach (not its name's loopback)."""
    pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]' installs its CPU build)")
    mpirun_on(four, "torch_store_checks.py", nprocs, timeout=120)


@needs_hosts
@pytest.mark.skipif(shutil.which("iptables") is None,
                    reason="needs root to install iptables (--link-delay: NFQUEUE rules on the emulated switch; .ci/run installs it)")
@pytest.mark.mpiexec
def test_link_delay(mpirun_on):
    """1 ms on each host's egress: an 8 B MPI_Allreduce over 4 hosts (two exchanges) takes
    more than 2 ms, and the partial allreduce still agrees."""
    h = hosts.Hosts(4, delay="1ms", tag=f"pch{os.getpid()}d").up()
    try:
        out = mpirun_on(h, "hosts_checks.py", 4, "1", "4", "2000", timeout=90)
        assert "8 B MPI_Allreduce across hosts" in out
    finally:
        h.down()


@needs_hosts
@pytest.mark.mpiexec
def test_link_rate(mpirun_on):
    """100 Mbit/s on each host's link (tc tbf): 4 MiB between two hosts take at least ~0.3 s."""
    h = hosts.Hosts(2, rate="100mbit", tag=f"pch{os.getpid()}r").up()
    try:
        out = mpirun_on(h, "hosts_checks.py", 2, "1", "2", "0", "100", timeout=90)
        assert "Mbit/s" in out, out
    finally:
        h.down()


@needs_hosts
@pytest.mark.mpiexec
def test_cleanup_by_pid():
    """down() ends what runs inside the hosts by pid and deletes every namespace it made."""
    h = hosts.Hosts(2, tag=f"pch{os.getpid()}c").up()
    sleeper = subprocess.Popen(["ip", "netns", "exec", h.names[1], "sleep", "300"])
    try:
        for _ in range(100):             # until ip netns exec has entered the namespace
            pids = subprocess.run(["ip", "netns", "pids", h.names[1]], capture_output=True, text=True).stdout
            if str(sleeper.pid) in pids.split():
                break
            time.sleep(0.05)
        killed = h.down()
        assert sleeper.wait(5) != 0 and sleeper.pid in killed[h.names[1]], killed
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in left for name in h.names + [h.switch]), left


@pytest.fixture
def mpirun_on():
    from conftest import run_mpi

    def run(h, script, nprocs, *args, **kwargs):
        return run_mpi(script, nprocs, *args, hosts=h, **kwargs)
    return run
