"""Horovod's torch API over partialcoll: python horovod_checks.py

The relevant cases of Horovod's own test/parallel/test_torch.py (allreduce sum, average,
in place, prescale/postscale, min/max/product, 0-d; broadcast, allgather,
broadcast_object; broadcast_parameters and broadcast_optimizer_state; the
DistributedOptimizer's named_parameters errors, compression, op= and
gradient_predivide_factor), with values that differ per rank: every rank makes every
rank's input from a seed, so each reference is computed here with plain torch, never
through partialcoll. Also: the drop-in defaults (mode "full", the drift warning), a
picklable PartialHookState, sync_parameters over a state_dict, and partial_ddp's handling
of BatchNorm buffers."""
from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from mpi4py import MPI

import partialcoll.integrations.torch as hvd
from partialcoll.integrations import _torch_common
from partialcoll.integrations._torch_hook import BufferSync
from _util import expect_raises, run_module

DTYPES = [torch.int32, torch.int64, torch.float32, torch.float64]


def rank_tensor(r: int, dtype=torch.float32, shape=(17, 3)) -> torch.Tensor:
    """Rank r's input: the same on every rank that makes it."""
    g = torch.Generator().manual_seed(1234 + r)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_sum_average_inplace(dtype):
    """Horovod's test_horovod_allreduce, _average, _inplace: the sum, the mean (integers
    floor-divided) and the in-place form, against the ranks' inputs summed here."""
    comm = MPI.COMM_WORLD
    mine = rank_tensor(comm.rank, dtype)
    total = sum(rank_tensor(r, torch.float64) for r in range(comm.size))
    keep = mine.clone()
    s = hvd.allreduce(mine, op=hvd.Sum, name="sum")
    assert torch.equal(mine, keep), "allreduce changed its input"
    assert s.dtype == dtype and torch.equal(s.double(), total)
    avg = hvd.allreduce(mine)                         # op=Average is the default
    want = total / comm.size if dtype.is_floating_point else torch.floor(total / comm.size)
    assert torch.allclose(avg.double(), want, atol=1e-5)
    assert torch.allclose(hvd.allreduce(mine, average=True).double(), want, atol=1e-5)
    out = hvd.allreduce_(mine, op=hvd.Sum)
    assert out is mine and torch.equal(mine.double(), total)


@pytest.mark.mpi
def test_allreduce_ops_scales_zero_dim():
    """Horovod's prescale/postscale, min/max/product and a 0-d tensor."""
    comm = MPI.COMM_WORLD
    ins = [rank_tensor(r, torch.float64) for r in range(comm.size)]
    mine = ins[comm.rank]
    total = sum(ins)
    got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert torch.allclose(got, total * 1.5)
    assert torch.equal(hvd.allreduce(mine, op=hvd.Min), torch.stack(ins).min(0).values)
    assert torch.equal(hvd.allreduce(mine, op=hvd.Max), torch.stack(ins).max(0).values)
    small = [torch.tensor([1.0 + r, 2.0]) for r in range(comm.size)]
    assert torch.equal(hvd.allreduce(small[comm.rank], op=hvd.Product), torch.stack(small).prod(0))
    zero_d = torch.tensor(float(comm.rank + 1))
    assert hvd.allreduce(zero_d, op=hvd.Sum).item() == comm.size * (comm.size + 1) / 2
    half = torch.full((5,), 0.5 + comm.rank, dtype=torch.float16)
    assert torch.equal(hvd.allreduce(half), torch.full((5,), 0.5 + (comm.size - 1) / 2, dtype=torch.float16))
    fp16 = hvd.allreduce(mine.float(), compression=hvd.Compression.fp16)
    assert fp16.dtype == torch.float32
    assert torch.allclose(fp16.double(), total / comm.size, atol=0.1)


@pytest.mark.mpi
def test_allreduce_errors():
    """Horovod's errors: op and average together, Adasum (not offered), process_set."""
    t = torch.ones(3)
    expect_raises(ValueError, hvd.allreduce, t, average=True, op=hvd.Sum, match="supersedes")
    expect_raises(ValueError, hvd.allreduce, t, op=hvd.Adasum, match="Adasum")
    expect_raises(ValueError, hvd.allreduce, t, process_set=object(), match="comm=")


