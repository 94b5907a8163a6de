"""Device buffers (issue 7): PC_TEST_BUFFERS=cupy|emulated python device_checks.py

The full mode gives bit for bit what the host path gives on the same data (and what
MPI_Allreduce gives, to rounding); every partial mode loses nothing with float32 and
float64 device buffers (integer values, so sums are exact in any order), also when posts
overlap, which drives the staged accumulator (pending (op) x, then replace) and its race
with the engine's TAKE; schedules run on device buffers through their mirrors;
NeighborAllreduce, AsyncAverager and HierarchicalAllreduce.average take device buffers
and give device results, equal to their host paths'.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _data import values
from _devices import KIND, to_device, to_host
from _util import expect_raises, run_module

DTYPES = [np.float32, np.float64]
MODES = ["solo", "majority", "probe", "quorum", "full"]


assert KIND != "host", "run with PC_TEST_BUFFERS=cupy or emulated"

def options(mode, comm):
    return {"quorum": {"quorum": max(1, (comm.size + 1) // 2)}, "probe": {"candidates": 2}}.get(mode, {})


def test_full_mode_equals_host_path(comm):
    for dt in DTYPES:
        for count in (0, 1, comm.size + 1, 1000, 70_000):        # 70_000 float32s: ring under "auto"
            dev = pc.allreduce_init(count, dt, comm=comm)
            host = pc.allreduce_init(count, dt, comm=comm)
            for it in range(3):
                x = values(dt, MPI.SUM, count, comm.rank, salt=it)
                got = to_host(dev.post(to_device(x)).wait().data)
                ref = host.post(x).wait().data
                assert got.tobytes() == ref.tobytes(), (dt, count, it, np.abs(got - ref).max())
                mpi = np.empty_like(x)
                comm.Allreduce(x, mpi)
                assert np.allclose(got, mpi, rtol=1e-5, atol=1e-5)
            # the result lands in out=, wherever out lives
            x = to_device(values(dt, MPI.SUM, count, comm.rank))
            out = to_device(np.zeros(count, dt))
            res = dev.post(x, out=out).wait()
            assert res.data is out
            ref = host.post(to_host(x)).wait().data
            assert to_host(out).tobytes() == ref.tobytes()
            host_out = np.zeros(count, dt)
            assert dev.post(x, out=host_out).wait().data is host_out       # device in, host out
            assert host_out.tobytes() == ref.tobytes()
            res = dev.post(to_host(x), out=out).wait()                      # host in, device out
            assert res.data is out and to_host(out).tobytes() == ref.tobytes()
            for c in (dev, host):
                c.close()


def test_every_mode_nothing_lost(comm):
    """Skewed and overlapping posts: the results plus close() hold every posted value once."""
    replaced = 0
    for mode in MODES:
        for dt in DTYPES:
            coll = pc.PartialAllreduce(7, dt, MPI.SUM, comm, mode=mode, late="fold", seed=5, **options(mode, comm))
            calls = []
            real = coll._post_replace
            coll._post_replace = lambda x: calls.append(real(x)) or calls[-1]
            rng = np.random.default_rng(comm.rank)
            posted = np.zeros(7, dt)
            got = np.zeros(7, dt)
            for i in range(40):
                time.sleep(rng.uniform(0, 0.004))
                a = np.arange(7, dtype=dt) + 100 * comm.rank + i
                b = a * 2
                r1 = coll.post(to_device(a))
                r2 = coll.post(to_device(b))          # often while `a` still waits in the accumulator
                got += to_host(r1.wait().data) + to_host(r2.wait().data)
                posted += a + b
            got += to_host(coll.close().data)
            everyone = np.empty_like(posted)
            comm.Allreduce(posted, everyone)
            assert np.array_equal(got, everyone), (mode, dt, got, everyone)
            replaced += sum(1 for *_, ok in calls if ok)
    # majority/probe: a rank that is not a candidate posts twice before any round takes its data
    total = comm.allreduce(replaced)
    assert comm.size == 1 or total > 0, "no post went through pc_coll_post_replace"


def test_mixed_host_and_device_posts(comm):
    """Host posts fold on the host: the device's pending copy is then no longer the accumulator."""
    coll = pc.PartialAllreduce(3, np.float64, MPI.SUM, comm, mode="majority", late="fold")
    got = np.zeros(3)
    kinds = ["host", "device", "device", "host", "device", "device"]
    for i in range(30):
        reqs = []
        for k, kind in enumerate(kinds):
            x = np.full(3, float(comm.rank + i) * (k + 1))
            reqs.append(coll.post(x if kind == "host" else to_device(x)))
        for r in reqs:
            d = r.wait().data
            got += d if type(d) is np.ndarray else to_host(d)
    got += to_host(coll.close().data)                # the last post was on the device
    expect = sum(range(1, len(kinds) + 1)) * sum(r + i for r in range(comm.size) for i in range(30))
    assert np.array_equal(got, np.full(3, float(expect))), (got, expect)


