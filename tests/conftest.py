"""Test helpers: run a script of tests/mpi under mpiexec, with a timeout, and check it.

pytest --hosts N [--ppn k] [--link-delay 1ms] [--link-rate 1gbit] runs those scripts
with their ranks spread over N emulated hosts (network namespaces made for the session,
MPI over TCP between them; tests/hosts.py); without root the multi-rank tests skip.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import List, Optional, Sequence, Union

import pytest

import hosts as hosts_mod
from mpi._launch import checks_argv, checks_run, failed_checks, is_check_module

HERE = os.path.dirname(os.path.abspath(__file__))

# how tests start Python: -P keeps the working directory (the source tree, whose extension
# may be built for the other MPI) off sys.path, so children import the installed partialcoll
PYTHON = [sys.executable, "-P"]


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """code (dedented) in a Python process of its own, as PYTHON starts it; its output captured."""
    return subprocess.run([*PYTHON, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)

# TCP between emulated hosts (and delay on their links) is slower than shared memory
HOSTS_TIMEOUT_FACTOR = 2.0


def pytest_addoption(parser):
    group = parser.getgroup("partialcoll", "emulated hosts (network namespaces; needs root)")
    group.addoption("--hosts", type=int, default=0, metavar="N",
                    help="run the multi-rank tests across N emulated hosts (MPI over TCP)")
    group.addoption("--ppn", type=int, default=1, metavar="k",
                    help="ranks per emulated host (default 1); past N*k ranks, hosts take more")
    group.addoption("--link-delay", default=None, metavar="D",
                    help="added one-way delay of each host's link, e.g. 1ms, 200us")
    group.addoption("--link-rate", default=None, metavar="R",
                    help="rate limit of each host's link (tc tbf), e.g. 1gbit, 100mbit")


def pytest_report_header(config):
    exe = _find_mpiexec()
    lines = [f"mpiexec: {exe} ({hosts_mod.mpi_flavour(exe)})" if exe else "mpiexec: not found"]
    n = config.getoption("--hosts")
    if n:
        lines.append(f"emulated hosts: {n} (ppn {config.getoption('--ppn')}, "
                     f"delay {config.getoption('--link-delay') or 0}, rate {config.getoption('--link-rate') or '-'})")
    return lines


# What a skip may need, after the README's install (pip install -e ".[test]"): each skip reason
# names one of these; the summary counts them and lists any other skip as unexpected.
SKIP_NEEDS = ("needs a GPU", "needs root", "needs the second MPI's environment", "needs a sanitizer runtime")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


# In-rank checks that skipped inside a job that passed (a check that needs two ranks at
# P = 1, one that runs at one P only): (job, P, check), listed in the summary.
INRANK_SKIPS: list = []


def pytest_terminal_summary(terminalreporter):
    """One line on what was skipped and why: a GPU, root, the second MPI, or anything else
    (which the README's install should have made unnecessary); and the in-rank checks that
    skipped where they cannot run (each runs in another job)."""
    if INRANK_SKIPS:
        names = sorted({name.split("[", 1)[0] for _, _, name in INRANK_SKIPS})
        terminalreporter.write_sep("-", f"{len(INRANK_SKIPS)} in-rank skips (a check at a P or in a mode "
                                        f"it does not run in; it runs in another job): {', '.join(names)}")
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "when", None)]
    if not skipped:
        return
    counts = {need: 0 for need in SKIP_NEEDS}
    other = []
    for report in skipped:
        reason = _skip_reason(report)
        need = next((n for n in SKIP_NEEDS if n in reason), None)
        if need:
            counts[need] += 1
        else:
            other.append(f"{report.nodeid}: {reason}")
    parts = [f"{n} need{'s' if n == 1 else ''} {need[len('needs '):]}" for need, n in counts.items() if n]
    if other:
        parts.append(f"{len(other)} for other reasons")
    terminalreporter.write_sep("-", "skipped: " + ", ".join(parts))
    for line in other:
        terminalreporter.write_line(f"unexpected skip (install with pip install -e '.[test]'): {line}")


def _find_mpiexec() -> Optional[str]:
    """This environment's mpiexec (beside the Python running the tests), else PATH's."""
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return exe if os.path.exists(exe) else shutil.which("mpiexec")


def mpiexec() -> str:
    found = _find_mpiexec()
    if not found:
        pytest.fail("mpiexec not found: install the 'mpich' wheel (pip install -e .)")
    return found


def mpi_flavour() -> str:
    """'openmpi' or 'mpich': which MPI's mpiexec the tests launch."""
    return hosts_mod.mpi_flavour(mpiexec())


def launch(nprocs: int, argv: List[str], extra: Optional[List[str]] = None, keep_going: bool = False) -> List[str]:
    """The mpiexec command line for nprocs ranks of argv on this node, for either MPI.

    keep_going: the job outlives a rank that dies (hosts.keep_going_flags), so the
    survivors can report it. Open MPI also needs leave to
    oversubscribe the node's cores and not to bind every rank to one core.
    """
    exe = mpiexec()
    flags = ["--map-by", ":OVERSUBSCRIBE", "--bind-to", "none"] if mpi_flavour() == "openmpi" else []
    going = hosts_mod.keep_going_flags(exe) if keep_going else []
    return [exe, *flags, *going, *(extra or []), "-n", str(nprocs), *argv]


def launch_env() -> dict:
    """What the launched ranks need beyond os.environ, for either MPI.

    Open MPI: run as root where CI does; and its AVX reduction kernels saturate 8- and
    16-bit integer sums (open-mpi/ompi#8045) where MPI_SUM wraps, as ours and MPICH's do,
    so the comparisons with MPI_Allreduce use its plain C kernels.
    """
    if mpi_flavour() != "openmpi":
        return {}
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_op": "^avx"}


def _output(exc_out) -> str:
    return exc_out.decode(errors="replace") if isinstance(exc_out, bytes) else (exc_out or "")


def run_mpi(script: Union[str, Sequence[str]], nprocs: int, *args: str, timeout: float = 180,
            env: dict | None = None, hosts=None, ppn: Optional[int] = None, mpiexec_args: Optional[list] = None,
            expect_passed: Optional[int] = None, keep_going: bool = False,
            select: Optional[Sequence[str]] = None) -> str:
    """Run tests/mpi/<script> on nprocs ranks; fail with its output unless every rank passed.

    script: a script, or a list of check modules run in one job (one in-rank pytest session,
    the modules in turn, with the same args): each rank starts Python, NumPy, mpi4py and
    the engine once for all of them, which is most of a small check's time.

    The timeout turns a deadlock into a failure. Every script prints 'PASSED <rank>'
    at its end, so a rank that died silently is caught too (expect_passed: how many
    ranks must pass, when some are meant to die; keep_going: the job outlives a dead
    rank, see launch()). hosts (tests/hosts.Hosts): spread the
    ranks over emulated hosts, ppn per host (default: the hosts' own). select: the names of
    the only checks to run (pytest's -k in every rank); the job fails unless exactly those
    ran, each passing on every rank.
    """
    paths = [os.path.join(HERE, "mpi", s) for s in ([script] if isinstance(script, str) else script)]
    checks = all(is_check_module(path) for path in paths)
    if len(paths) > 1 and not checks:
        pytest.fail(f"only check modules (X_checks.py) run together in one job: {script}")
    if select and not checks:
        pytest.fail(f"select= chooses checks of check modules (X_checks.py): {script}")
    if checks and importlib.util.find_spec("pytest_mpi") is None:
        pytest.fail("the in-rank checks run under pytest-mpi, which is not installed: pip install -e '.[test]'")
    argv = [sys.executable, *(checks_argv(paths, args, select) if checks else [paths[0], *args])]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **launch_env())
    if hosts is not None:
        timeout *= HOSTS_TIMEOUT_FACTOR
        cmd = hosts.mpiexec(mpiexec(), nprocs, argv, extra=mpiexec_args, ppn=ppn, keep_going=keep_going)
        full_env.update(hosts.env())
    else:
        cmd = launch(nprocs, argv, extra=mpiexec_args, keep_going=keep_going)
    full_env.setdefault("PARTIALCOLL_TIMEOUT", str(max(30, timeout - 30)))
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)                 # mpiexec and every rank it started here
        out, _ = proc.communicate()
        if hosts is not None:
            hosts.reap()                 # ranks on the other emulated hosts
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s (deadlock?)\n{_output(out)[-6000:]}")
    passed = len(set(re.findall(r"PASSED (\d+)", out)))     # ranks' lines may interleave
    want = nprocs if expect_passed is None else expect_passed
    if (proc.returncode != 0 and expect_passed is None) or passed != want:
        if hosts is not None:
            hosts.reap()
        checks = failed_checks(out)
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}, {passed}/{want} ranks passed"
                    + (f"\nfailed checks: {checks}" if checks else "") + f"\n{out[-8000:]}")
    INRANK_SKIPS.extend((os.path.basename(paths[0]), nprocs, name)
                        for name in sorted(set(re.findall(r"CHECK (\S+) skipped rank=0 ", out))))
    if select:
        ran = {name.split("[", 1)[0]: ranks for name, ranks in checks_run(out).items()}
        if set(ran) != set(select) or any(len(r) != want for r in ran.values()):
            pytest.fail(f"asked for the checks {sorted(select)}, ran {sorted(ran.items())}\n{out[-8000:]}")
    return out


