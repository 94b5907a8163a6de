"""In-rank pytest: every rank of ``mpiexec -n P python -m pytest --with-mpi tests/mpi/X_checks.py``
runs the module's checks (its ``test_*`` functions, in file order, ``comm`` = COMM_WORLD).

pytest-mpi (in the test extra) provides the conventions: its ``--with-mpi`` flag (without it
these checks skip: every item here carries its ``mpi`` marker), ``@pytest.mark.mpi(min_size=k)``
for a check that needs k ranks, and its ``mpi_tmp_path`` fixture. This plugin adds what a
multi-rank run needs and pytest-mpi leaves out:

- every rank reports every check by name: ``CHECK <name> <outcome> rank=<r> <seconds>s``,
  and a failure's traceback with its rank;
- after each check the ranks agree (a non-blocking allgather on a private communicator)
  on who failed it; if any did, every rank stops there, so no rank goes on into the next
  check's collectives alone. A rank that failed while others are stuck in the check
  (waiting for it) gives them a grace period, then aborts the job: a failure never hangs;
- ``PASSED <rank>`` at the end when every check passed on every rank (what
  tests/conftest.py's run_mpi counts), after ``partialcoll.finalize()``;
- ``--check-args "solo 200"``: the module's arguments (mode, rounds...), as ``_util.ARGS``;
- the ``comm`` fixture (COMM_WORLD).

Plain ``pytest`` never collects these modules (they are not ``test_*.py``); the tests in
tests/test_*.py launch them through run_mpi.
"""
from __future__ import annotations

import os
import shlex
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# a failed rank waits this long for the others to end the check (PC_CHECKS_GRACE seconds)
GRACE_S = float(os.environ.get("PC_CHECKS_GRACE", "10"))


def pytest_addoption(parser):
    group = parser.getgroup("mpi", "in-rank checks under mpiexec (tests/mpi)")
    group.addoption("--check-args", default="", metavar="ARGS",
                    help="the check module's arguments, e.g. 'solo 200' (its MODE, ROUNDS...)")


def _has_pytest_mpi(config) -> bool:
    return config.pluginmanager.hasplugin("pytest_mpi")


def _testing_mpi(config) -> bool:
    """pytest-mpi's --with-mpi (or --only-mpi) was given (without pytest-mpi, pytest itself
    rejects --with-mpi as an unknown option)."""
    return _has_pytest_mpi(config) and bool(config.getoption("--with-mpi") or config.getoption("--only-mpi"))


class _Ranks:
    """The plugin of one rank: reports, the per-check agreement, PASSED."""

    def __init__(self):
        from mpi4py import MPI
        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.agree = self.world.Dup()        # never matches a check's own messages
        self.rank, self.size = self.world.rank, self.world.size
        self.failed: list = []              # (name, ranks) of checks that failed somewhere

    def say(self, line: str) -> None:
        sys.stdout.write(line + "\n")          # one write: ranks' lines interleave whole
        sys.stdout.flush()

    def say_failed(self, name: str, when: str, text: str) -> None:
        self.say(f"CHECK {name} FAILED rank={self.rank} ({when})\n"
                 + "\n".join(f"[rank {self.rank}] {line}" for line in text.splitlines()))

    def abort(self) -> None:
        # The launcher forwards each rank's output on its own (across hosts through a proxy
        # per host), and MPI_Abort tears that down: give the last lines time to get out
        # (pytest --hosts 4 lost the "aborting the job" line once in a whole-suite run).
        time.sleep(0.5)
        self.world.Abort(1)
        os._exit(1)                         # MPICH's MPI_Abort can return before the job ends

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        item._pc_failed = False
        yield
        self.settle(item)

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::", 1)[-1]
        if report.failed:
            self.say_failed(name, report.when, report.longreprtext)
        elif report.when == "call" or (report.skipped and report.when == "setup"):
            self.say(f"CHECK {name} {report.outcome} rank={self.rank} {report.duration:.2f}s")

    def pytest_collectreport(self, report):
        if report.failed:                   # e.g. the module does not import
            self.say_failed(report.nodeid, "collect", report.longreprtext)

    def pytest_runtest_makereport(self, item, call):
        if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
            item._pc_failed = True

    def settle(self, item) -> None:
        """Every rank learns who failed item; stop everywhere if anyone did."""
        flags = bytearray(self.size)
        req = self.agree.Iallgather([bytearray([item._pc_failed]), self.MPI.BYTE], [flags, self.MPI.BYTE])
        deadline = time.monotonic() + GRACE_S
        while not req.Test():
            if item._pc_failed and time.monotonic() > deadline:
                self.say(f"CHECK {item.name}: rank {self.rank} failed it and the others did not end it "
                         f"within {GRACE_S:.0f} s (waiting for this rank?): aborting the job")
                self.abort()
            time.sleep(0.0005)      # never spin a shared core
        bad = [r for r, f in enumerate(flags) if f]
        if bad:
            self.failed.append((item.name, bad))
            item.session.shouldstop = f"{item.name} failed on ranks {bad}"

    def pytest_sessionfinish(self, session, exitstatus):
        if self.failed or exitstatus != 0:
            what = "; ".join(f"{name} on ranks {ranks}" for name, ranks in self.failed) or f"exit status {exitstatus}"
            self.say(f"CHECKS FAILED rank={self.rank}: {what}")
            # the failed check may have left collectives open: MPI_Finalize could wait on them
            self.abort()
        if "partialcoll" in sys.modules:
            sys.modules["partialcoll"].finalize()
        self.say(f"PASSED {self.rank}")


def pytest_configure(config):
    if HERE not in sys.path:
        sys.path.insert(0, HERE)             # the modules import _util, _data as top-level modules
    if not _testing_mpi(config):
        return
    import _util
    _util.ARGS[:] = shlex.split(config.getoption("--check-args"))
    config.pluginmanager.register(_Ranks(), "partialcoll-ranks")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every check here runs inside an MPI job: pytest-mpi's mpi marker, so that pytest-mpi
    skips it without --with-mpi (tryfirst: before pytest-mpi's own hook looks)."""
    mark = pytest.mark.mpi if _has_pytest_mpi(config) else pytest.mark.skip(
        reason="in-rank check: needs pytest-mpi (pip install -e '.[test]') and mpiexec -n P python -m pytest --with-mpi")
    for item in items:
        if str(item.path).startswith(HERE + os.sep):     # a hook of every item in the session
            item.add_marker(mark)


@pytest.fixture(scope="session")
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD
