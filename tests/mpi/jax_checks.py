"""JAX integration: python jax_checks.py (under mpiexec, any P)

References are independent of partialcoll: mpi4py's MPI_Allreduce on NumPy copies of the
same values (float64 for bfloat16, whose integer-valued inputs make every partial sum
exact), mpi4jax's allreduce where it is installed, and sums written out by hand for the
derivatives. Values differ per rank and per element."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
import optax
from mpi4py import MPI

import partialcoll as pc
from partialcoll.integrations import jax as pcj
from _util import expect_raises, run_module

jax.config.update("jax_enable_x64", True)       # float64 arrays stay float64

try:
    import mpi4jax
except ImportError as exc:                      # built from source; the comparisons then skip
    mpi4jax = None
    MPI4JAX_MISSING = f"mpi4jax is not installed ({exc}): its comparisons skip"
else:
    MPI4JAX_MISSING = ""

SHAPES = [(), (3, 5), (2, 3, 17)]
OPS = {"SUM": MPI.SUM, "MAX": MPI.MAX, "MIN": MPI.MIN, "PROD": MPI.PROD}


def values(comm, shape, dtype, salt=0, integer=False):
    """Values that differ per rank and per element (small integers where exact sums matter)."""
    rng = np.random.default_rng(1000 * comm.rank + 7 * salt + len(shape))
    if integer:
        return rng.integers(-8, 9, size=shape).astype(dtype)
    return rng.uniform(-2, 2, size=shape).astype(dtype)


def mpi_reference(comm, x: np.ndarray, op) -> np.ndarray:
    """MPI_Allreduce through mpi4py on a NumPy copy."""
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    comm.Allreduce(x, out, op=op)
    return out


def test_mpi4jax_present(comm):
    if mpi4jax is None:
        print(f"rank {comm.rank}: {MPI4JAX_MISSING}", flush=True)


def _all_ops(allreduce):
    """One jitted function that reduces its inputs with every op of OPS, in turn."""
    return jax.jit(lambda xs: [allreduce(x, op=op) for x, op in zip(xs, OPS.values())])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_full_in_jit_equals_mpi_allreduce(comm, dtype):
    """jit(allreduce) == MPI_Allreduce (and mpi4jax's allreduce) for every op and shape,
    four allreduces in one jitted function; integer-valued inputs for SUM and PROD, so
    every summation order is exact."""
    ours = _all_ops(pcj.allreduce)
    theirs = _all_ops(mpi4jax.allreduce) if mpi4jax is not None else None
    for shape in SHAPES:
        xs = []
        for salt, name in enumerate(OPS):
            x = values(comm, shape, dtype, salt=salt, integer=name in ("SUM", "PROD"))
            if name == "PROD":
                x = np.where(x == 0, 1, np.clip(x, -2, 2)).astype(dtype)
            xs.append(x)
        got = [np.asarray(g) for g in ours([jnp.asarray(x) for x in xs])]
        for x, g, (name, op) in zip(xs, got, OPS.items()):
            assert g.dtype == dtype and g.shape == shape
            np.testing.assert_array_equal(g, mpi_reference(comm, x, op), err_msg=f"{name} {shape}")
        if theirs is not None:
            for g, t, name in zip(got, theirs([jnp.asarray(x) for x in xs]), OPS):
                np.testing.assert_array_equal(g, np.asarray(t), err_msg=f"mpi4jax {name} {shape}")
        # non-integer values: the summation order may differ from MPI's by rounding only
        x = values(comm, shape, dtype, salt=7)
        np.testing.assert_allclose(np.asarray(ours([jnp.asarray(x)] * 4)[0]), mpi_reference(comm, x, MPI.SUM),
                                   rtol=1e-5 if dtype == np.float32 else 1e-12)


def test_bfloat16_against_float64(comm):
    """bfloat16 (which mpi4py cannot reduce) with integer-valued inputs, against float64
    MPI_Allreduce of the same values: every partial sum is an integer below 256, exact."""
    for shape in SHAPES:
        x = values(comm, shape, np.float64, salt=11, integer=True)
        got = jax.jit(pcj.allreduce)(jnp.asarray(x, jnp.bfloat16))
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float64), mpi_reference(comm, x, MPI.SUM))
        got_max = pcj.allreduce(jnp.asarray(x, jnp.bfloat16), op=MPI.MAX)     # eager too
        np.testing.assert_array_equal(np.asarray(got_max, np.float64), mpi_reference(comm, x, MPI.MAX))


def test_eager_and_program_order(comm):
    """Outside jit, and several allreduces (same and different shapes and ops) in one jitted
    function, interleaved with eager calls: each equals its own MPI_Allreduce."""
    a, b = values(comm, (5,), np.float32, 1, True), values(comm, (4, 2), np.float64, 2, True)

    @jax.jit
    def many(a, b):
        s = pcj.allreduce(a, MPI.SUM)
        m = pcj.allreduce(a, MPI.MAX)
        t = pcj.allreduce(b * 2, MPI.SUM)
        # independent calls of the same signature (one collective): only their order, the
        # same on every rank, keeps one rank's b * 3 from meeting another's b * 2
        t3 = pcj.allreduce(b * 3, MPI.SUM)
        return s, m, t, pcj.allreduce(s, MPI.SUM), t3
    for _ in range(3):
        s, m, t, ss, t3 = many(jnp.asarray(a), jnp.asarray(b))
        np.testing.assert_array_equal(np.asarray(t3), mpi_reference(comm, b * 3, MPI.SUM))
        eager = pcj.allreduce(jnp.asarray(a), MPI.SUM)
        ref = mpi_reference(comm, a, MPI.SUM)
        np.testing.assert_array_equal(np.asarray(s), ref)
        np.testing.assert_array_equal(np.asarray(eager), ref)
        np.testing.assert_array_equal(np.asarray(m), mpi_reference(comm, a, MPI.MAX))
        np.testing.assert_array_equal(np.asarray(t), mpi_reference(comm, b * 2, MPI.SUM))
        np.testing.assert_array_equal(np.asarray(ss), ref * comm.size)
    # NumPy input and a Python scalar, as mpi4jax takes them
    np.testing.assert_array_equal(np.asarray(pcj.allreduce(a, MPI.SUM)), mpi_reference(comm, a, MPI.SUM))
    assert float(pcj.allreduce(float(comm.rank + 1), MPI.SUM)) == comm.size * (comm.size + 1) / 2


def test_grad_jvp_by_hand(comm):
    """d/dx sum(allreduce(x)^2) and the JVP, by hand with S = sum_r x_r (mpi4py):
    grad = 2 S (mpi4jax's transpose: the identity), jvp(t) = 2 S * sum_r t_r."""
    x = values(comm, (6,), np.float64, salt=5)
    t = values(comm, (6,), np.float64, salt=6)
    S, T = mpi_reference(comm, x, MPI.SUM), mpi_reference(comm, t, MPI.SUM)

    def f(v):
        return jnp.sum(pcj.allreduce(v, MPI.SUM) ** 2)
    for g in (jax.grad(f), jax.jit(jax.grad(f))):
        np.testing.assert_allclose(np.asarray(g(jnp.asarray(x))), 2 * S, rtol=1e-12)
    val, tan = jax.jit(lambda v, w: jax.jvp(f, (v,), (w,)))(jnp.asarray(x), jnp.asarray(t))
    np.testing.assert_allclose(float(val), np.sum(S ** 2), rtol=1e-12)
    np.testing.assert_allclose(float(tan), np.sum(2 * S * T), rtol=1e-12)
    # value_and_grad of a chain (mpi4jax's test_allreduce_chained): x1 + x2 -> grad 2
    np.testing.assert_allclose(
        float(jax.jit(jax.grad(lambda v: pcj.allreduce(v, MPI.SUM) + pcj.allreduce(v, MPI.SUM)))(1.5)), 2.0)
    if mpi4jax is not None:
        theirs = jax.jit(jax.grad(lambda v: jnp.sum(mpi4jax.allreduce(v, op=MPI.SUM) ** 2)))(jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(f))(jnp.asarray(x))), np.asarray(theirs), rtol=1e-12)
    # other ops: a clear error, not a wrong derivative
    expect_raises(NotImplementedError, jax.grad(lambda v: jnp.sum(pcj.allreduce(v, MPI.MAX))), jnp.asarray(x),
                  match="only with op=MPI.SUM")


