"""The JAX primitives: a full allreduce (mpi4jax's ``allreduce``) and a partial one.

Each is a JAX primitive with an ordered effect, so that inside ``jax.jit`` the calls run
in program order on every rank (as mpi4jax's do) and are never dropped or reordered as
dead code. Lowering: ``jax.experimental.io_callback(ordered=True)`` into the host, where
the call posts to a persistent ``PartialAllreduce`` and waits. The primitive declares the
io_callback's own ordered effect, so its token orders it with every other ordered
callback of the program. Outside any trace a call first waits for the ordered effects
already dispatched (``jax.effects_barrier``), then runs on the caller's thread: a GPU
array goes to the engine through DLPack and partialcoll's staging (the CuPy path), a
host array as a NumPy view.

Differentiation (op SUM only, as mpi4jax): the JVP is the allreduce of the tangent; the
transpose is the identity (mpi4jax's convention: each rank's copy of the reduced value
is the same replicated quantity). ``vmap``: the batched array is reduced whole (the op is
elementwise).
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from mpi4py import MPI

from .. import _device
from .._errors import ArgumentError, InvalidBufferError
from .._partial import PartialAllreduce, Result
from .._types import OP_NAMES, check_op_dtype, dtype_code, op_code

_SUM = op_code(MPI.SUM)


def _io_effect():
    """The effect of io_callback(ordered=True), taken from a traced call (no private import)."""
    def f(x):
        return io_callback(lambda a: a, jax.ShapeDtypeStruct((), np.float32), x, ordered=True)
    effects = jax.make_jaxpr(f)(np.float32(0)).effects
    assert len(effects) == 1, effects
    return next(iter(effects))


_EFFECT = _io_effect()
# How the primitives lower: "python_callback" (the default where JAX has it): XLA's
# Python callback called with NumPy views of the operands, the call io_callback itself
# lowers to, without io_callback's per-call device_put of its arguments; "io_callback":
# through jax.experimental.io_callback(ordered=True), JAX's public API. Read when a
# function is traced (PARTIALCOLL_JAX_LOWERING sets it at import).
LOWERINGS = ("python_callback", "io_callback")
lowering = os.environ.get("PARTIALCOLL_JAX_LOWERING", "python_callback")
if lowering not in LOWERINGS:
    raise ImportError(f"PARTIALCOLL_JAX_LOWERING must be one of {', '.join(LOWERINGS)}, not {lowering!r}")
_EMIT = getattr(mlir, "emit_python_callback", None)


def _lower_host_call(ctx, x, host, shapes: Tuple[Any, ...]):
    """MLIR of an ordered call of host(numpy operand) -> tuple of NumPy results (shapes)."""
    if lowering == "python_callback" and _EMIT is not None:
        def callback(a):
            return host(a)
        token = ctx.tokens_in.get(_EFFECT)
        results, token, _ = _EMIT(ctx, callback, token, [x], ctx.avals_in, ctx.avals_out,
                                  has_side_effect=True, returns_token=True)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_EFFECT: token})))
        return list(results)

    def call(v):
        return list(io_callback(lambda a: host(np.asarray(a)), shapes, v, ordered=True))
    return mlir.lower_fun(call, multiple_results=True)(ctx, x)


class HashableComm:
    """A communicator as a primitive's parameter (hashed and compared by its MPI handle)."""

    __slots__ = ("comm", "handle")

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm, self.handle = comm, MPI._handleof(comm)

    def __hash__(self) -> int:
        return hash(self.handle)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashableComm) and other.handle == self.handle

    def __repr__(self) -> str:
        return f"HashableComm({self.comm.Get_name() or self.handle})"


