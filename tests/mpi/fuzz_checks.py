"""Hypothesis-driven fuzzing of the public API (issue 14, item 4): python fuzz_checks.py WHAT N [WHAT N]

WHAT: "api" (random valid uses) or "bad" (random bad arguments); N: max_examples; each
pair one case of the check (both in one launch).

Rank 0 runs hypothesis (derandomized, no example database, so a run is reproducible) and
broadcasts each drawn case; every rank runs it, collectively, and the ranks agree on the
outcome before hypothesis sees it (so shrinking, with PC_FUZZ_SHRINK=1, stays in step);
PC_FUZZ_SEED=N draws another (seeded) stream of examples instead, to explore.
Each rank's data derive from the case: values that differ per rank, post and element,
chosen so that every reduction is exact (small integers, +-1, powers of two), whatever
the order. A case ("api") is one PartialAllreduce with a random count (0, 1, odd, up to
65537), dtype (float16 and bfloat16 included), op defined on it, mode, late, algorithm (with
"ps": 1 - 200 blocks, balance, servers),
seed, candidates/quorum, max_staleness, and for every rank its own program of posts:
in place (out=x), out=y or plain; then wait at once, test() a few times, wait later in a
random order, or never; skew sleeps. Checks:

- late="fold": at every rank, the op-fold of every result it received plus close()'s
  equals the op-fold of everything posted by every rank (nothing lost, nothing twice);
- every round returned alone (rounds == 1) has bitwise the same data and active set at
  every rank that got it; a result's round is never earlier than its post;
- full mode with every rank waiting on each post ("lockstep"): round n is the reduction
  of every rank's post #n, equal to MPI_Allreduce's result where MPI has the dtype
  (random normal floats too: to MPI_Allreduce within rounding, bitwise across ranks).

"bad": one argument (or a post/wait argument) made bad on every rank or on one rank;
every rank where the call is collective raises a partialcoll exception that says what is
wrong, and the engine still works afterwards (a good round and close() follow).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from mpi4py import MPI

import partialcoll as pc
from partialcoll._types import BFLOAT16
from _util import ARGS, run_module

RUNS = [(what, int(n)) for what, n in zip(ARGS[::2], ARGS[1::2])] or [("api", 20)]
WAIT = float(os.environ.get("PC_FUZZ_WAIT", "30"))       # every wait/close timeout: a hang is a failure

MODES = ["solo", "majority", "probe", "quorum", "full"]
ALGORITHMS = ["auto", "recursive_doubling", "ring", "tree", "ps"]
NUMERIC = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
           np.float16, np.float32, np.float64, np.complex64, np.complex128]
DTYPES = ["bool", *[np.dtype(d).name for d in NUMERIC], "bfloat16"]
OPS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX, "LAND": MPI.LAND, "LOR": MPI.LOR,
       "LXOR": MPI.LXOR, "BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR}
# where MPI (and the engine) define each op: by dtype kind; bfloat16 and float16 are "f"
KIND_OPS = {"b": ["LAND", "LOR", "LXOR"],
            "i": list(OPS), "u": list(OPS),
            "f": ["SUM", "PROD", "MIN", "MAX"], "c": ["SUM", "PROD"]}
MPI_HAS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64",
           "complex64", "complex128", "bool"}


def dtype_of(name: str) -> np.dtype:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def kind_of(name: str) -> str:
    return "f" if name == "bfloat16" else np.dtype(name).kind


# -- values: exact under every order of reduction ---------------------------------------------
def wide(name: str, a: np.ndarray) -> np.ndarray:
    """a in a type where the checks compute: float64 for floats, complex128, native ints."""
    if name == "bfloat16":
        if a.dtype.metadata:                           # raw 16-bit view (no ml_dtypes)
            return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return a.astype(np.float64)
    k = a.dtype.kind
    if k == "f":
        return a.astype(np.float64)
    if k == "c":
        return a.astype(np.complex128)
    return a.copy()


def narrow(name: str, x: np.ndarray) -> np.ndarray:
    """float64/complex/int values (exact in dtype) -> an array of dtype `name`."""
    dt = dtype_of(name)
    if name == "bfloat16" and dt.metadata:
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(dt)
    return x.astype(dt)


def values(case: dict, rank: int, i: int, salt: int = 0) -> np.ndarray:
    """Post #i of rank: exact under any order of the op (see the module's docstring)."""
    name, op, n = case["dtype"], case["op"], case["count"]
    rng = np.random.default_rng([case["data_seed"], rank, i, salt])
    k = kind_of(name)
    if case.get("random_floats"):
        return narrow(name, rng.normal(size=n))
    if k == "b":
        return rng.random(n) < 0.5
    if op in ("LAND", "LOR", "LXOR"):
        return narrow(name, rng.choice([0, 0, 1, 2], n))
    if op in ("BAND", "BOR", "BXOR"):
        info = np.iinfo(dtype_of(name))
        return rng.integers(info.min, info.max, n, dtype=dtype_of(name), endpoint=True)
    if op in ("MIN", "MAX"):
        if k == "f":
            return narrow(name, np.round(rng.normal(size=n) * 8) / 4)
        lo = 0 if k == "u" else -50
        return narrow(name, rng.integers(lo, 100, n))
    if op == "SUM":
        lo, hi = (0, 3) if k == "u" else (-2, 2)
        x = rng.integers(lo, hi, n, endpoint=True).astype(np.float64)
        if k == "c":
            return narrow(name, x + 1j * rng.integers(-2, 2, n, endpoint=True))
        return narrow(name, x)
    # PROD
    if k == "u":
        return narrow(name, rng.choice([1, 1, 3], n))       # wraps mod 2^bits, like the engine
    if k == "i" or name == "float16":
        return narrow(name, rng.choice([1, 1, -1], n))
    if k == "c":
        return narrow(name, rng.choice([1, -1, 1j, -1j], n))
    return narrow(name, rng.choice([1.0, -1.0, 2.0, 0.5, 1.0], n))