def test_vmap(comm):
    """vmap (and jit of vmap) reduces the batched array: MPI_Allreduce of the whole batch."""
    x = values(comm, (4, 3), np.float32, salt=8, integer=True)
    ref = mpi_reference(comm, x, MPI.SUM)
    for fn in (jax.vmap(pcj.allreduce), jax.jit(jax.vmap(pcj.allreduce))):
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x))), ref)
    np.testing.assert_array_equal(np.asarray(jax.vmap(pcj.allreduce, in_axes=1, out_axes=1)(jnp.asarray(x))), ref)


def test_partial_full_and_solo_nothing_lost(comm):
    """partial_allreduce: mode full gives MPI_Allreduce and posts == P; mode solo with
    late="fold" loses nothing: the sum of every result a rank got plus close()'s equals
    the sum of everything every rank posted (mpi4py)."""
    n = 10
    with pc.PartialAllreduce(n, np.float64, mode="full") as full:
        step = jax.jit(lambda v: pcj.partial_allreduce(v, full))
        x = values(comm, (2, 5), np.float64, salt=9, integer=True)
        data, posts = step(jnp.asarray(x))
        assert data.shape == (2, 5) and posts.dtype == jnp.int32 and int(posts) == comm.size
        np.testing.assert_array_equal(np.asarray(data), mpi_reference(comm, x, MPI.SUM))
        assert pcj.last_result(full).posts == comm.size
    solo = pc.PartialAllreduce(n, np.float64, mode="solo", late="fold")
    step = jax.jit(lambda v: pcj.partial_allreduce(v, solo))
    got, posted = np.zeros(n), np.zeros(n)
    for i in range(20):
        x = values(comm, (n,), np.float64, salt=100 + i, integer=True)
        posted += x
        data, posts = step(jnp.asarray(x))
        got += np.asarray(data)
        assert 0 <= int(posts) <= 20 * comm.size      # 0: a fold of no round
    final = solo.close()
    np.testing.assert_array_equal(got + final.data, mpi_reference(comm, posted, MPI.SUM))