@pytest.mark.mpi
def test_broadcast_allgather_object():
    """Horovod's test_horovod_broadcast, _inplace, test_horovod_allgather (first
    dimensions that differ by rank) and test_broadcast_object, from every root."""
    comm = MPI.COMM_WORLD
    for root in range(comm.size):
        mine = rank_tensor(comm.rank)
        got = hvd.broadcast(mine, root)
        assert torch.equal(got, rank_tensor(root)) and torch.equal(mine, rank_tensor(comm.rank))
        hvd.broadcast_(mine, root_rank=root)
        assert torch.equal(mine, rank_tensor(root))
        obj = hvd.broadcast_object({"root": comm.rank, "t": rank_tensor(comm.rank)[:2]} , root_rank=root)
        assert obj["root"] == root and torch.equal(obj["t"], rank_tensor(root)[:2])
    gathered = hvd.allgather(torch.full((comm.rank + 1, 3), float(comm.rank)))
    want = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(comm.size)])
    assert torch.equal(gathered, want)
    assert hvd.allgather_object(comm.rank * 10) == [r * 10 for r in range(comm.size)]
    assert hvd.rank() == comm.rank and hvd.size() == comm.size
    expect_raises(ValueError, hvd.broadcast_object, 1, root_rank=comm.size, match="outside")


class BNNet(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(6, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 2)
        with torch.no_grad():
            self.bn.running_mean.uniform_()
            self.bn.num_batches_tracked.fill_(seed + 5)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.mpi
def test_broadcast_parameters_state_dict_and_named():
    """Horovod's test_broadcast_state: a state_dict (buffers and BatchNorm's 0-d
    num_batches_tracked included) and named_parameters() become root's, checked against
    root's model made here from root's seed."""
    comm = MPI.COMM_WORLD
    root = comm.size - 1
    model = BNNet(comm.rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    assert same_state(model, BNNet(root))
    assert model.bn.num_batches_tracked.item() == root + 5
    model = BNNet(comm.rank)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    ref = BNNet(0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert torch.equal(model.bn.running_mean, BNNet(comm.rank).bn.running_mean)     # buffers: not named
    expect_raises(ValueError, hvd.broadcast_parameters, 3, 0, match="invalid params")
    # sync_parameters takes a state_dict too (its values, in order; 0-d tensors included)
    model = BNNet(comm.rank)
    hvd.sync_parameters(model.state_dict(), how="broadcast")
    assert same_state(model, BNNet(0))
    model = BNNet(comm.rank)
    hvd.sync_parameters(list(model.state_dict().values()), how="broadcast", root=root)
    assert same_state(model, BNNet(root))


@pytest.mark.mpi
@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.Adam(ps, lr=0.01)], ids=["sgd", "adam"])
def test_broadcast_optimizer_state(make):
    """Horovod's test_broadcast_state and _options: root stepped (its momentum or moments
    exist), the others are fresh with other options; after the broadcast every rank has
    root's state and options, and one more identical step keeps the models equal."""
    comm = MPI.COMM_WORLD
    model = BNNet(0)
    opt = make(model.parameters())
    if comm.rank == 0:
        model(torch.randn(8, 6)).sum().backward()
        opt.step()
    else:
        for g in opt.param_groups:
            g["lr"] = 7.0
    hvd.broadcast_parameters(model.state_dict(), 0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ref = make(BNNet(0).parameters())
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(99))
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]          # root's, not 7.0
    state = opt.state_dict()["state"]
    assert len(state) == len(list(model.parameters()))
    for other in comm.allgather({k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)}
                                 for k, s in state.items()}):
        for k, s in other.items():
            assert all(torch.equal(v, state[k][n]) for n, v in s.items())
    model.zero_grad()
    model(x).sum().backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert all(torch.equal(flat, f) for f in comm.allgather(flat))
    expect_raises(ValueError, hvd.broadcast_optimizer_state, torch.optim.LBFGS(model.parameters()), 0,
                  match="LBFGS")


def every_ranks_grads(model_seed: int, size: int, loss_scale: float = 1.0):
    """Each rank's gradients (rank r's batch from seed 500 + r), computed here."""
    out = []
    for r in range(size):
        m = BNNet(model_seed)
        g = torch.Generator().manual_seed(500 + r)
        (m(torch.randn(8, 6, generator=g)).sum() * loss_scale).backward()
        out.append([p.grad.clone() for p in m.parameters()])
    return out


def distributed_grads(size: int, rank: int, **kwargs):
    model = BNNet(3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), **kwargs)
    g = torch.Generator().manual_seed(500 + rank)
    model(torch.randn(8, 6, generator=g)).sum().backward()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.modes = [(b.coll.mode, b.coll.late) for b in opt._sync.buckets]      # close() lets the buckets go
    opt.close()
    return opt, grads


