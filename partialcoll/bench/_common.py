"""Shared by the benchmark commands: options, sizes, element types, modes, the collective
behind each mode, and the columns every table has."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

import partialcoll as pc

from ..algorithms import ALGORITHMS, check_algorithm
from .._types import as_dtype, check_op_dtype, dtype_code, dtype_name, op_code

MODES = ("mpi", "impi", "full", "solo", "majority", "probe", "quorum")
REFERENCE_MODES = ("mpi", "impi")        # MPI_Allreduce and MPI_Iallreduce: MPI's own
EVERYONE_MODES = ("mpi", "impi", "full")  # every round has every rank's post
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}

# What every table's shared columns mean (each command's --help adds its own).
COLUMNS_HELP = """\
  size          message size in bytes: count x the element size
  count         elements per rank
  type          element type (--dtype)
  mode          mpi: MPI_Allreduce; impi: MPI_Iallreduce, waited in a sleeping test loop;
                full: partialcoll's persistent allreduce (every rank in every round);
                solo, majority, probe, quorum: partial allreduces (see --modes)
  iters         timed iterations per rank at this size
  P50/P90/P99   (-z) latency percentiles over the iterations of the per-iteration
                mean over ranks (OSU's tail latency)
  algbw         size / avg latency, in GB/s (10^9 B/s): nccl-tests' algorithm bandwidth
  busbw         algbw x 2(P-1)/P: nccl-tests' bus bandwidth of an allreduce (what each
                rank's link carries in a ring); for partial modes the same formula, as if
                every rank took part
  NAP           mean number of active processes: ranks whose post the round included
                (P for mpi, impi and full)
  #wrong        (-c) wrong elements, summed over ranks and over every result checked
                (warm-up included); '-' where a mode could not be checked at that size
                (partial modes need count >= P + 1: one element per rank counts its posts)
"""


def parse_bytes(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if value < 0 or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} (use e.g. 8, 64K, 16M)")
    return int(value * _UNITS[unit])


def sizes(spec: str, factor: int, itemsize: int, default_min: int, default_max: int) -> Tuple[List[int], str]:
    """OSU's -m [MIN:]MAX ('MIN:' too), stepped by factor (nccl-tests' -f): MIN, MIN*f,
    MIN*f^2 ... while below MAX, then MAX. Returns (counts in elements, a note where a size
    was not a whole number of elements: rounded down, at least one element)."""
    lo_text, colon, hi_text = spec.partition(":")
    if not colon:
        lo_text, hi_text = "", lo_text
    lo = parse_bytes(lo_text) if lo_text.strip() else min(default_min, parse_bytes(hi_text) if hi_text.strip() else default_min)
    hi = parse_bytes(hi_text) if hi_text.strip() else max(default_max, lo)
    if lo < 1 or hi < lo:
        raise ValueError(f"bad size range {spec!r} (MIN:MAX with 1 <= MIN <= MAX, e.g. 8:1M)")
    if factor < 2:
        raise ValueError(f"-f/--factor must be an integer >= 2, not {factor}")
    wanted, s = [], lo
    while s < hi:
        wanted.append(s)
        s *= factor
    wanted.append(hi)
    counts: List[int] = []
    for nbytes in wanted:
        count = max(1, nbytes // itemsize)
        if count not in counts:
            counts.append(count)
    odd = [b for b in wanted if b % itemsize]
    note = (f"sizes are whole elements of {itemsize} B: {', '.join(map(str, odd))} B rounded down (at least one)"
            if odd else "")
    return counts, note


def modes(spec: str) -> List[str]:
    out = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise ValueError(f"unknown mode(s) {bad}; choose from {','.join(MODES)}")
    return out


def element_type(text: str) -> np.dtype:
    """--dtype as a NumPy dtype the library sums, or a ValueError/TypeError saying why not."""
    dt = as_dtype(text)
    if dtype_name(dt) == "bfloat16" and dt.metadata:
        raise ValueError("--dtype bfloat16 needs ml_dtypes for its values (pip install ml-dtypes)")
    dtype_code(dt)                              # a dtype the engine knows
    check_op_dtype(op_code(MPI.SUM), dt)        # and MPI_SUM is defined on it
    return dt


def type_name(dt: np.dtype) -> str:
    return "bfloat16" if dtype_name(dt) == "bfloat16" else dt.name


def reference_unsupported(dt: np.dtype) -> Optional[str]:
    """Why this MPI's MPI_Allreduce cannot sum dt (None: it can). A probe on COMM_SELF:
    mpi4py may have no MPI datatype for it (bfloat16), or the MPI no MPI_SUM on it."""
    x = np.zeros(1, dt)
    y = np.empty_like(x)
    vendor, version = MPI.get_vendor()
    library = f"{vendor} {'.'.join(map(str, version))}"
    try:
        MPI.COMM_SELF.Allreduce(x, y)
    except MPI.Exception as exc:
        return f"{library} has no MPI_SUM for {type_name(dt)} ({exc.Get_error_string().splitlines()[0]})"
    except (BufferError, ValueError, KeyError, TypeError):
        return f"{library} has no MPI datatype for {type_name(dt)} (mpi4py cannot pass it to MPI)"
    return None


def runnable_modes(mode_list: List[str], dt: np.dtype, column: str) -> Tuple[List[str], List[str], str]:
    """(modes to run, mpi/impi skipped, the note saying why) for element type dt."""
    cannot = reference_unsupported(dt)
    skipped = [m for m in mode_list if m in REFERENCE_MODES] if cannot else []
    if not skipped:
        return mode_list, [], ""
    note = f"{', '.join(skipped)} skipped: {cannot}; no {column} column"
    left = [m for m in mode_list if m not in skipped]
    if not left:
        raise ValueError(f"no mode left to run: {note}")
    return left, skipped, note


def add_common_args(p, *, sizes: str, iterations: int, warmup: int, mode_list: str) -> None:
    """The options every command takes (OSU's and nccl-tests' letters where they have one)."""
    p.add_argument("-m", "--sizes", default=sizes, metavar="[MIN:]MAX",
                   help=f"message sizes in bytes, as OSU's -m: MIN, MIN*F, MIN*F^2 ... below MAX, then MAX "
                        f"(F: -f, default 2: powers of 2); K, M, G suffixes (default {sizes})")
    p.add_argument("-f", "--factor", type=int, nargs="?", const=2, default=2, metavar="F",
                   help="multiply the size by F from one size to the next, as nccl-tests' -f (default 2). "
                        "Without F: OSU's -f (--full), whose min, max and iterations columns are always shown")
    p.add_argument("-i", "--iterations", type=int, default=iterations, help=f"timed iterations (default {iterations})")
    p.add_argument("-x", "--warmup", type=int, default=warmup,
                   help=f"untimed warm-up iterations before each timed loop (default {warmup})")
    p.add_argument("--modes", default=mode_list,
                   help=f"comma list of {','.join(MODES)} (default {mode_list}). mpi and impi run only where "
                        "the MPI can sum --dtype: else they are skipped, with a note")
    p.add_argument("--algorithm", default="auto", help=f"auto, {', '.join(ALGORITHMS)}")
    p.add_argument("--dtype", default="float32",
                   help="element type: any the library sums, e.g. float32, float64, float16, bfloat16, int8, "
                        "uint64, complex64 (default float32)")
    p.add_argument("--quorum", type=int, default=None, help="k for mode quorum (default P/2)")
    p.add_argument("--candidates", type=int, default=2, help="q for mode probe (default 2)")
    p.add_argument("--late", choices=("latest", "fold"), default=None,
                   help="what a late post returns in partial modes (default latest; fold with -c)")
    p.add_argument("-z", "--tail", action="store_true", help="add P50, P90 and P99 latency columns (OSU's -z)")
    p.add_argument("-c", "--validate", action="store_true",
                   help="check every result against the values expected from data that differs per rank, per "
                        "element and per post (partial modes with late='fold': every post counted exactly "
                        "once); adds #wrong; exit status 1 on every rank if any element is wrong")


def check_common(args, size: int) -> Tuple[int, str]:
    """Validate the shared numeric options; returns (quorum, late)."""
    if args.iterations < 1 or args.warmup < 0:
        raise ValueError("-i/--iterations must be >= 1 and -x/--warmup >= 0")
    quorum = args.quorum or max(1, size // 2)
    if not 1 <= quorum <= size:
        raise ValueError(f"--quorum must be in 1..{size}, not {quorum}")
    if args.candidates < 1:
        raise ValueError("--candidates must be >= 1")
    check_algorithm(args.algorithm)
    if args.validate and args.late == "latest":
        raise ValueError("-c needs late='fold' (with 'latest' a late rank skips rounds' data, so nothing "
                         "can be checked to add up); leave --late out or pass --late fold")
    return quorum, args.late or ("fold" if args.validate else "latest")


def bandwidths(nbytes: int, seconds: float, size: int) -> Tuple[float, float]:
    """(algbw, busbw) in GB/s, as nccl-tests defines them for an allreduce."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else float("nan")
    return algbw, algbw * 2 * (size - 1) / size