def _params(comm, extra=False):
    p = {"dense": {"w": jnp.ones((3, 4), jnp.float32), "b": jnp.zeros((4,), jnp.float32)},
         "scale": jnp.ones((2,), jnp.float64)}
    if extra:
        p["more"] = jnp.zeros((1,), jnp.float32)
    return p


def _grads(comm, params, salt):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(values(comm, leaf.shape, leaf.dtype, salt + i))
                                                  for i, leaf in enumerate(leaves)])


def test_optax_full_same_update_everywhere(comm):
    """chain(allreduce_gradients("full"), sgd): every rank gets the same update, which is
    -lr * the mean of the ranks' gradients (mpi4py); one collective per dtype."""
    params = _params(comm)
    with pcj.allreduce_gradients(mode="full") as tx:
        opt = optax.chain(tx, optax.sgd(0.5))
        state = opt.init(params)
        assert tx.dtypes == ["float32", "float64"]
        update = jax.jit(opt.update)
        for step in range(3):
            grads = _grads(comm, params, 10 * step)
            upd, state = update(grads, state, params)
            for name, mine in zip(*[jax.tree_util.tree_flatten_with_path(t)[0] for t in (upd, grads)]):
                u, g = np.asarray(name[1]), np.asarray(mine[1])
                everyone = comm.allgather(u)
                for r, other in enumerate(everyone):
                    np.testing.assert_array_equal(other, u, err_msg=f"rank {r}'s update differs")
                np.testing.assert_allclose(u, -0.5 * mpi_reference(comm, g, MPI.SUM) / comm.size,
                                           rtol=1e-6 if g.dtype == np.float32 else 1e-12)
            assert np.asarray(state[0].posts).tolist() == [comm.size, comm.size]
            assert tx.result is not None and tx.result.posts == comm.size
        finals = tx.close()
    assert len(finals) == 2


