"""Horovod's examples as ported (examples/horovod/: their imports changed, nothing else),
checked against the synchronous reference: python horovod_port.py (P >= 2)

1. pytorch_mnist.py, one epoch, every step's loss printed, twice in this process: first
   with ``import partialcoll.integrations.torch as hvd`` answered by _hvd_reference
   (Horovod's calls on mpi4py's blocking MPI_Allreduce), then as written (partialcoll,
   its default: mode "full"). Each rank compares the numbers it printed in both runs, in
   order, and prints ``COMPARED rank=R values=N maxdiff=D`` (the test bounds D).
2. pytorch_synthetic_benchmark.py (a BatchNorm CNN), a few batches, as written; it prints
   Horovod's img/sec lines.

The examples run as their own __main__ and the script ends as a script does (no
partialcoll.finalize(): the exit closes what is open); PASSED <rank> follows.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import sys

from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "..", "examples", "horovod")
MNIST = ["--epochs", "1", "--batch-size", "32", "--lr", "0.05", "--log-interval", "1"]
SYNTHETIC = ["--model", "resnet_small", "--batch-size", "4", "--num-warmup-batches", "1",
             "--num-batches-per-iter", "1", "--num-iters", "2"]
sys.path.insert(0, EXAMPLES)


def example(name, args):
    sys.argv = [name, *args]
    runpy.run_path(os.path.join(EXAMPLES, name), run_name="__main__")


def printed(name, args):
    """The numbers the example printed on this rank: each step's loss, the test's."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example(name, args)
    return [float(x) for x in re.findall(r"(?:Loss|Average loss|Accuracy): ([\d.]+)", out.getvalue())]


import _hvd_reference                   # noqa: E402
import partialcoll.integrations         # noqa: E402 - the package only: no collective, no hook

sys.modules["partialcoll.integrations.torch"] = _hvd_reference
partialcoll.integrations.torch = _hvd_reference
reference = printed("pytorch_mnist.py", MNIST)
del sys.modules["partialcoll.integrations.torch"], partialcoll.integrations.torch
port = printed("pytorch_mnist.py", MNIST)
assert "_hvd_reference" not in repr(sys.modules["partialcoll.integrations.torch"])
rank = MPI.COMM_WORLD.rank
diff = max(abs(a - b) for a, b in zip(port, reference)) if len(port) == len(reference) else float("inf")
# one write, newline included: the ranks' lines reach mpiexec's output whole
sys.stdout.write(f"COMPARED rank={rank} values={len(port)}/{len(reference)} maxdiff={diff:.3g}\n")
sys.stdout.flush()
example("pytorch_synthetic_benchmark.py", SYNTHETIC)
print(f"PASSED {rank}", flush=True)
