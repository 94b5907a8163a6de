#!/usr/bin/env bash
# Issue 7 on a machine with an NVIDIA GPU, after: pip install -e ".[test,cuda12]"
# (or [cuda13]). Prints which path device buffers take, runs the GPU tests at P = 2
# and 4, and measures a 64 MiB float32 full-mode allreduce at P = 2 with CuPy buffers
# and with NumPy buffers (each against MPI_Allreduce measured in the same run).
set -euo pipefail
python -c "import json, partialcoll as pc; print(json.dumps(pc.info(), indent=1))"
python -m pytest -m gpu -v -rs tests/test_device.py tests/test_torch.py
for buffers in cupy host; do
    mpiexec -n 2 partialcoll-bench latency -m 64M:64M -i 30 -x 3 --modes mpi,full --buffers "$buffers"
done