def test_optax_solo_average_world(comm):
    """solo mode, average="world": each round's sum / P; the counts of the last round
    reachable in the state and as Results; close() flushes what no round read."""
    params = _params(comm)
    tx = pcj.allreduce_gradients(mode="solo", average="world", late="fold")
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(5):
        upd, state = update(_grads(comm, params, step), state)
        assert set(tx.results) == {"float32", "float64"}
        for i, name in enumerate(tx.dtypes):
            res = tx.results[name]
            assert res.posts == int(state.posts[i]) and 0 <= res.nap <= comm.size * res.rounds   # folded rounds add up
        # the float64 collective holds the one float64 leaf: its update is the round's sum / P
        np.testing.assert_allclose(np.asarray(upd["scale"]) * comm.size, tx.results["float64"].data, rtol=1e-12)
    finals = tx.close()
    assert len(finals) == 2 and tx.dtypes == []


@pytest.mark.mpi(min_size=2)
def test_bad_pytrees_raise_on_every_rank(comm):
    """A pytree whose size, dtype or leaves differ on one rank: ArgumentError at init() on
    every rank (they agree before making any collective), never a hang."""
    one = comm.size - 1
    good = _params(comm)
    cases = {
        "size": {**good, "scale": jnp.ones((3,), jnp.float64)},
        "dtype": {**good, "scale": jnp.ones((2,), jnp.float32)},
        "non-array leaf": {**good, "scale": "not an array"},
        "integer leaf": {**good, "scale": jnp.ones((2,), jnp.int32)},
    }
    for what, bad in cases.items():
        tx = pcj.allreduce_gradients(mode="full")
        exc = expect_raises(pc.ArgumentError, tx.init, bad if comm.rank == one else good)
        text = str(exc)
        assert "allreduce_gradients" in text and ("differs across ranks" in text or "rejected" in text
                                                  or comm.rank == one), (what, text)
        assert tx.dtypes == []
    # allreduce's first call with a size differing on one rank: the collective's creation
    # agrees on it (ArgumentError on every rank, out of the jitted call)
    x = jnp.ones((4 if comm.rank == one else 3,), jnp.float32)
    expect_raises(Exception, jax.jit(pcj.allreduce), x, match="differs across ranks")


def test_bad_arguments(comm):
    """Non-array input, a coll whose count or dtype does not match, a token: clear errors."""
    expect_raises(TypeError, pcj.allreduce, "abc", MPI.SUM, match="array or a number")
    expect_raises(TypeError, pcj.allreduce, jnp.ones(3), MPI.SUM, comm="world", match="comm")
    expect_raises(TypeError, pcj.allreduce, jnp.ones(3), 0, match="op")
    expect_raises(pc.OpError, pcj.allreduce, jnp.ones(3), MPI.BAND)          # bitwise on floats
    expect_raises(RuntimeError, pcj.allreduce, jnp.ones(3), MPI.SUM, token=object(), match="token")
    with pc.PartialAllreduce(5, np.float32, mode="solo") as coll:
        expect_raises(pc.ArgumentError, jax.jit(lambda v: pcj.partial_allreduce(v, coll)), jnp.ones(4, jnp.float32),
                      match="count is 5")
        expect_raises(pc.InvalidBufferError, pcj.partial_allreduce, jnp.ones(5, jnp.float64), coll,
                      match="reduces float32")
        expect_raises(pc.ArgumentError, pcj.partial_allreduce, jnp.ones(5), "coll", match="PartialAllreduce")
        expect_raises(NotImplementedError, jax.grad(lambda v: jnp.sum(pcj.partial_allreduce(v, coll)[0])),
                      jnp.ones(5, jnp.float32), match="not differentiable")
        expect_raises(NotImplementedError, jax.vmap(lambda v: pcj.partial_allreduce(v, coll)[0]),
                      jnp.ones((2, 5), jnp.float32), match="vmap")
    tx = pcj.allreduce_gradients(mode="full")
    expect_raises(pc.ArgumentError, tx.update, _params(comm), None, match="before init")
    expect_raises(pc.ArgumentError, pcj.allreduce_gradients, average="mean", match="posts")


