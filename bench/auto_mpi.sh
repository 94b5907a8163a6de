#!/bin/sh
# "auto" against MPI_Allreduce on one node: P = 2 .. 8, 1 - 16 MiB of float32, RUNS runs
# each (every run measures both, size by size, on the same buffers: partialcoll-bench
# latency --modes mpi,full), then the median over runs of auto / MPI per (P, size), and
# what auto chose there (this machine's model parameters: partialcoll-bench calibrate).
#   flock /tmp/pc-bench.lock sh bench/auto_mpi.sh OUTDIR [RUNS]
# PS="2 3 4" runs those P only (a long series in parts: the summary reads every P of OUTDIR).
set -e
out=${1:?usage: auto_mpi.sh OUTDIR [RUNS]}
runs=${2:-5}
mkdir -p "$out"
for p in ${PS:-2 3 4 5 6 7 8}; do
  for run in $(seq 1 "$runs"); do
    timeout 600 mpiexec -n "$p" partialcoll-bench latency -m 1M:16M -f 4 --modes mpi,full -i 20 -x 3 \
      --json "$out/p$p-run$run.json" > /dev/null
  done
done
python - "$out" "$runs" <<'PY'
import json, statistics, sys
from partialcoll.algorithms import explain, model, tree
out, runs = sys.argv[1], int(sys.argv[2])
print("# auto / MPI_Allreduce (full mode, avg latency), median over runs; auto's choice")
print(f"# {'P':>2} {'bytes':>9} {'median':>7} {'runs':<40} algorithm")
import os
for p in range(2, 9):
    if not os.path.exists(f"{out}/p{p}-run{runs}.json"):
        continue
    by = {}
    for run in range(1, runs + 1):
        d = json.load(open(f"{out}/p{p}-run{run}.json"))
        for r in d["rows"]:
            if r["mode"] == "full":
                by.setdefault(r["bytes"], []).append(r["ratio_to_mpi"])
    for nbytes, vals in sorted(by.items()):
        chosen = explain("auto", nbytes, p, tree.normalize_groups([0] * p, p), model.load(), 4)[0]
        print(f"  {p:>2} {nbytes:>9} {statistics.median(vals):>7.3f} "
              f"{' '.join(f'{v:.2f}' for v in vals):<40} {chosen}")
PY
