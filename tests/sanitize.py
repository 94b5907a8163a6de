"""The engine built with a sanitizer, for tests and bench runs (docs/engine.md, "Sanitizer builds").

    python tests/sanitize.py address|thread DIR     # build into DIR, print the environment

engine(which, cache) builds the engine with PARTIALCOLL_SANITIZE=which into a directory of
its own (keyed by the sources, so a later run reuses it) next to a copy of the package's
Python files; env(which, path) is what a process needs to run it: that directory first on
PYTHONPATH, the sanitizer's runtime in LD_PRELOAD (Python is not built with it), and the
options and suppressions (native/lsan.supp, native/tsan.supp: libmpi's and the
interpreter's own internals only). check_clean(which, output) fails on any report.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "native")
SANITIZERS = ("address", "thread")
RUNTIME = {"address": "libasan.so", "thread": "libtsan.so"}
# what a report starts with, per sanitizer
REPORTS = {"address": ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer"),
           "thread": ("WARNING: ThreadSanitizer", "ERROR: ThreadSanitizer")}


def runtime(which: str) -> Optional[str]:
    """The compiler's runtime library of the sanitizer (gcc's libasan.so, libtsan.so), or None."""
    cc = os.environ.get("CC", "gcc")
    try:
        path = subprocess.run([cc, f"-print-file-name={RUNTIME[which]}"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _key(which: str) -> str:
    """The sources' hash: native/ and the package's Python files (the build copies both)."""
    h = hashlib.sha256(which.encode())
    for top in (NATIVE, os.path.join(ROOT, "partialcoll")):
        for folder, dirs, files in sorted(os.walk(top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".c", ".h", ".py", ".supp")) and name != "_native.c":
                    with open(os.path.join(folder, name), "rb") as f:
                        h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def build(which: str, out: str) -> None:
    """The engine with -fsanitize=which into out/partialcoll/, beside the package's Python files."""
    pkg = os.path.join(ROOT, "partialcoll")
    shutil.copytree(pkg, os.path.join(out, "partialcoll"), dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "_native.c", "*.o"))
    env = dict(os.environ, PARTIALCOLL_SANITIZE=which)
    proc = subprocess.run([sys.executable, os.path.join(NATIVE, "build_engine.py"), "--out", out],
                          capture_output=True, text=True, env=env, cwd=out)
    if proc.returncode != 0:
        raise RuntimeError(f"the {which} sanitizer build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def engine(which: str, cache: str) -> str:
    """The directory to put first on PYTHONPATH (built unless the sources are unchanged);
    skips the calling test, saying why, where the compiler has no runtime for it."""
    if runtime(which) is None:
        pytest.skip(f"needs a sanitizer runtime: the compiler has no {RUNTIME[which]} (Debian: apt-get install gcc)")
    out = os.path.join(str(cache), _key(which))
    done = os.path.join(out, "built")
    if not os.path.exists(done):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        build(which, out)
        open(done, "w").close()
    return out


def env(which: str, path: str) -> dict:
    """What a process (each rank) needs to run the engine built at path."""
    lib = runtime(which)
    assert lib is not None
    pythonpath = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    out = {"LD_PRELOAD": lib, "PYTHONPATH": pythonpath,
           # the MPICH wheel's UCX hooks madvise and mmap (its memory events); under either
           # sanitizer's interceptors that hook crashed threads as they ended and
           # MPI_Finalize: the engine does not use UCX's memory events
           "UCX_MEM_EVENTS": "no"}
    if which == "address":
        # malloc_context_size=4: the suppressions match an allocation's first frames only,
        # so a Python frame deeper in the stack never hides an allocation of native/
        out["ASAN_OPTIONS"] = "detect_leaks=1:malloc_context_size=4:abort_on_error=0"
        out["LSAN_OPTIONS"] = f"suppressions={os.path.join(NATIVE, 'lsan.supp')}:print_suppressions=0"
    else:
        out["TSAN_OPTIONS"] = (f"suppressions={os.path.join(NATIVE, 'tsan.supp')}:print_suppressions=0:"
                               "halt_on_error=0:exitcode=66")
    return out


def reports(which: str, output: str) -> int:
    return sum(output.count(r) for r in REPORTS[which])


def check_clean(which: str, output: str) -> None:
    n = reports(which, output)
    assert n == 0, f"{n} {which} sanitizer report(s):\n{output[-12000:]}"


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in SANITIZERS:
        sys.exit(f"usage: python {sys.argv[0]} address|thread DIR")
    build(sys.argv[1], os.path.abspath(sys.argv[2]))
    for k, v in env(sys.argv[1], os.path.abspath(sys.argv[2])).items():
        print(f"export {k}={v}")
