"""partialcoll's JAX allreduce against mpi4jax's (or mpi4py's where mpi4jax is absent).

    mpiexec -n 2 python bench/jax_allreduce.py --calls 200 --passes 7 --steps 60

Overhead: a jitted function of one allreduce (SUM, float32) of 8 B and of 1 MiB, called
--calls times back to back (each result waited for), after 50 warm-up calls: us per
call, the slowest rank's mean, median and best of --passes passes; partialcoll inside
jit (a cached full-mode collective, called through each lowering: XLA's Python
callback, io_callback), outside jit, mpi4jax's allreduce inside jit (its XLA
FFI call) and mpi4py's Allreduce on NumPy arrays, in turn, pass after pass, in the same run.

Slow rank: a data-parallel step (a jitted gradient of a 64-256-10 MLP on a batch of 32,
then allreduce_gradients' update through optax) where rank P-1 sleeps --slow-ms more
per step; the fast rank's steps/s with mode "full" (--steps steps), with mode "solo"
(for as long as full took) and with a synchronous mpi4jax (else mpi4py) gradient
allreduce (--steps steps). Only rank 0 prints.
"""
import argparse
import os
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
import optax
from mpi4py import MPI

from partialcoll.integrations import _jax_ops, jax as pcj

try:
    import mpi4jax
except ImportError:
    mpi4jax = None


def per_call_us(comm, fn, x, calls):
    """us per call over `calls` calls, the slowest rank's mean (each result waited for)."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(x))
    dt = (time.perf_counter() - t0) / calls * 1e6
    return comm.allreduce(dt, op=MPI.MAX)


def overhead(comm, calls, passes):
    """{(bytes, peer): [us of each pass]}: the peers in turn, `passes` times."""
    rows = {}
    for nbytes in (8, 1 << 20):
        x = jnp.ones(nbytes // 4, jnp.float32)
        xn = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(xn)
        peers = []
        for lowering in _jax_ops.LOWERINGS:        # each traced under its lowering
            _jax_ops.lowering = lowering
            fn = jax.jit(lambda v: pcj.allreduce(v, MPI.SUM))
            jax.block_until_ready(fn(x))
            peers.append((f"partialcoll, jit ({lowering})", fn, x))
        _jax_ops.lowering = _jax_ops.LOWERINGS[0]
        peers.append(("partialcoll, eager", lambda v: pcj.allreduce(v, MPI.SUM), x))
        if mpi4jax is not None:
            peers.append(("mpi4jax, jit", jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM)), x))
        peers.append(("mpi4py Allreduce", lambda v: comm.Allreduce(v, out, op=MPI.SUM), xn))
        for _, fn, arg in peers:              # warm-up
            per_call_us(comm, fn, arg, 50)
        for _ in range(passes):               # alternating: load that comes and goes hits every peer
            for name, fn, arg in peers:
                rows.setdefault((nbytes, name), []).append(per_call_us(comm, fn, arg, calls))
    return rows


def mlp_params(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (64, 256)) * 0.1, "b1": jnp.zeros(256),
            "w2": jax.random.normal(k2, (256, 10)) * 0.1, "b2": jnp.zeros(10)}


def loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], y).mean()


def slow_rank(comm, steps, slow_s):
    """Steps/s of rank 0 (fast) with full, solo and a synchronous mpi4jax/mpi4py loop."""
    rank, size = comm.rank, comm.size
    params = mlp_params(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(rank + 1), (32, 64))
    y = jnp.arange(32) % 10
    delay = slow_s if rank == size - 1 else 0.0
    out = {}

    def run(step, state, stop):
        """step(p, state, x, y) -> (p, state): one jitted training step (one dispatch)."""
        p = params
        p, state = jax.block_until_ready(step(p, state, x, y))      # compile, and one round
        comm.Barrier()
        n, t0 = 0, time.perf_counter()
        while not stop(n, time.perf_counter() - t0):
            if delay:
                time.sleep(delay)
            p, state = jax.block_until_ready(step(p, state, x, y))
            n += 1
        return n / (time.perf_counter() - t0), time.perf_counter() - t0

    def partial(mode):
        tx = pcj.allreduce_gradients(mode=mode)
        opt = optax.chain(tx, optax.sgd(0.05))

        @jax.jit
        def step(p, state, x, y):
            u, state = opt.update(jax.grad(loss)(p, x, y), state, p)
            return optax.apply_updates(p, u), state
        return tx, step, opt.init(params)

    tx, step, state = partial("full")
    rate, seconds = run(step, state, lambda n, t: n >= steps)
    tx.close()
    out["full"] = rate
    tx, step, state = partial("solo")
    out["solo"] = run(step, state, lambda n, t: t >= seconds)[0]
    tx.close()
    if mpi4jax is not None:
        @jax.jit
        def sync(p, state, x, y):
            g = jax.tree_util.tree_map(lambda v: mpi4jax.allreduce(v, op=MPI.SUM) / size, jax.grad(loss)(p, x, y))
            return jax.tree_util.tree_map(lambda a, b: a - 0.05 * b, p, g), state
    else:
        def sync(p, state, x, y):     # the mpi4py loop where mpi4jax is absent
            g = jax.grad(loss)(p, x, y)
            red = {k: comm.allreduce(np.asarray(v), op=MPI.SUM) / size for k, v in g.items()}
            return {k: p[k] - 0.05 * red[k] for k in p}, state
    out["mpi4jax" if mpi4jax is not None else "mpi4py"] = run(sync, None, lambda n, t: n >= steps)[0]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per pass")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--slow-ms", type=float, default=30.0)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rows = overhead(comm, args.calls, args.passes)
    if comm.rank == 0:
        print(f"# allreduce SUM float32, P = {comm.size}, us per call: the slowest rank's mean over {args.calls} "
              f"calls, median and best of {args.passes} passes; mpi4jax {'present' if mpi4jax is not None else 'absent'}")
        print(f"{'bytes':>8}  {'peer':<36} {'median':>9} {'best':>9}")
        for (nbytes, name), us in rows.items():
            print(f"{nbytes:>8}  {name:<36} {np.median(us):>9.1f} {min(us):>9.1f}")
    rates = slow_rank(comm, args.steps, args.slow_ms / 1000)
    if comm.rank == 0:
        print(f"# MLP step, rank {comm.size - 1} {args.slow_ms:g} ms slower per step: rank 0's steps/s")
        for name, rate in rates.items():
            print(f"{name:<10} {rate:8.1f}   {rate / rates['full']:5.2f}x full")
    pcj.close()


if __name__ == "__main__":
    main()
