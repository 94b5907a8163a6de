"""A cgroup with a CPU quota, for the idle policy's checks (root only).

    python tests/cgroup.py --cpus 1 -- mpiexec -n 2 python bench/idle.py

runs the command with every process inside a new cgroup limited to --cpus CPUs (v1
cpu.cfs_quota_us / cfs_period_us under /sys/fs/cgroup/cpu, or v2 cpu.max), named after
this process id, and removes the cgroup afterwards. quota_cgroup() is the same as a
context manager that yields the command prefix, or raises Unavailable saying why;
quota_group() yields the cgroup's path, which a process joins (and leaves for the one it
started in, home()) with join().
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


def _make(name: str, cpus: float, period: int = 100000) -> str:
    """The cgroup `name` of `cpus` CPUs per `period` us (a quota of at least 1 ms: the kernel's
    least); removed again if it cannot be set up."""
    v1, v2 = "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"
    if os.path.isfile(os.path.join(v1, "cpu.cfs_period_us")):
        settings = [("cpu.cfs_period_us", str(period)), ("cpu.cfs_quota_us", str(int(cpus * period)))]
        path = os.path.join(v1, name)
    elif os.path.isfile(os.path.join(v2, "cgroup.controllers")):
        settings = [("cpu.max", f"{int(cpus * period)} {period}")]
        path = os.path.join(v2, name)
    else:
        raise Unavailable("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu and no cgroup v2 at /sys/fs/cgroup")
    os.mkdir(path)
    try:
        for key, value in settings:
            with open(os.path.join(path, key), "w") as f:
                f.write(value)
    except OSError:
        os.rmdir(path)
        raise
    return path


@contextlib.contextmanager
def quota_group(cpus: float = 1, period_us: int = 100000) -> Iterator[str]:
    """A cgroup of `cpus` CPUs (a fraction is a share of one) per period_us; yields its path."""
    if os.geteuid() != 0:
        raise Unavailable("making a cgroup needs root")
    try:
        path = _make(f"partialcoll-{os.getpid()}-q{cpus:g}", cpus, period_us)
    except OSError as exc:
        raise Unavailable(f"cannot make a cgroup: {exc}") from None
    try:
        yield path
    finally:
        for _ in range(50):              # the processes may take a moment to leave
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)


@contextlib.contextmanager
def quota_cgroup(cpus: float = 1) -> Iterator[List[str]]:
    """A cgroup of `cpus` CPUs; yields the prefix that runs a command inside it."""
    with quota_group(cpus) as path:
        yield ["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh"]


def home() -> str:
    """The path of the CPU controller's cgroup this process is in (v1 cpu, else v2)."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, rel in lines:
        if "cpu" in controllers.split(","):
            return "/sys/fs/cgroup/cpu" + rel.rstrip("/")
    return "/sys/fs/cgroup" + next(rel for hid, _, rel in lines if hid == "0").rstrip("/")


def join(path: str) -> None:
    """Move this process, every thread of it, into the cgroup at path."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def main(argv: List[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", type=float, default=1)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    with quota_cgroup(a.cpus) as prefix:
        return subprocess.call(prefix + cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
