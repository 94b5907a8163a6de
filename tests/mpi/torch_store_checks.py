"""torch.distributed over MPI without an address (across hosts): python torch_store_checks.py

``init_process_group(comm, backend="gloo")`` and ``dist.init_process_group("gloo",
init_method="mpi://")`` (no MASTER_ADDR) find rank 0's TCPStore over MPI. Across hosts that store
must be reached at one of rank 0's real addresses: its host name resolved to loopback
there (tests/hosts.py gives the emulated hosts one name, as Debian's /etc/hosts maps a
node's name to 127.0.1.1), and every other rank waited for the store's timeout."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import partialcoll.integrations.torch as pct
from _util import run_module


def allreduce_against_mpi(comm):
    t = torch.arange(5, dtype=torch.float64) + comm.rank
    dist.all_reduce(t)
    want = sum(torch.arange(5, dtype=torch.float64) + r for r in range(comm.size))
    assert torch.equal(t, want), (t, want)


def test_gloo_store_found_over_mpi(comm):
    pct.init_process_group(comm, backend="gloo")
    try:
        assert dist.get_backend() == "gloo" and dist.get_rank() == comm.rank
        allreduce_against_mpi(comm)
    finally:
        dist.destroy_process_group()


def test_mpi_rendezvous_without_master_addr(comm):
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    pct.register_backend()
    dist.init_process_group("gloo", init_method="mpi://")     # partialcoll's rendezvous scheme
    try:
        assert dist.get_world_size() == comm.size
        allreduce_against_mpi(comm)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_module(__file__)