@pytest.mark.mpi(min_size=2)
def test_peer_failure_raises_out_of_jit(comm):
    """One rank's update gets gradients of another tree (ArgumentError there, inside its
    `with`); the others, waiting in the jitted update's full round, get its PeerError out
    of the jitted call, never a hang."""
    params = _params(comm)
    one = comm.size - 1
    try:
        with pcj.allreduce_gradients(mode="full") as tx:
            state = tx.init(params)
            update = jax.jit(tx.update)
            update(_grads(comm, params, 1), state)      # one good round everywhere
            grads = _grads(comm, _params(comm, extra=True), 2) if comm.rank == one else _grads(comm, params, 2)
            update(grads, state)
    except pc.ArgumentError as exc:
        assert comm.rank == one, exc
        assert "tree" in str(exc)
    except Exception as exc:             # noqa: BLE001 - JAX's error carries the PeerError
        assert comm.rank != one, exc
        assert "PeerError" in str(exc) and f"rank {one}" in str(exc), str(exc)[-2000:]
    else:
        raise AssertionError("no error")
    comm.Barrier()


def test_io_callback_lowering(comm):
    """The other lowering (jax.experimental.io_callback): allreduce, its gradient and
    partial_allreduce inside jit give the same as MPI_Allreduce and the hand-computed sum."""
    from partialcoll.integrations import _jax_ops
    before, _jax_ops.lowering = _jax_ops.lowering, "io_callback"
    try:
        x = values(comm, (3, 4), np.float64, salt=21, integer=True)
        S = mpi_reference(comm, x, MPI.SUM)
        f = jax.jit(lambda v: (pcj.allreduce(v, MPI.SUM), pcj.allreduce(v, MPI.MAX)))
        s, m = f(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(s), S)
        np.testing.assert_array_equal(np.asarray(m), mpi_reference(comm, x, MPI.MAX))
        g = jax.jit(jax.grad(lambda v: jnp.sum(pcj.allreduce(v, MPI.SUM) ** 2)))(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(g), 2 * S)
        with pc.PartialAllreduce(12, np.float64, mode="full") as coll:
            data, posts = jax.jit(lambda v: pcj.partial_allreduce(v, coll))(jnp.asarray(x))
            np.testing.assert_array_equal(np.asarray(data), S)
            assert int(posts) == comm.size
    finally:
        _jax_ops.lowering = before


def test_device_path_emulated(comm, monkeypatch):
    """The GPU path outside jit (a JAX array on a GPU -> a CuPy view through DLPack ->
    partialcoll's device staging -> back through DLPack), run on the host: CPU arrays
    posing as GPU ones, with the stand-in CuPy of tests/fakecupy (the P = 2 job puts it on
    PYTHONPATH). Not a GPU run: the gpu-marked tests would be."""
    import importlib.util
    spec = importlib.util.find_spec("cupy")
    if spec is None or "fakecupy" not in str(spec.origin):
        pytest.skip("needs tests/fakecupy on PYTHONPATH (the P = 2 job puts it there)")
    from partialcoll.integrations import _jax_ops
    monkeypatch.setattr(_jax_ops, "_on_gpu", lambda x: isinstance(x, jax.Array))
    x = values(comm, (4, 3), np.float32, salt=31, integer=True)
    got = pcj.allreduce(jnp.asarray(x), MPI.SUM)
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), mpi_reference(comm, x, MPI.SUM))
    staged = [c for c in _jax_ops._cache.colls.values() if c.count == 12 and c.dtype == np.float32]
    assert staged and staged[0]._staging is not None        # the device staging ran
    with pc.PartialAllreduce(12, np.float32, mode="solo", late="fold") as coll:
        data, posts = pcj.partial_allreduce(jnp.asarray(x), coll)
        assert data.shape == (4, 3) and int(posts) >= 0 and coll._staging is not None
    pcj.close()


def test_close_cached(comm):
    """close() frees allreduce()'s collectives; a later call makes new ones."""
    pcj.close()
    x = values(comm, (3,), np.float32, salt=4, integer=True)
    np.testing.assert_array_equal(np.asarray(jax.jit(pcj.allreduce)(jnp.asarray(x))), mpi_reference(comm, x, MPI.SUM))
    pcj.close()


if __name__ == "__main__":
    run_module(__file__)