# -- jobs shared by several test modules --------------------------------------------------
# Check modules that run at a P with no arguments or environment of their own share one
# launch per P: the ranks start (Python, NumPy, mpi4py, the engine, pytest) once for all of
# them, which is most of a small module's time. A test marked shared_job("x_checks.py"),
# parametrized by nprocs, calls run_shared: the first such test at a P runs the modules of
# every shared_job test the session collected at that P (a -k or a node id that selects one
# test runs its module alone), the others read the outcome. --durations shows the job's
# time on the first test at each P.
SHARED_MODULES: dict = {}       # nprocs -> [module, ...] of the session's shared_job tests
SHARED_TIMEOUT = 900            # the whole job at one P (a deadlock guard: each module had 120-400 s alone)
_shared_outcome: dict = {}      # nprocs -> (modules, failure text or None)


@pytest.hookimpl(trylast=True)          # after -k and -m deselected theirs
def pytest_collection_modifyitems(config, items):
    for item in items:
        mark = item.get_closest_marker("shared_job")
        callspec = getattr(item, "callspec", None)
        if mark and callspec is not None:
            modules = SHARED_MODULES.setdefault(callspec.params["nprocs"], [])
            if mark.args[0] not in modules:
                modules.append(mark.args[0])
        mark = item.get_closest_marker("background")
        if mark:
            start_background(mark.args[0], mark.args[1])


