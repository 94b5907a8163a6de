"""eager-SGD in JAX: a small CNN learns scikit-learn's digits, with and without a slow rank.

    mpiexec -n 2 python examples/jax_digits.py
    mpiexec -n 4 python examples/jax_digits.py --epochs 3 --slow-ms 0,30 --trainers full,solo,sync

The 1,797 8x8 digits of scikit-learn (load_digits), 360 held out; every rank trains on
its own shard of the rest, in plain JAX (a 3x3 convolution, ReLU, a dense layer) with
optax's SGD, one jitted function per step. Trainers:

  full   allreduce_gradients(mode="full") before optax.sgd: an allreduce per step
  solo   allreduce_gradients(mode="solo", late="fold"): the first rank to post starts
         the round, a late rank's gradients join a later one (nothing is lost)
  sync   the synchronous loop users write with mpi4jax: mpi4jax.allreduce of every
         gradient inside the jitted step (mpi4py's Allreduce between jitted calls where
         mpi4jax is not installed)

The models are averaged after every epoch with partialcoll's allreduce (mpi4jax's call;
eager-SGD section 5), then evaluated. --slow-ms: for each value, rank P-1 sleeps that
long before every step. Reported by rank 0 per trainer and delay: its own steps/s over
the training steps (the epoch-end averaging and evaluation excluded), and the held-out
accuracy after the last epoch.
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

from partialcoll.integrations import jax as pcj

try:
    import mpi4jax
except ImportError:
    mpi4jax = None


def load(comm, test_size=360):
    """(this rank's training shard, the test set); the split is the same everywhere."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, :, :, None]     # NHWC
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    test, train = order[:test_size], order[test_size:]
    mine = train[comm.rank::comm.size]
    return (x[mine], y[mine]), (x[test], y[test])


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {"conv": jax.random.normal(k1, (3, 3, 1, 8)) * 0.3, "conv_b": jnp.zeros(8),
            "dense": jax.random.normal(k2, (8 * 8 * 8, 10)) * 0.05, "dense_b": jnp.zeros(10)}


def logits(p, x):
    h = jax.lax.conv_general_dilated(x, p["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(h + p["conv_b"])
    return h.reshape(h.shape[0], -1) @ p["dense"] + p["dense_b"]


def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()


def make_step(trainer, size, lr):
    """(step(p, state, x, y) -> (p, state), init state, the transformation or None)."""
    if trainer in ("full", "solo"):
        tx = pcj.allreduce_gradients(mode=trainer, **({"late": "fold"} if trainer == "solo" else {}))
        opt = optax.chain(tx, optax.sgd(lr))

        @jax.jit
        def step(p, state, x, y):
            updates, state = opt.update(jax.grad(loss)(p, x, y), state, p)
            return optax.apply_updates(p, updates), state
        return step, opt.init, tx
    opt = optax.sgd(lr)
    if mpi4jax is not None:
        @jax.jit
        def step(p, state, x, y):
            g = jax.tree_util.tree_map(lambda v: mpi4jax.allreduce(v, op=MPI.SUM) / size, jax.grad(loss)(p, x, y))
            updates, state = opt.update(g, state, p)
            return optax.apply_updates(p, updates), state
        return step, opt.init, None
    grad = jax.jit(jax.grad(loss))
    apply = jax.jit(lambda p, state, g: (lambda u_s: (optax.apply_updates(p, u_s[0]), u_s[1]))(opt.update(g, state, p)))

    def step_mpi4py(p, state, x, y):
        g = {k: jnp.asarray(MPI.COMM_WORLD.allreduce(np.asarray(v), op=MPI.SUM) / size)
             for k, v in grad(p, x, y).items()}
        return apply(p, state, g)
    return step_mpi4py, opt.init, None


def train(comm, trainer, slow_s, data, epochs, batch, lr):
    (x, y), (xt, yt) = data
    size = comm.size
    step, init, tx = make_step(trainer, size, lr)
    params = init_params(jax.random.PRNGKey(0))
    state = init(params)
    steps = len(x) // batch
    n_min = comm.allreduce(steps, op=MPI.MIN)          # the same number of steps everywhere
    delay = slow_s if comm.rank == size - 1 else 0.0
    busy, done, acc = 0.0, 0, 0.0
    params, state = jax.block_until_ready(step(params, state, x[:batch], y[:batch]))    # compile
    for epoch in range(epochs):
        order = np.random.default_rng(100 * epoch + comm.rank).permutation(len(x))
        t0 = time.perf_counter()
        for i in range(n_min):
            if delay:
                time.sleep(delay)
            idx = order[i * batch:(i + 1) * batch]
            params, state = jax.block_until_ready(step(params, state, x[idx], y[idx]))
        busy += time.perf_counter() - t0
        done += n_min
        params = jax.tree_util.tree_map(lambda v: pcj.allreduce(v, MPI.SUM) / size, params)   # average models
        acc = float(jnp.mean(jnp.argmax(logits(params, xt), -1) == yt))
    if tx is not None:
        tx.close()
    return done / busy, acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--slow-ms", default="0,30", help="comma-separated delays of rank P-1 per step")
    ap.add_argument("--trainers", default="full,solo,sync")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    data = load(comm)
    sync_name = "sync (mpi4jax)" if mpi4jax is not None else "sync (mpi4py)"
    if comm.rank == 0:
        print(f"# digits CNN, P = {comm.size}, {args.epochs} epochs, batch {args.batch}: rank 0's steps/s, "
              f"held-out accuracy")
        print(f"{'trainer':<16} {'slow ms':>7} {'steps/s':>8} {'accuracy':>8}")
    for slow in (float(s) for s in args.slow_ms.split(",")):
        for trainer in args.trainers.split(","):
            rate, acc = train(comm, trainer, slow / 1000, data, args.epochs, args.batch, args.lr)
            if comm.rank == 0:
                name = sync_name if trainer == "sync" else trainer
                print(f"{name:<16} {slow:>7g} {rate:>8.1f} {acc:>8.3f}", flush=True)
    pcj.close()


if __name__ == "__main__":
    main()