def combine(case: dict, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (op) b on wide() values."""
    op, k = case["op"], kind_of(case["dtype"])
    if op in ("LAND", "LOR", "LXOR"):
        f = {"LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor}[op]
        out = f(a != 0, b != 0)
        return out if k == "b" else out.astype(a.dtype)
    f = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
         "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    with np.errstate(over="ignore"):
        return f(a, b)


def fold(case: dict, arrays) -> np.ndarray:
    acc = None
    for a in arrays:
        acc = a.copy() if acc is None else combine(case, acc, a)
    return acc


def digest(a: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).tobytes(), digest_size=12).hexdigest()


# -- the cases --------------------------------------------------------------------------------
@st.composite
def api_cases(draw, size: int) -> dict:
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(KIND_OPS[kind_of(dtype)]))
    mode = draw(st.sampled_from(MODES))
    case = {"dtype": dtype, "op": op, "mode": mode,
            "count": draw(st.one_of(st.sampled_from([0, 1, 2, 3, 7]), st.integers(0, 300),
                                    st.sampled_from([1023, 4099, 65537]))),
            "late": draw(st.sampled_from(["latest", "fold"])),
            "algorithm": draw(st.sampled_from(ALGORITHMS)),
            "seed": draw(st.integers(-2 ** 63, 2 ** 64 - 1)),
            "data_seed": draw(st.integers(0, 2 ** 32 - 1)),
            "opts": {}, "random_floats": False}
    if mode == "probe":
        q = draw(st.one_of(st.none(), st.integers(1, size + 2)))
        if q is not None:
            case["opts"]["candidates"] = q
    if mode == "quorum":
        case["opts"]["quorum"] = draw(st.integers(1, size))
    if case["algorithm"] == "ps":
        # 1 - 200 blocks (or the default 4 MiB), not always a whole number of elements; more
        # than ps.WINDOW are in flight in windows
        nbytes = case["count"] * dtype_of(dtype).itemsize
        blocks = draw(st.sampled_from([None, 1, 2, 3, 7, 64, 200]))
        if blocks is not None:
            case["opts"]["block_bytes"] = max(1, -(-nbytes // blocks) + draw(st.sampled_from([0, 0, 1, 3])))
        balance = draw(st.sampled_from(["static", "proportional", "psld"]))
        case["opts"]["balance"] = balance
        if balance != "static":
            case["opts"]["rebalance_every"] = draw(st.integers(1, 3))
        if draw(st.booleans()):
            case["opts"]["servers"] = sorted(set(draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=size))))
    if draw(st.booleans()):
        case["opts"]["max_staleness"] = draw(st.integers(1, 5))
    lockstep = draw(st.booleans())
    posts = draw(st.integers(0, 6))
    post = st.fixed_dictionaries({"buf": st.sampled_from(["plain", "out", "inplace"]),
                                  "then": st.sampled_from(["wait", "test", "later", "never"]),
                                  "sleep": st.sampled_from([0, 0, 0, 0.0005, 0.003])})
    programs = []
    for _ in range(size):
        if lockstep:
            prog = [dict(p, then="wait") for p in draw(st.lists(post, min_size=posts, max_size=posts))]
        else:
            prog = draw(st.lists(post, max_size=6))
        programs.append({"posts": prog, "wait_order": draw(st.randoms(use_true_random=False)).random()})
    case["programs"] = programs
    case["lockstep"] = lockstep
    if lockstep and mode == "full" and dtype in ("float32", "float64") and op == "SUM" and draw(st.booleans()):
        case["random_floats"] = True
    return case


def run_api(comm, case: dict) -> None:
    rank, size = comm.rank, comm.size
    name, op = case["dtype"], OPS[case["op"]]
    count = case["count"]
    coll = pc.PartialAllreduce(count, dtype_of(name), op, comm, mode=case["mode"], late=case["late"],
                               algorithm=case["algorithm"], seed=case["seed"], **case["opts"])
    prog = case["programs"][rank]
    received, singles, pending, log = [], {}, [], []

    def take(i, req, out):
        res = req.wait(timeout=WAIT)
        assert res.round >= req.index, (res.round, req.index)
        data = res.data
        if out is not None:
            assert data is out, "the result is not in the out= buffer"
        assert data.dtype == dtype_of(name) and data.size == count, (data.dtype, data.size)
        received.append(wide(name, data))
        log.append((i, req.index, req.late, res.round, res.rounds, res.active, digest(data),
                    prog["posts"][i]["buf"], prog["posts"][i]["then"]))
        if res.rounds == 1:
            singles[res.round] = (digest(data), res.active)
        if case["mode"] == "full" and case["lockstep"]:
            assert res.round == i and res.rounds == 1 and res.active == tuple(range(size)), res
            ref = fold(case, [wide(name, values(case, r, i)) for r in range(size)])
            if case["random_floats"]:
                mpi = np.empty(count, dtype_of(name))
                comm.Allreduce(values(case, rank, i), mpi, op=op)
                tol = 1e-5 if name == "float32" else 1e-12
                assert np.allclose(wide(name, data), wide(name, mpi), rtol=tol * 8, atol=tol * 8), \
                    ("round", i, data[:4], mpi[:4])
            else:
                assert np.array_equal(wide(name, data), ref), ("round", i, data[:4], ref[:4])
                if name in MPI_HAS:
                    mpi = np.empty(count, dtype_of(name))
                    comm.Allreduce(values(case, rank, i), mpi, op=op)
                    assert np.array_equal(data, mpi), ("vs MPI_Allreduce", i, data[:4], mpi[:4])

    for i, p in enumerate(prog["posts"]):
        if p["sleep"]:
            time.sleep(p["sleep"])
        x = values(case, rank, i)
        out = None
        if p["buf"] == "inplace":
            out = x
            req = coll.post(x, out=x)
        elif p["buf"] == "out":
            out = np.full(count, 7, dtype=x.dtype) if count else np.empty(0, x.dtype)
            req = coll.post(x, out=out)
        else:
            req = coll.post(x)
        if p["then"] == "wait":
            take(i, req, out)
        elif p["then"] == "test":
            for _ in range(3):
                if req.test():
                    break
                time.sleep(0.0002)
            pending.append((i, req, out))
        elif p["then"] == "later":
            pending.append((i, req, out))
        # "never": the request is dropped; late="fold" still gets its round via close()
    # deferred waits, in an order drawn by the case
    order = np.random.default_rng(int(prog["wait_order"] * 2 ** 32)).permutation(len(pending))
    for j in order:
        i, req, out = pending[j]
        take(i, req, out)
    final = coll.close(timeout=WAIT)
    assert final.data.size == count
    received.append(wide(name, final.data))

    # nothing lost (fold): every rank's fold of its results equals the fold of every post
    if case["late"] == "fold":
        posts = [wide(name, values(case, r, i)) for r in range(size) for i in range(len(case["programs"][r]["posts"]))]
        if posts:
            want, got = fold(case, posts), fold(case, received)
            if kind_of(name) != "b" and case["op"] in ("LAND", "LOR", "LXOR"):
                got = got != 0
                want = want != 0
            assert np.array_equal(got, want), (f"rank {rank}: results fold to {got[:6]}, posts to {want[:6]}",
                                               np.count_nonzero(got != want))
    # agreement of every round returned alone, across ranks
    everyone = comm.allgather(singles)
    for other in everyone:
        for n, v in other.items():
            if n in singles:
                assert singles[n] == v, (f"round {n} differs: rank {rank} has {singles[n]}, another {v}; "
                                         f"this rank's results (post, index, late, round, rounds, active, "
                                         f"digest, buf, then): {log}")


# -- bad input ---------------------------------------------------------------------------------
BAD_ARGS = {
    "count": [-1, 2.5, "4", True, None, 2 ** 70, 2 ** 61],
    "dtype": [object, "U4", ">f8" if sys.byteorder == "little" else "<f8", "V3", np.longdouble, "bogus"],
    "op": [MPI.MAXLOC, MPI.REPLACE, "sum-ish", None, 3.0, MPI.LAND],      # LAND: undefined on float32
    "mode": ["Solo", "", None, 3, "majority "],
    "late": ["first", None, 0],
    "algorithm": ["bogus", None, "RING"],
    "seed": [1.5, "x", None],
    "max_staleness": [0, -3, 1.5],
    "candidates": [0, -1, 2.5],          # with mode probe
    "quorum": [0, 10 ** 6, None, 1.5],   # with mode quorum
    # with algorithm "ps"
    "block_bytes": [0, -4, 1.5, "4M"],
    "servers": [[], [10 ** 6], [-1], "0", [0.5]],
    "workers": [[], [10 ** 6]],
    "balance": ["bogus", "PSLD", 3],
    "epsilon": ["x", None, -0.1, 1.5, float("nan")],
    "rebalance_every": [0, -1, 2.5],
}
PS_ARGS = ("block_bytes", "servers", "workers", "balance", "epsilon", "rebalance_every")
LOCAL_BAD = ["wrong_dtype", "wrong_size", "strided", "readonly_out", "out_dtype", "list", "none", "two_d_wrong",
             "wait_timeout_str", "post_after_close"]


@st.composite
def bad_cases(draw, size: int) -> dict:
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(BAD_ARGS)))
        value_index = draw(st.integers(0, len(BAD_ARGS[key]) - 1))
        who = draw(st.sampled_from(["all"] + list(range(size))))
        return {"kind": "create", "key": key, "index": value_index, "who": who}
    return {"kind": "local", "what": draw(st.sampled_from(LOCAL_BAD)), "who": draw(st.integers(0, size - 1)),
            "mode": draw(st.sampled_from(MODES))}


def run_bad(comm, case: dict) -> None:
    rank, size = comm.rank, comm.size
    if case["kind"] == "create":
        key, who = case["key"], case["who"]
        kw = {"mode": "solo"}
        if key == "candidates":
            kw["mode"] = "probe"
        if key == "quorum":
            kw["mode"] = "quorum"
            kw["quorum"] = 1
        if key in PS_ARGS:
            kw["algorithm"] = "ps"
            if key in ("epsilon", "rebalance_every"):
                kw["balance"] = "psld"
        args = {"count": 4, "dtype": np.float32, "op": MPI.SUM}
        bad = BAD_ARGS[key][case["index"]]
        mine = who == "all" or who == rank
        if mine:
            if key in args:
                args[key] = bad
            else:
                kw[key] = bad
        try:
            coll = pc.PartialAllreduce(args["count"], args["dtype"], args["op"], comm, **kw)
        except pc.PartialcollError as exc:
            msg = str(exc)
            assert msg, "an exception without a message"
            if mine:                              # names the argument (an op: MPI's name of it)
                assert key in msg or (key == "op" and isinstance(exc, pc.OpError) and "MPI." in msg), (key, bad, msg)
            if not mine:
                assert "rank" in msg, msg            # names the rank that passed it
            return
        # a "bad" value that is in fact accepted must be accepted everywhere (no hang), and work
        ok = np.ones(4, np.float32)
        got = coll.post(ok).wait(timeout=WAIT).data.copy()
        coll.close(timeout=WAIT)
        assert got.dtype == np.float32
        raise AssertionError(f"accepted {key}={bad!r} (rank {who}): {coll!r}")
    what, who = case["what"], case["who"]
    opts = {"quorum": 1} if case["mode"] == "quorum" else {}
    coll = pc.PartialAllreduce(4, np.float32, MPI.SUM, comm, mode=case["mode"], late="fold", **opts)
    extra = np.zeros(4)                      # what the bad call posted after all, if it did
    if rank == who and what != "post_after_close":
        x = np.arange(4, dtype=np.float32)
        calls = {
            "wrong_dtype": lambda: coll.post(np.arange(4, dtype=np.float64)),
            "wrong_size": lambda: coll.post(np.arange(5, dtype=np.float32)),
            "strided": lambda: coll.post(np.arange(8, dtype=np.float32)[::2]),
            "readonly_out": lambda: coll.post(x, out=np.frombuffer(b"\0" * 16, np.float32)),
            "out_dtype": lambda: coll.post(x, out=np.empty(4, np.int32)),
            "list": lambda: coll.post([1.0, 2.0, 3.0, 4.0]),
            "none": lambda: coll.post(None),
            "two_d_wrong": lambda: coll.post(np.zeros((4, 2), np.float32)),
        }
        if what == "wait_timeout_str":
            req = coll.post(x)               # a good post; its wait gets a bad timeout
            extra += x
            try:
                req.wait(timeout="soon")
            except pc.PartialcollError as exc:
                assert "timeout" in str(exc).lower(), exc
            else:
                raise AssertionError("wait(timeout='soon') did not raise")
        else:
            try:
                calls[what]()
            except pc.PartialcollError as exc:
                assert str(exc)
            else:
                raise AssertionError(f"{what} did not raise")
    # the collective still works: one good round each, and close() flushes everything
    x = np.full(4, rank + 1, np.float32)
    total = coll.post(x).wait(timeout=WAIT).data.astype(np.float64)
    total = total + coll.close(timeout=WAIT).data
    want = size * (size + 1) / 2 + comm.allreduce(extra)
    assert np.array_equal(total, want), (what, total, want)
    if what == "post_after_close" and rank == who:
        try:
            coll.post(np.zeros(4, np.float32))
        except pc.StateError as exc:
            assert "closed" in str(exc), exc
        else:
            raise AssertionError("post after close did not raise")


def test_every_bad_argument_is_named(comm):
    """Beside the drawn cases: every bad value of BAD_ARGS, passed by every rank, once;
    each exception names its argument."""
    for key, values in BAD_ARGS.items():
        for index in range(len(values)):
            run_bad(comm, {"kind": "create", "key": key, "index": index, "who": "all"})


# -- the driver: rank 0 draws, every rank runs, all agree on the outcome -------------------------
def run_case(comm, fn, case):
    err = None
    try:
        fn(comm, case)
    except BaseException as exc:           # noqa: BLE001 - reported to rank 0
        err = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    return comm.allgather(err)


@pytest.mark.parametrize("what,examples", RUNS)
def test_fuzz_against_mpi_allreduce(comm, what, examples):
    fn, strategy = (run_api, api_cases) if what == "api" else (run_bad, bad_cases)
    if comm.rank != 0:
        while True:
            case = comm.bcast(None, root=0)
            if case is None:
                return
            run_case(comm, fn, case)
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("PC_FUZZ_SHRINK") else [])
    stats = {"cases": 0}

    explore = os.environ.get("PC_FUZZ_SEED")     # another stream of examples (exploring)

    @settings(max_examples=examples, derandomize=explore is None, database=None, deadline=None, phases=phases,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=strategy(comm.size))
    def prop(case):
        stats["cases"] += 1
        comm.bcast(case, root=0)
        errs = run_case(comm, fn, case)
        bad = [(r, e) for r, e in enumerate(errs) if e]
        assert not bad, f"case {case!r} failed on ranks {[r for r, _ in bad]}:\n" + \
            "\n".join(f"--- rank {r}: {e}" for r, e in bad)

    if explore is not None:
        prop = seed(int(explore))(prop)
    try:
        prop()
    finally:
        comm.bcast(None, root=0)
    print(f"fuzz {what}: {stats['cases']} cases at P={comm.size}", flush=True)


if __name__ == "__main__":
    run_module(__file__)