# -- CPU-only checks in the background ------------------------------------------------------
# A test marked background(name, argv) (mypy, sphinx-build: seconds of CPU each, no MPI, no
# timing) has its command started when the session has collected it, at the lowest CPU
# priority (nice 19: it takes the cores the multi-rank tests leave idle while they wait,
# and next to nothing from a busy one); the test then reads its outcome with
# background_result (exit status, output, and the directory that "{tmp}" in argv names).
_background: dict = {}          # name -> (Popen, output file, its directory)


def start_background(name: str, argv: Sequence[str]) -> None:
    if name in _background:
        return
    import tempfile
    where = tempfile.mkdtemp(prefix=f"pc-{name}-")
    out = open(os.path.join(where, "output"), "w+")
    proc = subprocess.Popen([a.replace("{tmp}", where) for a in argv], cwd=os.path.dirname(HERE),
                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: os.nice(19))
    _background[name] = (proc, out, where)


def background_result(request, timeout: float):
    """(exit status, output, directory) of request's test's background command (started at
    collection, or here if it was not), waiting for it at most timeout seconds."""
    name, argv = request.node.get_closest_marker("background").args
    start_background(name, argv)
    proc, out, where = _background[name]
    if proc.poll() is None:         # the test waits for it now: its usual priority back (where allowed)
        try:
            os.setpriority(os.PRIO_PGRP, proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
        except OSError:
            pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        pytest.fail(f"{' '.join(argv)} took more than {timeout} s")
    out.seek(0)
    return proc.returncode, out.read(), where


def pytest_sessionfinish(session):
    for proc, out, where in _background.values():
        if proc.poll() is None:                     # its test did not run (-x, a failure)
            _end_group(proc)
        out.close()
        shutil.rmtree(where, ignore_errors=True)


def run_shared(mpirun, request, nprocs: int) -> None:
    """The shared job at nprocs (see SHARED_MODULES) has run, once, and every rank passed
    every check of every module in it: request's test fails otherwise, naming the failed
    checks (a failed check stops the job: the modules after it did not run)."""
    module = request.node.get_closest_marker("shared_job").args[0]
    if nprocs not in _shared_outcome:
        modules = SHARED_MODULES.get(nprocs) or [module]
        try:
            mpirun(modules, nprocs, timeout=SHARED_TIMEOUT)
            _shared_outcome[nprocs] = (modules, None)
        except pytest.fail.Exception as exc:
            _shared_outcome[nprocs] = (modules, str(exc))
    modules, failure = _shared_outcome[nprocs]
    assert module in modules, (module, modules)
    if failure is not None:
        pytest.fail(f"the shared job at P = {nprocs} ({', '.join(modules)}) failed:\n{failure}")


def _end_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(2)
            return
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="session")
def emulated_hosts(request):
    """The session's emulated hosts (tests/hosts.py), or None without --hosts; skips
    the tests that use it, with the reason, where they cannot be made."""
    n = request.config.getoption("--hosts")
    if not n:
        yield None
        return
    why = hosts_mod.unavailable()
    if why:
        pytest.skip(why)
    hosts_mod.remove_stale()
    made = hosts_mod.Hosts(n, request.config.getoption("--ppn"), request.config.getoption("--link-delay"),
                           request.config.getoption("--link-rate"))
    try:
        made.up()
    except RuntimeError as exc:
        pytest.skip(f"could not make {n} emulated hosts: {exc}")
    try:
        yield made
    finally:
        made.down()


@pytest.fixture
def mpirun(emulated_hosts):
    if emulated_hosts is None:
        return run_mpi

    def run(script: str, nprocs: int, *args: str, **kwargs) -> str:
        return run_mpi(script, nprocs, *args, hosts=emulated_hosts, **kwargs)
    return run