@pytest.mark.mpi
def test_optimizer_defaults_ops_compression():
    """The drop-in default is synchronous (every step the exact mean, as Horovod);
    op=Sum the sum; gradient_predivide_factor the mean; Compression.fp16 the mean of the
    gradients rounded to float16, back in float32 (Horovod's test_compression_fp16 and
    the optimizer's op cases). References: every rank's gradients computed here."""
    comm = MPI.COMM_WORLD
    ranks = every_ranks_grads(3, comm.size)
    mean = [sum(gs) / comm.size for gs in zip(*ranks)]
    total = [sum(gs) for gs in zip(*ranks)]
    opt, got = distributed_grads(comm.size, comm.rank)
    assert opt.modes and all(mode == "full" for mode, _ in opt.modes), opt.modes
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, hvd.DistributedOptimizer)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, mean))
    _, got = distributed_grads(comm.size, comm.rank, op=hvd.Sum)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, total))
    _, got = distributed_grads(comm.size, comm.rank, gradient_predivide_factor=4.0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, mean))
    _, got = distributed_grads(comm.size, comm.rank, compression=hvd.Compression.fp16)
    assert all(a.dtype == torch.float32 for a in got)
    half = [sum(g.half().float() for g in gs) / comm.size for gs in zip(*ranks)]
    assert all(torch.allclose(a, b, rtol=2e-3, atol=2e-3) for a, b in zip(got, half))
    t = torch.tensor([1.0, 2.5])
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float32
    c, ctx = hvd.Compression.none.compress(t)
    assert c is t and hvd.Compression.none.decompress(c, ctx) is t


@pytest.mark.mpi
def test_launcher_options():
    """pc.rc.torch (PARTIALCOLL_TORCH): DistributedOptimizer's options that the call does
    not pass, so a launcher picks a partial mode for a script as it is; what the call
    passes wins; the environment's text parsed, a malformed one refused."""
    import os
    import partialcoll as pc
    pc.rc.torch = {"mode": "solo", "late": "fold", "average": "nap"}
    try:
        opt, _ = distributed_grads(MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank)
        assert opt.modes and opt.modes == [("solo", "fold")] * len(opt.modes), opt.modes
        assert opt._sync.average == "nap"
        opt, _ = distributed_grads(MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank, mode="full", average="world")
        assert opt.modes and all(mode == "full" for mode, _ in opt.modes), opt.modes
        assert opt._sync.average == "world"
    finally:
        pc.rc.torch = {}
    opt, _ = distributed_grads(MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank)
    assert opt.modes and all(mode == "full" for mode, _ in opt.modes), opt.modes
    os.environ["PARTIALCOLL_TORCH"] = "mode=solo, late=fold,model_sync_every=4,max_staleness=none"
    try:
        assert type(pc.rc)().torch == {"mode": "solo", "late": "fold", "model_sync_every": 4, "max_staleness": None}
        os.environ["PARTIALCOLL_TORCH"] = "mode solo"
        expect_raises(ValueError, type(pc.rc), match="not name=value")
    finally:
        del os.environ["PARTIALCOLL_TORCH"]
    expect_raises(ValueError, setattr, pc.rc, "torch", "mode=solo", match="dict")


@pytest.mark.mpi
def test_optimizer_argument_errors():
    """Horovod's ValueErrors, raised on every rank before anything collective: names
    missing for some parameters (their gradients would never be averaged), duplicate
    names, entries that are not (name, parameter); gradient_predivide_factor with
    op=Sum; Adasum and Horovod's fusion options, which partialcoll does not offer."""
    model = BNNet(0)
    named = list(model.named_parameters())

    def make(*args, **kwargs):
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), *args, **kwargs)
    expect_raises(ValueError, make, named[:2], match="were not named")
    expect_raises(ValueError, make, named + [named[0]], match="duplicates: lin.weight")
    expect_raises(ValueError, make, [p for _, p in named], match="tuples (name, parameter)")
    expect_raises(ValueError, make, named, op=hvd.Sum, gradient_predivide_factor=2.0, match="op != Average")
    expect_raises(ValueError, make, named, op=hvd.Adasum, match="Adasum")
    expect_raises(ValueError, make, named, num_groups=2, match="bucket_mb")
    expect_raises(ValueError, make, named, compression="fp16", match="Compression.none or Compression.fp16")


@pytest.mark.mpi
def test_drift_warning_once():
    """A partial mode with late="latest" and no model_sync_every warns once; late="fold"
    and the full default do not."""
    comm = MPI.COMM_WORLD
    _torch_common._warned_drift = False
    model = BNNet(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kwargs in ({}, {"mode": "solo", "late": "fold"}, {"mode": "solo"}, {"mode": "majority"},
                       {"mode": "solo", "model_sync_every": 4}):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs).close()
    drift = [w for w in caught if "drift" in str(w.message)]
    assert len(drift) == 1 and "late='fold'" in str(drift[0].message), [str(w.message) for w in caught]
    comm.Barrier()


