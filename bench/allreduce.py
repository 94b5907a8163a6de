"""Persistent allreduce vs mpi4py Allreduce, every algorithm, one run.

    mpiexec -n 2 python bench/allreduce.py --json lat_p2.json
    mpiexec -n 4 python bench/allreduce.py

For each algorithm (auto, recursive_doubling, rabenseifner, ring) it runs partialcoll-bench's
latency sweep (8 B to 16 MiB, powers of 4: -f 4), which measures MPI_Allreduce and the
persistent allreduce (`pc.allreduce_init`, `post(x, out=y).wait()`) back to back on the
same buffers, and prints latency ratios to MPI.
"""
import argparse
import json
import sys

from mpi4py import MPI

from partialcoll.bench import parser
from partialcoll.bench.latency import latency

ALGORITHMS = ("auto", "recursive_doubling", "rabenseifner", "ring")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--sizes", default="8:16M")
    ap.add_argument("-i", "--iterations", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    table = {}
    for algorithm in ALGORITHMS:
        ns = parser().parse_args(["latency", "-m", args.sizes, "-f", "4", "-i", str(args.iterations), "-x", "50",
                                  "--modes", "mpi,full", "--algorithm", algorithm])
        rows = latency(comm, ns)["rows"]          # rank 0's: one per (size, mode)
        table[algorithm] = [r for r in rows if r["mode"] == "full"]
    if comm.rank == 0:
        print(f"# persistent allreduce / MPI_Allreduce latency, P = {comm.size}")
        print(f"# {'bytes':>10} " + " ".join(f"{a:>20}" for a in ALGORITHMS))
        for i, row in enumerate(table["auto"]):
            print(f"  {row['bytes']:>10} " + " ".join(f"{table[a][i]['ratio_to_mpi']:>20.2f}"
                                                      for a in ALGORITHMS))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"P": comm.size, "rows": table}, f, indent=1)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
