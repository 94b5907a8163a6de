"""allreduce_gradients: an optax GradientTransformation that averages gradients through
persistent partial allreduces (one per dtype, the pytree's leaves flattened into it)."""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

from .._agree import agree, as_problem
from .._errors import ArgumentError
from .._partial import PartialAllreduce, Result, close_all
from ._jax_ops import bind_partial, last_result

_AVERAGES = ("posts", "world")


class AllreduceGradientsState(NamedTuple):
    """posts: per dtype (in ``AllreduceGradients.dtypes``' order), how many posts the last
    round averaged (int32; the world size in full mode): RNA's learning-rate scaling
    inside ``jit``."""
    posts: Any


def _leaf_layout(leaves: List[Any]) -> List[tuple]:
    """(dtype name, shape) of each leaf; a leaf that is not an array or a number raises."""
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, (str, bytes)) or not (hasattr(leaf, "dtype") and hasattr(leaf, "shape")
                                                  or isinstance(leaf, (int, float, np.generic))):
            raise ArgumentError(f"allreduce_gradients: leaf {i} of the pytree is a {type(leaf).__name__}, "
                                f"not an array")
        dt = np.dtype(jnp.asarray(leaf).dtype if not hasattr(leaf, "dtype") else leaf.dtype)
        if not np.issubdtype(dt, np.inexact):
            raise ArgumentError(f"allreduce_gradients: leaf {i} is {dt}; gradients are floating arrays")
        out.append((dt.name, tuple(int(n) for n in np.shape(leaf))))
    return out


class AllreduceGradients(optax.GradientTransformation):
    """The transformation allreduce_gradients() returns: an ``optax.GradientTransformation``
    (``init``, ``update``) with its collectives, the last results, ``close()`` and ``with``."""

    # a NamedTuple subclass: optax sees (init, update); the rest lives in _impl
    _impl: "_Impl"

    @property
    def dtypes(self) -> List[str]:
        """The dtypes of the gradients, one collective each (known after init)."""
        return list(self._impl.colls)

    @property
    def collectives(self) -> Dict[str, PartialAllreduce]:
        """dtype name -> its PartialAllreduce (made by init)."""
        return dict(self._impl.colls)

    @property
    def result(self) -> Optional[Result]:
        """The last round's Result of the first dtype (posts, nap, active, round): RNA's
        counts; None before the first update ran."""
        results = self.results
        return next(iter(results.values()), None)

    @property
    def results(self) -> Dict[str, Result]:
        """dtype name -> the last round's Result of its collective."""
        out = {}
        for name, coll in self._impl.colls.items():
            res = last_result(coll)
            if res is not None:
                out[name] = res
        return out

    def close(self, timeout: Optional[float] = None) -> List[Result]:
        """Collective: close the collectives (pc.close_all); their final results."""
        jax.effects_barrier()            # updates dispatched before run first
        colls, self._impl.colls = list(self._impl.colls.values()), {}
        return close_all(colls, timeout)

    def __enter__(self) -> "AllreduceGradients":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
            return
        # left by an exception: report it to the peers (their calls raise PeerError) and
        # drop the collectives here, as a PartialAllreduce's own with block does
        colls, self._impl.colls = list(self._impl.colls.values()), {}
        for coll in colls:
            coll.__exit__(exc_type, *exc)