class _Cache:
    """The persistent full-mode collectives of allreduce(), one per (communicator, count,
    dtype, op), made on first use (collective), closed by close() (collective)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clones: Dict[int, HashableComm] = {}      # the user's comm's handle -> its clone
        self.colls: Dict[Tuple[int, int, str, int], PartialAllreduce] = {}

    def clone_of(self, comm: Optional[MPI.Comm]) -> HashableComm:
        """mpi4jax's rule: the collectives run on a clone of the user's communicator (made
        collectively on first use), never on the communicator mpi4py calls use."""
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"allreduce got unexpected type for argument \"comm\" (expected: "
                            f"mpi4py.MPI.Intracomm or None, got: {type(comm).__name__})")
        key = MPI._handleof(comm)
        with self.lock:
            hit = self.clones.get(key)
            if hit is None:
                clone = comm.Clone()
                clone.Set_name("partialcoll.integrations.jax")
                hit = self.clones[key] = HashableComm(clone)
            return hit

    def collective(self, comm: HashableComm, count: int, dtype: np.dtype, op: int) -> PartialAllreduce:
        key = (comm.handle, count, dtype.str, op)
        coll = self.colls.get(key)
        if coll is None:
            with self.lock:
                coll = self.colls.get(key)
                if coll is None:
                    coll = self.colls[key] = PartialAllreduce(count, dtype, OP_NAMES[op], comm.comm, mode="full")
        return coll


_cache = _Cache()
# the last Result of each PartialAllreduce that partial_allreduce() posted to
_last: "weakref.WeakKeyDictionary[PartialAllreduce, Result]" = weakref.WeakKeyDictionary()


def _on_gpu(x: Any) -> bool:
    """x is a JAX array on a GPU (it then goes to the engine through DLPack)."""
    try:
        return isinstance(x, jax.Array) and next(iter(x.devices())).platform == "gpu"
    except Exception:                    # noqa: BLE001 - a deleted or abstract array
        return False


def _post_wait(coll: PartialAllreduce, x: Any) -> Tuple[Any, Result]:
    """Post x (flattened) to coll and wait; (the result's data in x's shape, the Result).
    A GPU array is posted as it is (partialcoll stages it, DLPack); the data is then a
    JAX array on that GPU, a copy (the staging reuses its buffer)."""
    shape = np.shape(x)
    if _on_gpu(x):
        backend = _device.cupy_backend()       # a clear InvalidBufferError where CuPy is missing
        res = coll.post(backend.adopt(x.reshape(-1))).wait()      # a CuPy view (DLPack), staged
        return jnp.array(jax.dlpack.from_dlpack(res.data), copy=True).reshape(shape), res
    res = coll.post(np.ascontiguousarray(x).reshape(-1)).wait()
    return np.asarray(res.data).reshape(shape), res


# -- allreduce ----------------------------------------------------------------------------

def _full_host(x: np.ndarray, *, op: int, comm: HashableComm) -> Any:
    """The host side of one allreduce: the cached collective's round."""
    if x.size == 0:
        return x
    data, _ = _post_wait(_cache.collective(comm, x.size, np.dtype(x.dtype), op), x)
    return data


allreduce_p = Primitive("partialcoll_allreduce")


def _allreduce_impl(x, *, op: int, comm: HashableComm, transpose: bool):
    if transpose:
        return x
    jax.effects_barrier()                # what jitted code dispatched before runs first
    out = _full_host(x if _on_gpu(x) else np.asarray(x), op=op, comm=comm)
    return out if isinstance(out, jax.Array) else jnp.asarray(out)


def _allreduce_abstract(x, *, op: int, comm: HashableComm, transpose: bool):
    # the transpose is the identity: no communication, so no effect (mpi4jax's too)
    return jax.core.ShapedArray(x.shape, x.dtype), (set() if transpose else {_EFFECT})


def _allreduce_lowering(ctx, x, *, op: int, comm: HashableComm, transpose: bool):
    if transpose:
        return [x]
    aval = ctx.avals_in[0]

    def host(a):
        return (_full_host(a, op=op, comm=comm),)
    return _lower_host_call(ctx, x, host, (jax.ShapeDtypeStruct(aval.shape, aval.dtype),))


def _allreduce_jvp(primals, tangents, *, op: int, comm: HashableComm, transpose: bool):
    if op != _SUM:
        raise NotImplementedError(f"partialcoll's allreduce is differentiable only with op=MPI.SUM, "
                                  f"not MPI.{OP_NAMES[op]} (as mpi4jax's)")
    (x,), (t,) = primals, tangents
    val = allreduce_p.bind(x, op=op, comm=comm, transpose=transpose)
    tan = allreduce_p.bind(ad.instantiate_zeros(t), op=op, comm=comm, transpose=transpose)
    return val, tan


def _allreduce_transpose(ct, x, *, op: int, comm: HashableComm, transpose: bool):
    if op != _SUM:
        raise NotImplementedError(f"partialcoll's allreduce is transposable only with op=MPI.SUM, "
                                  f"not MPI.{OP_NAMES[op]} (as mpi4jax's)")
    ct = ad.instantiate_zeros(ct)
    return (allreduce_p.bind(ct, op=op, comm=comm, transpose=not transpose),)


def _allreduce_batch(args, dims, *, op: int, comm: HashableComm, transpose: bool):
    (x,), (d,) = args, dims
    return allreduce_p.bind(x, op=op, comm=comm, transpose=transpose), d


allreduce_p.def_impl(_allreduce_impl)
allreduce_p.def_effectful_abstract_eval(_allreduce_abstract)
mlir.register_lowering(allreduce_p, _allreduce_lowering)
ad.primitive_jvps[allreduce_p] = _allreduce_jvp
ad.primitive_transposes[allreduce_p] = _allreduce_transpose
batching.primitive_batchers[allreduce_p] = _allreduce_batch