@pytest.mark.mpi
def test_hook_state_pickles():
    """PartialHookState pickles (PowerSGDState's way: options and iteration, not the
    group); unpickling makes a new state over the default group (collective)."""
    state = hvd.PartialHookState(mode="solo", late="fold", start_iter=3, model_sync_every=5)
    state.iter = 7
    blob = pickle.dumps(state)
    state.close()
    back = pickle.loads(blob)
    assert (back.mode, back.options, back.start_iter, back.model_sync_every, back.iter) == \
        ("solo", {"late": "fold"}, 3, 5, 7)
    assert back.comm.Get_size() == MPI.COMM_WORLD.Get_size() and not back.colls
    back.close()
    assert hvd.PartialHookState().mode == "full"


@pytest.mark.mpi
def test_partial_ddp_batchnorm_buffers():
    """partial_ddp with a partial mode and a BatchNorm model turns DDP's buffer broadcast
    from rank 0 off and averages the floating buffers through a solo round: each rank's
    buffers become the mean of those of the ranks inside the round (Result.active, each
    posted once), computed here from the values each rank set; num_batches_tracked stays
    each rank's. Passing broadcast_buffers=True with a partial mode warns."""
    comm = MPI.COMM_WORLD
    ddp, state = hvd.partial_ddp(BNNet(0), mode="solo", late="fold")
    assert not ddp.broadcast_buffers
    assert state.buffer_sync_every == 1
    ddp(torch.randn(4, 6)).sum().backward()          # the first forward makes the buffer sync (collective)
    assert state.buffer_sync is not None and state.buffer_sync.last is not None
    # the average itself, on a fresh BufferSync: rank r's buffers hold r (and 10 + r)
    bn = BNNet(0).bn
    with torch.no_grad():
        bn.running_mean.fill_(float(comm.rank))
        bn.running_var.fill_(float(10 + comm.rank))
        bn.num_batches_tracked.fill_(comm.rank)
    sync = BufferSync(list(bn.buffers()), comm)
    res = sync.sync()
    active = list(res.active)
    assert res.posts == len(active)
    # a round that holds nobody's buffers (a solo round may complete before any post is
    # read) leaves them as they were
    mean = sum(active) / len(active) if active else float(comm.rank)
    assert torch.allclose(bn.running_mean, torch.full((4,), mean))
    assert torch.allclose(bn.running_var, torch.full((4,), 10 + mean))
    assert bn.num_batches_tracked.item() == comm.rank
    sync.coll.close()
    state.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp2, state2 = hvd.partial_ddp(BNNet(0), mode="solo", late="fold", broadcast_buffers=True)
    assert any("paces the others" in str(w.message) for w in caught), [str(w.message) for w in caught]
    state2.close()
    ddp3, state3 = hvd.partial_ddp(BNNet(0))             # full: DDP's own buffer broadcast, as DDP
    assert state3.mode == "full" and not state3.buffer_sync_every
    state3.close()


@pytest.mark.mpi
def test_speed_aware_sampler():
    """Each rank's share of the epoch: equal before anything is measured, then in
    proportion to the rates the ranks noted (rank r: r + 1), the parts disjoint and
    together the whole dataset, the same permutation on every rank."""
    comm = MPI.COMM_WORLD
    n = 1000 + comm.size                          # not a multiple of the shares
    sampler = hvd.SpeedAwareSampler(n, smoothing=0.0, seed=3)
    sampler.set_epoch(0)
    parts = comm.allgather(list(sampler))
    assert sorted(len(p) for p in parts) in ([n // comm.size] * (comm.size - n % comm.size)
                                             + [n // comm.size + 1] * (n % comm.size),)
    assert sorted(i for p in parts for i in p) == list(range(n))
    sampler.note(10.0 * (comm.rank + 1))
    sampler.set_epoch(1)
    total = sum(range(1, comm.size + 1))
    want = [n * (r + 1) / total for r in range(comm.size)]
    parts = comm.allgather(list(sampler))
    assert all(abs(len(p) - w) < 1 for p, w in zip(parts, want)), ([len(p) for p in parts], want)
    assert len(sampler) == len(parts[comm.rank])
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert parts != [list(range(n))[sum(len(q) for q in parts[:r]):][:len(p)] for r, p in enumerate(parts)]
    # DistributedSampler's call, as Horovod's examples write it, with the name changed
    same = hvd.SpeedAwareSampler(n, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=3, drop_last=False)
    same.set_epoch(0)
    assert list(same) == list(hvd.SpeedAwareSampler(n, seed=3))
    expect_raises(ValueError, hvd.SpeedAwareSampler, n, num_replicas=comm.size + 1, match="num_replicas")
    expect_raises(ValueError, hvd.SpeedAwareSampler, n, rank=(comm.rank + 1) % (comm.size + 1), match="rank")


if __name__ == "__main__":
    run_module(__file__)
