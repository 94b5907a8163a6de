"""Run a training script as it is under mpiexec, with one rank made a persistent straggler:
the launcher's side of a port, nothing in the script changes.

    mpiexec -n 4 python bench/straggle.py --slow-ms 30 examples/horovod/pytorch_mnist.py --epochs 2

The chosen rank (--slow-rank, default the last, so that rank 0's prints are a fast
rank's) sleeps --slow-ms before every optimizer step (torch's global optimizer step
pre-hook, so any torch.optim optimizer, wrapped or not). --times DIR: each rank writes
DIR/rank<r>.json with the wall-clock time of its first step and of its exit (after the
script's own exit handlers, so an exit that waits for peers counts) and its step count.
DIR/rank<r>.json also holds ``tests``: the wall-clock time at which each line the script
printed with "Test set:" in it was written (pytorch_mnist.py's held-out accuracy after
each epoch, on rank 0), for the time to reach an accuracy.
--hvd mpi4py: ``partialcoll.integrations.torch`` is replaced by tests/mpi/_hvd_reference.py (Horovod's
calls written on mpi4py's blocking MPI_Allreduce / MPI_Bcast: the synchronous reference a
port's default must equal).
"""
import argparse
import atexit
import json
import os
import runpy
import sys
import time

from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow-ms", type=float, default=30.0)
    parser.add_argument("--slow-rank", type=int, default=-1, help="the straggler's rank (negative: from the end)")
    parser.add_argument("--times", help="a folder for each rank's rank<r>.json")
    parser.add_argument("--hvd", choices=["partialcoll", "mpi4py"], default="partialcoll")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    slow = args.slow_rank % size
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    state = {"first": None, "steps": 0, "tests": []}

    def pre_step(optimizer, a, kw):
        if state["first"] is None:
            state["first"] = time.time()
        state["steps"] += 1
        if rank == slow and args.slow_ms > 0:
            time.sleep(args.slow_ms / 1000)

    register_optimizer_step_pre_hook(pre_step)
    if args.hvd == "mpi4py":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "mpi"))
        import _hvd_reference
        import partialcoll.integrations     # the package only: no collective, no hook
        sys.modules["partialcoll.integrations.torch"] = _hvd_reference
        partialcoll.integrations.torch = _hvd_reference

    def written() -> None:
        if args.times:
            with open(os.path.join(args.times, f"rank{rank}.json"), "w") as f:
                json.dump({"first": state["first"], "end": time.time(), "steps": state["steps"],
                           "slow": rank == slow, "tests": state["tests"]}, f)

    class Stamped:
        """sys.stdout, noting when each test line is written."""

        def __init__(self, out):
            self.out = out

        def write(self, text):
            if "Test set:" in text:
                state["tests"].append(time.time())
            return self.out.write(text)

        def __getattr__(self, name):
            return getattr(self.out, name)

    sys.stdout = Stamped(sys.stdout)
    atexit.register(written)      # before the script's handlers: it runs after them
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