class _Impl:
    def __init__(self, comm: MPI.Comm, mode: str, average: str, options: Dict[str, Any]) -> None:
        self.comm, self.mode, self.average, self.options = comm, mode, average, options
        self.colls: Dict[str, PartialAllreduce] = {}
        self.treedef: Any = None
        self.layout: List[tuple] = []

    def init(self, params: Any) -> AllreduceGradientsState:
        """Collective (the first time): the ranks agree on the pytree's layout, then make
        one PartialAllreduce per dtype, in dtype-name order."""
        if self.colls:
            return self._state()
        leaves, treedef = jax.tree_util.tree_flatten(params)
        problem, layout = None, []
        try:
            layout = _leaf_layout(leaves)
        except Exception as exc:         # noqa: BLE001 - raised on every rank by agree()
            problem = as_problem(exc, "allreduce_gradients")
        counts: Dict[str, int] = {}
        for name, shape in layout:
            counts[name] = counts.get(name, 0) + int(np.prod(shape, dtype=np.int64))
        digest = hashlib.sha1(repr((str(treedef), layout)).encode()).hexdigest()[:12]
        agree(self.comm, "allreduce_gradients", problem,
              {"elements per dtype": dict(sorted(counts.items())), "leaves": len(layout),
               "tree and shapes (digest)": digest},
              what="a gradient pytree of the same structure, shapes and dtypes")
        self.treedef, self.layout = treedef, layout
        made: Dict[str, PartialAllreduce] = {}
        try:
            for name in sorted(counts):
                made[name] = PartialAllreduce(counts[name], name, MPI.SUM, self.comm, mode=self.mode, **self.options)
        except BaseException:
            close_all(list(made.values()))
            raise
        self.colls = made
        return self._state()

    def _state(self) -> AllreduceGradientsState:
        posts = self.comm.Get_size() if self.mode == "full" else 0
        return AllreduceGradientsState(posts=jnp.full((len(self.colls),), posts, jnp.int32))

    def update(self, updates: Any, state: AllreduceGradientsState, params: Any = None):
        del params
        if not self.colls:
            raise ArgumentError("allreduce_gradients: update() before init() (or after close())")
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        if treedef != self.treedef:
            raise ArgumentError(f"allreduce_gradients: the gradients' tree {treedef} is not the one init() "
                                f"saw ({self.treedef})")
        layout = _leaf_layout(leaves)
        if layout != self.layout:
            bad = next(i for i, (a, b) in enumerate(zip(layout, self.layout)) if a != b)
            raise ArgumentError(f"allreduce_gradients: leaf {bad} is {layout[bad]} (dtype, shape); init() saw "
                                f"{self.layout[bad]}")
        out: List[Any] = list(leaves)
        posts = []
        size = self.comm.Get_size()
        for name, coll in self.colls.items():
            idx = [i for i, (dt, _) in enumerate(layout) if dt == name]
            flat = jnp.concatenate([jnp.ravel(jnp.asarray(leaves[i])) for i in idx])
            data, n = bind_partial(flat, coll)
            div = jnp.maximum(n, 1) if self.average == "posts" else size
            data = data / jnp.asarray(div, data.dtype)
            start = 0
            for i in idx:
                shape = layout[i][1]
                k = int(np.prod(shape, dtype=np.int64))
                out[i] = data[start:start + k].reshape(shape)
                start += k
            posts.append(n)
        new_state = AllreduceGradientsState(posts=jnp.stack(posts).astype(jnp.int32) if posts
                                            else state.posts)
        return jax.tree_util.tree_unflatten(treedef, out), new_state


def allreduce_gradients(mode: str = "solo", average: str = "posts", *, comm: Optional[MPI.Comm] = None,
                        **options: Any) -> AllreduceGradients:
    """An ``optax.GradientTransformation`` that averages the gradients across ranks through
    persistent partial allreduces (eager-SGD in optax): chain it before the optimizer.

    mode: "solo", "majority", "probe", "quorum" or "full" (PartialAllreduce's).
    average: "posts" divides each round's sum by the posts inside it (the exact mean of
    what was contributed; RNA's weighting), "world" by the number of ranks (eager-SGD's
    1/P: absent ranks count as zero). options: PartialAllreduce's (seed, candidates,
    quorum, max_staleness, late, algorithm, accumulate ...). comm: default COMM_WORLD
    (each collective runs on its own duplicate).

    ``init(params)`` is collective: the ranks agree on the pytree's structure, shapes and
    dtypes (ArgumentError on every rank where they differ), then make one collective per
    dtype. ``update`` runs inside or outside ``jax.jit``: one post and wait per dtype.
    ``result``/``results``: the last rounds' Results; ``close()`` (or the end of a ``with``
    block) closes the collectives, collectively.
    """
    if average not in _AVERAGES:
        raise ArgumentError(f"average must be 'posts' or 'world', not {average!r}")
    impl = _Impl(MPI.COMM_WORLD if comm is None else comm, mode, average, options)
    tx = AllreduceGradients(impl.init, impl.update)
    tx._impl = impl
    return tx
