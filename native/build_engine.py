"""cffi build script for the native engine (out-of-line API mode).

The cdef is the block between ``CDEF BEGIN`` and ``CDEF END`` in ``pc_engine.h``:
one place declares the C API. The MPI compile and link flags come from the MPI
compiler wrapper that matches the MPI mpi4py loads:

* ``MPICC`` (environment) names the wrapper to ask, for example a cluster's own
  ``mpicc``; otherwise ``mpicc`` next to the running Python (the ``mpich`` wheel
  puts it there), otherwise ``mpicc`` on ``PATH``.
* MPICH wrappers answer ``-show``, Open MPI wrappers ``--showme``.

The extension is linked by soname (``-lmpi``) without a run path, so at run time
it binds to the ``libmpi`` that ``mpi4py.MPI`` has already loaded
(``partialcoll._engine`` imports mpi4py first).

``PARTIALCOLL_SANITIZE=address`` or ``=thread`` (environment, at install or at
``python native/build_engine.py``) builds the engine with AddressSanitizer or
ThreadSanitizer (``-fsanitize=...``, ``-g``, ``-O1``). Python itself is not built so:
its processes load the sanitizer's runtime first, with ``LD_PRELOAD`` (docs/engine.md,
"Sanitizer builds"; the suppressions for libmpi's and the interpreter's own internals
are in ``native/sanitizer.supp``).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "pc_engine.h")
UNITS = ("errors.c", "kernels.c", "mpi.c", "report.c", "sched.c", "coll.c", "progress.c", "idle.c", "waitsome.c", "mpiwait.c", "avg.c", "hop.c", "clock.c", "telemetry.c")


def cdef_source() -> str:
    text = open(HEADER).read()
    block = re.search(r"/\* CDEF BEGIN.*?\*/(.*)/\* CDEF END \*/", text, re.S)
    if not block:
        raise RuntimeError(f"{HEADER}: no CDEF BEGIN/END block")
    return block.group(1)


def find_mpicc() -> str:
    candidates = [os.environ.get("MPICC"),
                  os.path.join(os.path.dirname(sys.executable), "mpicc"),
                  shutil.which("mpicc")]
    for cand in candidates:
        if cand and (os.path.isfile(cand) or shutil.which(cand)):
            return cand
    raise RuntimeError(
        "partialcoll: no MPI C compiler wrapper found. Install the 'mpich' wheel "
        "(pip install mpich), put your MPI's mpicc on PATH, or set MPICC=/path/to/mpicc.")


def mpi_flags(mpicc: str):
    for flag in ("-show", "--showme"):
        try:
            out = subprocess.run([mpicc, flag], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        words = shlex.split(out)[1:]   # drop the compiler itself
        if words:
            break
    else:
        raise RuntimeError(f"partialcoll: '{mpicc} -show' and '{mpicc} --showme' both failed; "
                           "set MPICC to your MPI's C compiler wrapper")
    inc = [w[2:] for w in words if w.startswith("-I")]
    libdirs = [w[2:] for w in words if w.startswith("-L")]
    libs = [w[2:] for w in words if w.startswith("-l")]
    return inc, libdirs, libs or ["mpi"]


SANITIZERS = ("address", "thread")


def sanitize_flags():
    """(compile args, link args) of PARTIALCOLL_SANITIZE, or of a plain optimised build."""
    which = os.environ.get("PARTIALCOLL_SANITIZE", "").strip()
    if not which:
        return ["-O3"], []
    if which not in SANITIZERS:
        raise RuntimeError(f"partialcoll: PARTIALCOLL_SANITIZE={which!r}: use one of {', '.join(SANITIZERS)} "
                           "(or leave it unset for the optimised build)")
    flag = f"-fsanitize={which}"
    return [flag, "-g", "-O1", "-fno-omit-frame-pointer"], [flag]


def make_ffibuilder(absolute: bool = False) -> FFI:
    """The cffi builder. absolute: the sources by absolute path (a build into another
    directory, ``python native/build_engine.py --out DIR``; setuptools wants them relative)."""
    mpicc = find_mpicc()
    inc, libdirs, libs = mpi_flags(mpicc)
    ffi = FFI()
    ffi.cdef(cdef_source())
    opt, link = sanitize_flags()
    ffi.set_source(
        "partialcoll._native",
        '#include "pc_engine.h"',
        sources=[os.path.join(HERE, unit) if absolute else os.path.relpath(os.path.join(HERE, unit))
                 for unit in UNITS],
        include_dirs=[HERE] + inc,
        library_dirs=libdirs,          # link time only: no rpath is recorded
        libraries=libs + ["dl"],      # dl: dlsym for MPIX_Query_cuda_support
        extra_compile_args=opt + ["-std=gnu11", "-ffp-contract=off", "-fwrapv", "-pthread"],
        extra_link_args=link + ["-pthread"],
    )
    return ffi


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    # python native/build_engine.py: the extension into the working directory (partialcoll/,
    # an in-place build from the source tree); --out DIR: into DIR/partialcoll/ instead
    if sys.argv[1:2] == ["--out"] and len(sys.argv) == 3:
        make_ffibuilder(absolute=True).compile(tmpdir=sys.argv[2], verbose=True)
    else:
        ffibuilder.compile(verbose=True)
