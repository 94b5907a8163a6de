"""A cgroup with a CPU quota, for the idle policy's checks (root only).

    python tests/cgroup.py --cpus 1 -- mpiexec -n 2 python bench/idle.py

runs the command with every process inside a new cgroup limited to --cpus CPUs (v1
cpu.cfs_quota_us / cfs_period_us under /sys/fs/cgroup/cpu, or v2 cpu.max), named after
this process id, and removes the cgroup afterwards. quota_cgroup() is the same as a
context manager that yields the command prefix, or raises Unavailable saying why.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator, List


class Unavailable(RuntimeError):
    """No writable CPU controller here (not root, or no cgroup v1 cpu / v2 cpu.max)."""


def _make(name: str, cpus: int) -> str:
    period = 100000
    v1 = "/sys/fs/cgroup/cpu"
    if os.path.isfile(os.path.join(v1, "cpu.cfs_period_us")):
        path = os.path.join(v1, name)
        os.mkdir(path)
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(period))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(cpus * period))
        return path
    v2 = "/sys/fs/cgroup"
    if os.path.isfile(os.path.join(v2, "cgroup.controllers")):
        path = os.path.join(v2, name)
        os.mkdir(path)
        with open(os.path.join(path, "cpu.max"), "w") as f:
            f.write(f"{cpus * period} {period}")
        return path
    raise Unavailable("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu and no cgroup v2 at /sys/fs/cgroup")


@contextlib.contextmanager
def quota_cgroup(cpus: int = 1) -> Iterator[List[str]]:
    """A cgroup of `cpus` CPUs; yields the prefix that runs a command inside it."""
    if os.geteuid() != 0:
        raise Unavailable("making a cgroup needs root")
    try:
        path = _make(f"partialcoll-{os.getpid()}-q{cpus}", cpus)
    except OSError as exc:
        raise Unavailable(f"cannot make a cgroup: {exc}") from None
    try:
        yield ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh"]
    finally:
        for _ in range(50):              # the processes may take a moment to leave
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)


def main(argv: List[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    with quota_cgroup(a.cpus) as prefix:
        return subprocess.call(prefix + cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