def test_schedule_with_device_buffers(comm):
    """A ring step on device buffers: acc = acc + (what the left neighbour sent), 4 executions."""
    p, r = comm.size, comm.rank
    left, right = (r - 1) % p, (r + 1) % p
    sbuf, rbuf, acc = (to_device(np.zeros(5, np.float64)) for _ in range(3))
    s = pc.Schedule(comm)
    got = s.recv(rbuf, source=left)
    s.send(sbuf, dest=right)
    s.compute(MPI.SUM, rbuf, acc, after=got)           # acc = rbuf (SUM) acc
    s.commit()
    expect = np.zeros(5)
    for it in range(4):
        mine = np.arange(5.0) + 10 * r + it
        _set(sbuf, mine)
        req = s.start()
        if it % 2:
            while not req.test():                      # test() also brings the results back
                time.sleep(0.001)
        else:
            req.wait()
        expect += np.arange(5.0) + 10 * left + it
        assert np.array_equal(to_host(acc), expect), (it, to_host(acc), expect)
        assert np.array_equal(to_host(rbuf), np.arange(5.0) + 10 * left + it)
    s.free()
    t = pc.Schedule(comm)
    whole = to_device(np.zeros(8))
    t.send(whole[:4], dest=right)
    expect_raises(pc.InvalidBufferError, t.recv, whole[2:6], source=left, match="overlaps")


def _set(dev, host):
    if KIND == "cupy":
        dev.set(host)
    else:
        np.copyto(dev.view(np.ndarray), host)


def test_neighbor_allreduce_on_device(comm):
    """NeighborAllreduce takes device updates and gives device results (out= on the device,
    or none and x there), bit for bit what the host path gives; a device x with a host
    out=, or the reverse, works too; depth requests outstanding reuse the result boxes."""
    g = pc.ring_graph(comm)
    with pc.NeighborAllreduce(1000, np.float64, comm=g) as dev, pc.NeighborAllreduce(1000, np.float64, comm=g) as host:
        for rounds in range(3):
            xs = [values(np.float64, MPI.SUM, 1000, comm.rank, salt=10 * rounds + k) for k in range(dev.depth)]
            outs = [to_device(np.zeros(1000)) if k % 3 == 1 else np.zeros(1000) if k % 3 == 2 else None
                    for k in range(dev.depth)]
            reqs = [dev.post(to_device(x), out=o) for x, o in zip(xs, outs)]
            refs = [host.post(x).wait(timeout=60).data.copy() for x in xs]
            for k, (req, ref) in enumerate(zip(reqs, refs)):
                data = req.wait(timeout=60).data
                got = to_host(data) if k % 3 != 2 else data
                assert got.tobytes() == ref.tobytes(), (rounds, k)
                if outs[k] is not None:
                    assert data is outs[k]
        x = values(np.float64, MPI.SUM, 1000, comm.rank, salt=99)
        out = to_device(np.zeros(1000))
        assert dev.post(x, out=out).wait(timeout=60).data is out             # host in, device out
        assert to_host(out).tobytes() == host.post(x).wait(timeout=60).data.tobytes()
    g.Free()


def test_averager_on_device(comm):
    """AsyncAverager.push takes a device array and its mean comes back on the device;
    HierarchicalAllreduce.average too; each equal to the host path's."""
    if pc.rc.progress == "inline":
        pytest.skip("the averager's server needs the progress thread (progress is inline here)")
    with pc.AsyncAverager(33, np.float32, comm=comm, server=comm.size - 1) as avg:
        for i in range(3):                   # every rank's latest vector is x when each mean is made
            x = np.arange(33, dtype=np.float32) + comm.rank + i
            avg.push(x).wait(timeout=60)
            comm.Barrier()
            mean = to_host(avg.push(to_device(x)).wait(timeout=60))
            mean_host = avg.push(x).wait(timeout=60)
            assert mean.tobytes() == mean_host.tobytes(), (i, mean, mean_host)
            comm.Barrier()
    h = pc.HierarchicalAllreduce(5, np.float64, MPI.SUM, comm)      # one group: its pusher's parameters
    for k in range(2):
        params = np.arange(5.0) + 10 * k
        assert to_host(h.average(to_device(params), timeout=60)).tobytes() == params.tobytes()
    h.close()


def test_bad_device_input(comm):
    coll = pc.PartialAllreduce(6, np.float32, MPI.SUM, comm)
    expect_raises(pc.InvalidBufferError, coll.post, to_device(np.zeros(6, np.float64)), match="dtype")
    expect_raises(pc.InvalidBufferError, coll.post, to_device(np.zeros(5, np.float32)), match="elements")
    expect_raises(pc.InvalidBufferError, coll.post, to_device(np.zeros(12, np.float32))[::2], match="contiguous")
    expect_raises(pc.InvalidBufferError, coll.post, np.zeros(6, np.float32), out=to_device(np.zeros(6, np.int32)),
                  match="dtype")
    coll.close()


if __name__ == "__main__":
    run_module(__file__)
