"""JAX integration: mpi4jax's ``allreduce`` on partialcoll, partial allreduces inside
``jax.jit``, and eager-SGD as an optax transformation.

* ``allreduce(x, op=MPI.SUM, *, comm=None)`` -- mpi4jax's call (a script changes its
  import, not its calls): the full allreduce, usable inside and outside ``jax.jit``,
  ordered by an effect, differentiable for SUM, batched by ``vmap``.
* ``partial_allreduce(x, coll)`` -> ``(data, posts)`` -- post x to a
  ``partialcoll.PartialAllreduce`` made outside the traced function (any mode), inside or
  outside ``jit``; ``posts`` (int32) is how many posts the round's sum holds.
* ``allreduce_gradients(mode=..., average=...)`` -- an ``optax.GradientTransformation``
  averaging a gradient pytree through one persistent partial allreduce per dtype.
* ``last_result(coll)`` -- the last ``Result`` partial_allreduce got from coll.
* ``close()`` -- close allreduce()'s cached collectives (collective).

Importing this module changes nothing in JAX beyond registering its two primitives.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from mpi4py import MPI

from .._partial import PartialAllreduce, Result
from ._jax_ops import bind_allreduce, bind_partial, close_cached, last_result as _last_result
from ._jax_optax import AllreduceGradients, AllreduceGradientsState, allreduce_gradients

__all__ = ["allreduce", "partial_allreduce", "allreduce_gradients", "AllreduceGradients",
           "AllreduceGradientsState", "last_result", "close"]

_NOTSET: Any = object()


def allreduce(x: Any, op: Any = MPI.SUM, *, comm: Optional[MPI.Comm] = None, token: Any = _NOTSET) -> Any:
    """Perform an allreduce operation (mpi4jax's ``allreduce``, on partialcoll).

    Args:
        x: array or scalar input (a JAX or NumPy array, or a tracer inside ``jit``).
        op: the reduction, an ``MPI.Op`` (``MPI.SUM``, ``MPI.MAX`` ...) or its name.
        comm: the communicator (default: a clone of ``COMM_WORLD``); the reduction runs on
            a clone of it, made on first use, never on ``comm`` itself.

    Returns:
        The reduction across the ranks of comm, an array of x's shape and dtype.

    Differentiable (``jax.grad``, ``jax.jvp``) for ``op=MPI.SUM`` only, with mpi4jax's
    rules: the JVP is the allreduce of the tangent, the transpose the identity.

    Each (communicator, size, dtype, op) gets one persistent collective on first use, kept
    for later calls (``close()`` frees them). Making one is collective, so every rank must
    make the same calls in the same order, as with any MPI collective; a call whose size
    or dtype differs across ranks raises ArgumentError on every rank when it makes the
    collective, and a Timeout (``partialcoll.rc.timeout``) where it finds one made already.
    """
    if token is not _NOTSET:
        raise RuntimeError("Explicit token management is not supported: tokens are managed automatically "
                           "(as in mpi4jax>=0.8.0) and must not be passed to collective operations")
    return bind_allreduce(x, op, comm)


def partial_allreduce(x: Any, coll: PartialAllreduce) -> Tuple[Any, Any]:
    """Post x to coll and wait for its round: ``(data, posts)``.

    coll: a ``partialcoll.PartialAllreduce`` of x's size and dtype, made outside the traced
    function. data: the round's reduction, in x's shape (divided by coll's divisor);
    posts: an int32 scalar, how many posts' data is inside (``data / posts`` is the mean).
    Inside ``jax.jit`` the call is ordered with the program's other collectives; not
    differentiable (average gradients instead), not batched by ``vmap``.
    """
    return bind_partial(x, coll)


def last_result(coll: PartialAllreduce) -> Optional[Result]:
    """The last Result (round, active, nap, posts) partial_allreduce got from coll."""
    return _last_result(coll)


def close(timeout: Optional[float] = None) -> None:
    """Collective: close the collectives allreduce() made and cached (every rank, after its
    last allreduce; a later allreduce makes new ones). The communicator clones stay, as
    mpi4jax's: jitted functions traced before hold them."""
    close_cached(timeout)