def percentile(values: Sequence[float], pct: float) -> float:
    """OSU's tail latency: the value at round(n * pct / 100) - 1 of the sorted samples."""
    v = np.sort(np.asarray(values))
    return float(v[max(0, min(len(v) - 1, int(round(len(v) * pct / 100)) - 1))])


TAIL = (50, 90, 99)


def data(count: int, dtype, rank: int) -> np.ndarray:
    """Values that differ per rank and per element (small: exact in every type)."""
    return ((np.arange(count) % 7) + rank % 7).astype(dtype)


def as_buffers(x: np.ndarray, buffers: str):
    """x where the benchmark's buffers live: host (NumPy) or cupy (the GPU)."""
    if buffers == "host":
        return x
    from .._device import cupy_backend
    return cupy_backend().cp.asarray(x)          # a clear error without CuPy or a GPU


def fill(x, values: np.ndarray) -> None:
    """x[:] = values, for a host or a device buffer."""
    if isinstance(x, np.ndarray):
        x[:] = values
    else:
        x.set(values)


def to_numpy(y) -> np.ndarray:
    return y if isinstance(y, np.ndarray) else y.get()


class Collective:
    """One mode behind one interface: call(x, y) -> nap, call_result(x, y) -> (Result, late),
    close().

    With device buffers, mpi and impi are what a user of a MPI that is not CUDA-aware
    writes: copy to pinned host memory, MPI_Allreduce, copy back.
    """

    def __init__(self, mode: str, count: int, dtype, comm, algorithm: str, quorum: int, candidates: int,
                 seed: int = 0, buffers: str = "host", late: str = "latest"):
        self.mode, self.comm = mode, comm
        self.staged = None
        self.calls = 0
        self.everyone = tuple(range(comm.size))
        if mode in REFERENCE_MODES:
            self.coll = None
            if buffers != "host":
                import cupyx
                self.staged = (cupyx.empty_pinned(count, dtype), cupyx.empty_pinned(count, dtype))
            return
        kw: Dict[str, Any] = ({"quorum": quorum} if mode == "quorum" else
                              {"candidates": candidates} if mode == "probe" else {})
        self.coll = pc.PartialAllreduce(count, dtype, MPI.SUM, comm, mode=mode, algorithm=algorithm, seed=seed,
                                        late=late, **kw)

    def call(self, x, y) -> int:
        """One blocking allreduce of x into y; the number of active processes."""
        if self.coll is None:
            self._mpi(x, y)
            return self.comm.size
        return self.coll.post(x, out=y).wait().nap

    def call_result(self, x, y):
        """(result, late): the Result of post(x, out=y).wait() and whether the post was late;
        for mpi/impi a Result of round = the call's number in which every rank is active."""
        if self.coll is None:
            self._mpi(x, y)
            n, self.calls = self.calls, self.calls + 1
            return pc.Result(y, n, self.everyone, True, 1), False
        req = self.coll.post(x, out=y)
        return req.wait(), req.late

    def close(self):
        """The result of close() (None for mpi/impi)."""
        return self.coll.close() if self.coll is not None else None

    def _mpi(self, x, y) -> None:
        if self.staged is None:
            self._reference(x, y)
            return
        xh, yh = self.staged
        x.get(out=xh)
        self._reference(xh, yh)
        y.set(yh)
        y.device.synchronize()

    def _reference(self, x: np.ndarray, y: np.ndarray) -> None:
        if self.mode == "mpi":
            self.comm.Allreduce(x, y)
        else:                                   # impi: MPI_Iallreduce waited with a sleeping test loop
            req = self.comm.Iallreduce(x, y)
            while not req.Test():
                time.sleep(20e-6)