def as_operand(x: Any, who: str):
    """x as an array JAX can trace (an array, a tracer or a number), else TypeError."""
    if isinstance(x, (str, bytes)) or not (hasattr(x, "dtype") and hasattr(x, "shape")
                                           or isinstance(x, (bool, int, float, complex, np.generic))):
        raise InvalidBufferError(f"{who} takes an array or a number, not {type(x).__name__}")
    x = jnp.asarray(x)
    try:
        dtype_code(np.dtype(x.dtype))
    except Exception as exc:             # noqa: BLE001 - said with the function's name
        raise InvalidBufferError(f"{who}: dtype {x.dtype} cannot be reduced ({exc})") from None
    return x


def bind_allreduce(x: Any, op: Any, comm: Optional[MPI.Comm]) -> Any:
    x = as_operand(x, "allreduce")
    if not isinstance(op, (MPI.Op, str)):
        raise TypeError(f"allreduce got unexpected type for argument \"op\" (expected: mpi4py.MPI.Op or its "
                        f"name, got: {type(op).__name__})")
    code = op_code(op)
    check_op_dtype(code, np.dtype(x.dtype))
    return allreduce_p.bind(x, op=code, comm=_cache.clone_of(comm), transpose=False)


def close_cached(timeout: Optional[float] = None) -> None:
    """Close allreduce()'s cached collectives (collective, see jax.close). The clones stay:
    jitted programs traced before hold them, and make new collectives on them."""
    from .._partial import close_all
    jax.effects_barrier()
    with _cache.lock:
        colls = [c for _, c in sorted(_cache.colls.items(), key=lambda kv: kv[0])]
        _cache.colls.clear()
    close_all(colls, timeout)


# -- partial_allreduce ----------------------------------------------------------------------

class CollParam:
    """A PartialAllreduce as a primitive's parameter (by identity)."""

    __slots__ = ("coll", "__weakref__")

    def __init__(self, coll: PartialAllreduce) -> None:
        self.coll = coll

    def __hash__(self) -> int:
        return id(self.coll)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CollParam) and other.coll is self.coll

    def __repr__(self) -> str:
        return repr(self.coll)


def _partial_host(x, *, coll: CollParam):
    data, res = _post_wait(coll.coll, x)
    _last[coll.coll] = res
    return data, np.int32(res.posts)


partial_p = Primitive("partialcoll_partial_allreduce")
partial_p.multiple_results = True


def _partial_impl(x, *, coll: CollParam):
    jax.effects_barrier()
    data, posts = _partial_host(x if _on_gpu(x) else np.asarray(x), coll=coll)
    return [data if isinstance(data, jax.Array) else jnp.asarray(data), jnp.asarray(posts)]


def _partial_abstract(x, *, coll: CollParam):
    return [jax.core.ShapedArray(x.shape, x.dtype), jax.core.ShapedArray((), np.int32)], {_EFFECT}


def _partial_lowering(ctx, x, *, coll: CollParam):
    aval = ctx.avals_in[0]

    def host(a):
        return _partial_host(a, coll=coll)
    return _lower_host_call(ctx, x, host, (jax.ShapeDtypeStruct(aval.shape, aval.dtype),
                                           jax.ShapeDtypeStruct((), np.int32)))


def _partial_jvp(primals, tangents, *, coll: CollParam):
    raise NotImplementedError("partial_allreduce is not differentiable: a round mixes this step's data with "
                              "other ranks' stale data; differentiate the loss, then average the gradients "
                              "(partial_allreduce on them, or allreduce_gradients)")


def _partial_batch(args, dims, *, coll: CollParam):
    raise NotImplementedError("partial_allreduce under jax.vmap: a round reduces one array of the collective's "
                              "count; call it on the batched array outside vmap (its count the batch's size)")


partial_p.def_impl(_partial_impl)
partial_p.def_effectful_abstract_eval(_partial_abstract)
mlir.register_lowering(partial_p, _partial_lowering)
ad.primitive_jvps[partial_p] = _partial_jvp
batching.primitive_batchers[partial_p] = _partial_batch


def bind_partial(x: Any, coll: PartialAllreduce) -> Tuple[Any, Any]:
    if not isinstance(coll, PartialAllreduce):
        raise ArgumentError(f"partial_allreduce posts to a partialcoll.PartialAllreduce, not {type(coll).__name__}")
    x = as_operand(x, "partial_allreduce")
    size = int(np.prod(x.shape, dtype=np.int64))
    if size != coll.count:
        raise ArgumentError(f"partial_allreduce: x has {size} elements (shape {tuple(x.shape)}), "
                            f"the collective's count is {coll.count}")
    if np.dtype(x.dtype) != coll.dtype:
        raise InvalidBufferError(f"partial_allreduce: x is {x.dtype}, the collective reduces {coll.dtype}")
    data, posts = partial_p.bind(x, coll=CollParam(coll))
    return data, posts


def last_result(coll: PartialAllreduce) -> Optional[Result]:
    return _last.get(coll)
