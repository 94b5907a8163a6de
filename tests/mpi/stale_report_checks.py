"""A stale peer-error report is ignored: mpiexec -n P python -m pytest --with-mpi stale_report_checks.py

A report is a message on the collective's own communicator. A peer may send one to a
collective this rank has dropped or closed already: it then stays in MPI's queue of
unexpected messages, and MPI may give the freed communicator's context id to the next
communicator made, so the message can match the next collective's receive for reports.
Each report names the collective it is about (an identity agreed at construction), and a
collective ignores reports about another. Here every rank sends reports with an identity
no collective has (as a dropped collective's peer would) on communicators that are then
freed, and the collectives made next must run their rounds as if nothing had been sent.
"""
from __future__ import annotations

import struct

import numpy as np
from mpi4py import MPI

import partialcoll as pc

STALE = 8          # communicators that get a stale report (so one of them is reused)


def alarm_tag(comm) -> int:
    """The tag reserved for reports: the largest tag whose bits are all ones."""
    tag_ub = comm.Get_attr(MPI.TAG_UB)
    return (1 << (int(tag_ub) + 1).bit_length() - 1) - 1


def report(ident: int, rank: int) -> bytes:
    """A report as the engine sends it: identity, rounds completed, rank, type[60], message[432]."""
    return struct.pack("<Qqi60s432s", ident, 0, rank, b"RuntimeError", b"a stale report")


def send_stale(comm):
    """A report from every rank to every peer on STALE communicators, freed after."""
    dups = [comm.Dup() for _ in range(STALE)]
    reqs = []
    for d in dups:
        for peer in range(comm.size):
            if peer != comm.rank:
                reqs.append(d.Isend(report(0xDEAD0000 + comm.rank, comm.rank), peer, alarm_tag(d)))
    MPI.Request.Waitall(reqs)
    comm.Barrier()           # every report is in its receiver's queue of unexpected messages
    for d in dups:
        d.Free()


def stale_in_new_communicators(comm) -> int:
    """How many stale reports the next STALE communicators made here see in their queues
    (MPI gave them the freed ones' context ids): the communicators the collectives make
    next get the same ids, so the reports reach them. Freed after."""
    dups = [comm.Dup() for _ in range(STALE)]
    seen = 0
    for d in dups:
        for peer in range(comm.size):
            seen += peer != comm.rank and bool(d.Iprobe(peer, alarm_tag(d)))
    for d in dups:
        d.Free()
    return seen


def test_stale_report_is_ignored(comm):
    expect = comm.size * (comm.size + 1) / 2
    x = np.full(1024, float(comm.rank + 1))
    for mode in ("full", "solo"):
        send_stale(comm)
        # the check is not vacuous: stale reports do land in communicators made later
        # (somewhere in the job; at P = 1 there is no peer to send one)
        assert comm.allreduce(stale_in_new_communicators(comm)) > 0 or comm.size == 1, \
            "no stale report reached a new communicator: MPI reused no context id here"
        colls = [pc.PartialAllreduce(1024, np.float64, mode=mode, comm=comm) for _ in range(STALE)]
        for _ in range(3):
            for coll in colls:
                res = coll.post(x).wait(timeout=30)
                if mode == "full":
                    assert np.all(res.data == expect), (mode, res.data[:3])
        for coll in colls:
            coll.close()
