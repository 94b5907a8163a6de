"""Solo allreduce under skew: run with  mpiexec -n 4 python examples/quickstart.py

Rank r computes for r ms before each post. With MPI_Allreduce every rank waits for
the slowest; with the solo partial allreduce the first rank to arrive starts the
round and the late ones contribute what they have (nothing is lost: see close()).
"""
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
steps, count = 50, 1024
x = np.full(count, rank + 1, np.float32)

comm.Barrier()
t0 = MPI.Wtime()
y = np.empty_like(x)
for _ in range(steps):
    time.sleep(rank * 1e-3)
    comm.Allreduce(x, y)
t_mpi = (MPI.Wtime() - t0) / steps

coll = pc.solo_allreduce(count, np.float32, MPI.SUM, comm, late="fold")
total, naps = np.zeros(count, np.float32), []
comm.Barrier()
t0 = MPI.Wtime()
for _ in range(steps):
    time.sleep(rank * 1e-3)
    res = coll.post(x).wait()
    total += res.data
    naps.append(res.nap)
t_solo = (MPI.Wtime() - t0) / steps
total += coll.close().data

expect = steps * size * (size + 1) / 2
assert np.allclose(total, expect), (total[0], expect)   # every posted value arrived
t_mpi, t_solo = comm.allreduce(t_mpi) / size, comm.allreduce(t_solo) / size
if rank == 0:
    print(f"# partialcoll {pc.__version__} on {pc.info()['mpi_library']}, {size} ranks, skew: rank r waits r ms")
    print(f"MPI_Allreduce  {t_mpi * 1e3:7.3f} ms/step")
    print(f"solo allreduce {t_solo * 1e3:7.3f} ms/step   ({t_mpi / t_solo:.1f}x faster, "
          f"mean NAP {np.mean(naps):.2f} of {size}; nothing lost: sum checked)")
