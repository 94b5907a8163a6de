"""partialcoll-bench latency: OSU-style sweep of allreduce latency over message sizes."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ._common import Collective, as_buffers, data, modes, sizes, to_numpy
from ._report import header, progress


def add_latency_args(p) -> None:
    p.add_argument("-m", "--sizes", default="8:1M", help="MIN:MAX message sizes in bytes (default 8:1M)")
    p.add_argument("-i", "--iterations", type=int, default=1000, help="timed iterations for small messages")
    p.add_argument("-x", "--warmup", type=int, default=100, help="untimed warm-up iterations")
    p.add_argument("--modes", default="mpi,full", help="comma list of mpi,impi,full,solo,majority,probe,quorum")
    p.add_argument("--algorithm", default="auto", help="auto, recursive_doubling or ring")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--quorum", type=int, default=None, help="k for mode quorum (default P/2)")
    p.add_argument("--candidates", type=int, default=2, help="q for mode probe (default 2)")
    p.add_argument("--buffers", default="host", choices=("host", "cupy"),
                   help="host (NumPy) or cupy (GPU; mpi/impi then stage through pinned host memory)")


def _iterations(nbytes: int, base: int) -> int:
    """OSU-like: fewer iterations for large messages."""
    return max(20, min(base, base * 8192 // max(nbytes, 8192)))


def latency(comm, args) -> dict:
    dtype = np.dtype(args.dtype)
    mode_list = modes(args.modes)
    size_list = sizes(args.sizes)
    if args.iterations < 1 or args.warmup < 0:
        raise ValueError("iterations must be >= 1 and warmup >= 0")
    quorum = args.quorum or max(1, comm.size // 2)
    rows = []
    if comm.rank == 0:
        print(header(f"latency (allreduce, SUM), {args.buffers} buffers", comm))
        print(f"# {'bytes':>10} " + " ".join(f"{m + ' avg/min/max us':>30}" for m in mode_list))
    for nbytes in size_list:
        count = max(1, nbytes // dtype.itemsize)
        x = data(count, dtype, comm.rank)
        expect = np.empty_like(x)
        comm.Allreduce(x, expect)
        x = as_buffers(x, args.buffers)
        iters = _iterations(count * dtype.itemsize, args.iterations)
        row = {"bytes": count * dtype.itemsize, "iterations": iters}
        for mode in mode_list:
            coll = Collective(mode, count, dtype, comm, args.algorithm, quorum, args.candidates,
                              buffers=args.buffers)
            y = x.copy()
            for _ in range(args.warmup if nbytes < (1 << 20) else min(args.warmup, 3)):
                coll.call(x, y)
            if mode in ("mpi", "impi", "full"):
                assert np.allclose(to_numpy(y), expect), f"{mode}: wrong result at {nbytes} B"
            comm.Barrier()
            t = MPI.Wtime()
            for _ in range(iters):
                coll.call(x, y)
            mine = (MPI.Wtime() - t) / iters * 1e6
            comm.Barrier()
            coll.close()
            row[f"{mode}_avg_us"] = comm.allreduce(mine) / comm.size
            row[f"{mode}_min_us"] = comm.allreduce(mine, op=MPI.MIN)
            row[f"{mode}_max_us"] = comm.allreduce(mine, op=MPI.MAX)
        if "mpi" in mode_list:
            for mode in mode_list:
                row[f"{mode}_ratio_to_mpi"] = row[f"{mode}_avg_us"] / row["mpi_avg_us"]
        rows.append(row)
        if comm.rank == 0:
            print(f"  {row['bytes']:>10} " + " ".join(
                f"{row[m + '_avg_us']:>12.2f}{row[m + '_min_us']:>9.2f}{row[m + '_max_us']:>9.2f}"
                for m in mode_list), flush=True)
        progress(f"{nbytes} B done")

    def plot(plt, path):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in mode_list:
            ax.loglog([r["bytes"] for r in rows], [r[m + "_avg_us"] for r in rows], marker="o", label=m)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("latency (us)")
        ax.set_title(f"allreduce latency, P = {comm.size}")
        ax.legend()
        fig.savefig(path, dpi=120, bbox_inches="tight")

    return {"command": "latency", "P": comm.size, "modes": mode_list, "algorithm": args.algorithm,
            "dtype": dtype.name, "buffers": args.buffers, "rows": rows, "plot": plot} if comm.rank == 0 else {"rows": rows}
