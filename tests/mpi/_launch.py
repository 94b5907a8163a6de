"""How every rank starts pytest on a check module (no MPI here: the test process imports it too)."""
from __future__ import annotations

import os
import re
import shlex

# pytest-mpi's --with-mpi (its plugin loaded by name, so also where plugin autoloading is off);
# plain and fast: output not captured (-s), no cache, no hypothesis plugin, no terminal
# output (conftest.py reports each check with its rank)
PYTEST_FLAGS = ["-p", "pytest_mpi", "--with-mpi", "-s", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                "-p", "no:terminal", "-o", "addopts="]


def is_check_module(path: str) -> bool:
    """X_checks.py files are pytest modules; other scripts under tests/mpi run plainly."""
    return os.path.basename(path).endswith("_checks.py")


def checks_args(path, args, select=None) -> list:
    """pytest's arguments on every rank: the check module at path (or the modules of a list
    of paths, one pytest session: each rank starts once for all of them) with args (the
    modules' own, _util.ARGS); select: the names of the only checks to run (pytest's -k)."""
    paths = [path] if isinstance(path, str) else path
    chosen = ["-k", " or ".join(select)] if select else []
    return [*PYTEST_FLAGS, *chosen, *map(os.path.abspath, paths), f"--check-args={shlex.join(args)}"]


def checks_run(out: str) -> dict:
    """{check name: set of ranks} of every check that reported passing in the ranks' output."""
    ranks: dict = {}
    for name, rank in re.findall(r"CHECK (\S+) passed rank=(\d+)", out):
        ranks.setdefault(name, set()).add(int(rank))
    return ranks


def failed_checks(out: str) -> str:
    """'name on ranks [..]; ...' for every check that failed in the ranks' output (conftest.py)."""
    ranks: dict = {}
    for name, rank in re.findall(r"CHECK (\S+) FAILED rank=(\d+)", out):
        ranks.setdefault(name, set()).add(int(rank))
    return "; ".join(f"{name} on ranks {sorted(r)}" for name, r in ranks.items())


def checks_argv(path, args, select=None) -> list:
    """The argv after python, for every rank; -P: the working directory (maybe a source tree
    whose extension was built for another MPI) does not shadow the installed partialcoll."""
    return ["-P", "-m", "pytest", *checks_args(path, args, select)]
