"""PyTorch integration: python torch_checks.py

The partialcoll process group comes up with no address, port or gloo; then gloo (its
store found over MPI) is the reference: DDP's default reduction and gloo's collectives.
Models have several buckets (a tiny bucket_cap_mb), so DDP's bucket rebuild after the
first iteration changes them.

PC_TEST_TORCH_DEVICE selects the device path:
  cpu       (default) host tensors, NumPy views
  cuda      a real GPU: CUDA tensors, CuPy views where CuPy is installed, else pinned copies
  emulated  CPU tensors sent down the device path (_torch_common.DEVICE_TYPES gets "cpu"):
            pinned-style host copies and their write-back, on machines without a GPU
  fakecupy  the same with tests/fakecupy on PYTHONPATH: CuPy views (DLPack) of the tensors
            and partialcoll's device staging, run by the stand-in CuPy on host memory"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import partialcoll as pc
import partialcoll.integrations.torch as pct
from partialcoll.integrations import _torch_common
from partialcoll.integrations.torch import (DistributedOptimizer, GradientSynchronizer, PartialHookState,
                                            partial_allreduce_hook, sync_parameters)
from _util import expect_raises, run_module

KIND = os.environ.get("PC_TEST_TORCH_DEVICE", "cpu")
if KIND in ("emulated", "fakecupy"):
    _torch_common.DEVICE_TYPES.append("cpu")
    if KIND == "fakecupy":
        assert _torch_common.gpu_usable(), "PC_TEST_TORCH_DEVICE=fakecupy needs tests/fakecupy on PYTHONPATH"
DEV = torch.device("cuda" if KIND == "cuda" else "cpu")
if KIND == "cuda":                        # one GPU per rank where there are several
    torch.cuda.set_device(pct.local_rank() % torch.cuda.device_count())


def host(data) -> np.ndarray:
    """A result's data (NumPy, CuPy or its stand-in) as a NumPy array."""
    return data.get() if hasattr(data, "get") else np.asarray(data)
D, H, C = 12, 24, 5
CAP = 0.0002                      # MiB: one or two tensors per bucket -> 3 buckets after the rebuild
MODES = [("solo", {}), ("majority", {}), ("probe", {"candidates": 2}), ("quorum", {"quorum": 2}),
         ("full", {})]


class Net(torch.nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, H),
                                        torch.nn.Tanh(), torch.nn.Linear(H, C))
        self.unused = torch.nn.Linear(3, 3) if unused else None     # never in the forward pass

    def forward(self, x):
        return self.body(x)


def model(dtype=torch.float32, unused=False):
    torch.manual_seed(0)
    return Net(unused).to(device=DEV, dtype=dtype)


def batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, D, generator=g)
    y = (x[:, :C] * 2).argmax(1)
    return x.to(DEV, dtype), y.to(DEV)


def loss_of(m, x, y):
    return torch.nn.functional.cross_entropy(m(x).float(), y)


def held_out_loss(m):
    """The loss on one fixed batch of 512 that no step trains on: it depends on the
    parameters only, not on which batch a step drew (a check that training made progress)."""
    g = torch.Generator().manual_seed(999_999)
    x = torch.randn(512, D, generator=g)
    y = (x[:, :C] * 2).argmax(1)
    with torch.no_grad():
        return loss_of(m, x.to(DEV, next(m.parameters()).dtype), y.to(DEV)).item()


def train(m, rank, steps, opt=None, lr=0.05, accumulate=1, slow=None, dtype=torch.float32):
    """SGD steps; `accumulate` micro-batches per step under no_sync (DDP) ; returns losses."""
    opt = opt or torch.optim.SGD(m.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        if slow is not None and rank == slow(step):
            time.sleep(0.003)
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(rank, step * accumulate + micro, dtype)
            if micro < accumulate - 1:
                with m.no_sync():
                    loss_of(m, x, y).backward()
            else:
                loss = loss_of(m, x, y)
                loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


def params_close(a, b, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        diff = (p.detach().float() - q.detach().float()).abs().max().item()
        assert torch.allclose(p.detach().float(), q.detach().float(), rtol=rtol, atol=atol), (name, diff)


def same_on_every_rank(comm, m):
    flat = torch.cat([p.detach().float().cpu().reshape(-1) for p in m.parameters()]).numpy()
    everyone = comm.allgather(flat)
    return all(np.array_equal(everyone[0], f) for f in everyone)


# -- the process group ------------------------------------------------------------------------
def test_process_group_without_env(comm):
    """dist.init_process_group("partialcoll") under mpiexec: nothing in the environment."""
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    pct.register_backend()
    dist.init_process_group("partialcoll", init_method="mpi://")
    assert dist.get_backend() == "partialcoll"
    assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, comm.size)
    t = torch.full((5,), float(comm.rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [comm.size * (comm.size + 1) / 2] * 5
    big = torch.arange(40000, dtype=torch.float32) + comm.rank         # 160 KB: through the engine
    work = dist.all_reduce(big, async_op=True)
    assert work.get_future().wait()[0] is big
    work.wait()
    assert torch.equal(big, comm.size * torch.arange(40000, dtype=torch.float32) + sum(range(comm.size)))
    dist.barrier()
    dist.destroy_process_group()



@pytest.fixture(scope="module")
def pcg(comm):
    """The default process group on gloo (the reference; its store over MPI) and a
    partialcoll group beside it, for every check after the first."""
    pct.init_process_group(comm, backend="gloo")
    yield dist.new_group(backend="partialcoll")
    dist.destroy_process_group()


def test_device_path_taken(comm, pcg):
    """The buckets took the path this run asks for: NumPy views (cpu), staged host copies
    (emulated, or CUDA without CuPy), CuPy views (fakecupy, or CUDA with CuPy)."""
    x, land = _torch_common.buffer_of(torch.zeros(8, device=DEV))
    cupy_path = KIND == "fakecupy" or (KIND == "cuda" and _torch_common.gpu_usable())
    if cupy_path:
        assert type(x).__module__.split(".")[0] == "cupy" and land is None, type(x)
    elif KIND == "cpu":
        assert type(x) is np.ndarray and land is None
    else:
        assert type(x) is np.ndarray and land is not None
    m = model()
    ddp = DDP(m, bucket_cap_mb=CAP)
    state = PartialHookState(mode="full", comm=comm, start_iter=0)
    ddp.register_comm_hook(state, partial_allreduce_hook)
    train(ddp, comm.rank, 2)
    kinds = {type(r.data).__module__.split(".")[0] for r in state.last.values()}
    assert kinds == ({"cupy"} if cupy_path else {"numpy"}), kinds
    state.close()


def test_collectives_match_gloo(comm, pcg):
    """Each collective of the partialcoll group gives gloo's result on the same inputs."""
    P, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(r)

    def both(fn):
        out = []
        for group in (None, pcg):                # None: the default group, gloo
            out.append(fn(group))
        return out

    def allreduce(op, dtype, n):
        def run(group):
            t = (torch.randn(n, generator=torch.Generator().manual_seed(r)) * 10).to(dtype)
            work = dist.all_reduce(t, op=op, group=group, async_op=True)
            work.wait()
            return t
        return run

    cases = [(dist.ReduceOp.SUM, torch.float32, 7), (dist.ReduceOp.SUM, torch.float32, 70000),
             (dist.ReduceOp.SUM, torch.float64, 20000), (dist.ReduceOp.MAX, torch.float32, 9),
             (dist.ReduceOp.MIN, torch.int64, 9), (dist.ReduceOp.SUM, torch.int32, 11),
             (dist.ReduceOp.PRODUCT, torch.float64, 5), (dist.ReduceOp.SUM, torch.float16, 3001),
             (dist.ReduceOp.SUM, torch.bfloat16, 3001), (dist.ReduceOp.AVG, torch.float32, 70000)]
    for op, dtype, n in cases:
        if op == dist.ReduceOp.AVG:
            ref = allreduce(dist.ReduceOp.SUM, dtype, n)(None) / P      # gloo has no AVG
            ours = allreduce(op, dtype, n)(pcg)
        else:
            ref, ours = both(allreduce(op, dtype, n))
        if dtype in (torch.float16, torch.bfloat16) and op == dist.ReduceOp.SUM:
            # Both sums are rounded P - 1 times, in different orders: each must be within
            # (P - 1) roundings of the exact sum of the 16-bit inputs, not within a fixed
            # tolerance of the other (the two may differ by two such bounds).
            inputs = [(torch.randn(n, generator=torch.Generator().manual_seed(q)) * 10).to(dtype).double()
                      for q in range(P)]
            exact = sum(inputs)
            bound = (P - 1) * torch.finfo(dtype).eps * sum(x.abs() for x in inputs) + 1e-12
            for got in (ref, ours):
                assert bool(((got.double() - exact).abs() <= bound).all()), (op, dtype, n)
            continue
        tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
        assert torch.allclose(ref.double(), ours.double(), rtol=tol, atol=tol * 10), (op, dtype, n)

    def broadcast(group):
        t = torch.arange(10, dtype=torch.float32) * (r + 1)
        dist.broadcast(t, src=P - 1, group=group)
        return t
    ref, ours = both(broadcast)
    assert torch.equal(ref, ours) and torch.equal(ours, torch.arange(10.0) * P)

    def allgather(group):
        outs = [torch.empty(3, 2) for _ in range(P)]
        dist.all_gather(outs, torch.full((3, 2), float(r)), group=group)
        return torch.stack(outs)
    ref, ours = both(allgather)
    assert torch.equal(ref, ours)

    def allgather_single(group):
        out = torch.empty(P * 4, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, torch.full((4,), r + 0.5, dtype=torch.bfloat16), group=group)
        return out
    ref, ours = both(allgather_single)
    assert torch.equal(ref, ours)

    ins = [torch.randn(6, generator=g) for _ in range(P)]
    out = torch.empty(6)
    dist.reduce_scatter(out, [i.clone() for i in ins], group=pcg)
    expect = sum(comm.allgather(torch.stack(ins).numpy()))[r]
    assert np.allclose(out.numpy(), expect, rtol=1e-5, atol=1e-6)
    out2 = torch.empty(6)
    dist.reduce_scatter_tensor(out2, torch.cat(ins), group=pcg)
    assert torch.allclose(out, out2)
    dist.barrier(group=pcg)


def test_ddp_on_partialcoll_group_equals_gloo(comm, pcg):
    """DDP on the partialcoll group (its default reduction, no hook) == DDP on gloo."""
    ref, ours = model(), model()
    train(DDP(ref, bucket_cap_mb=CAP), comm.rank, 8)
    train(DDP(ours, bucket_cap_mb=CAP, process_group=pcg), comm.rank, 8)
    params_close(ref, ours)


# -- the hook ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ddp_kwargs", [{}, {"accumulate": 3}, {"find_unused_parameters": True},
                                        {"static_graph": True}, {"gradient_as_bucket_view": True}],
                         ids=["default", "no_sync", "find_unused_parameters", "static_graph",
                              "gradient_as_bucket_view"])
def test_hook_full_equals_ddp(comm, pcg, ddp_kwargs):
    hook_full_equals_ddp(comm, **ddp_kwargs)


def hook_full_equals_ddp(comm, **ddp_kwargs):
    """mode="full" through the hook gives DDP's own parameters after 20 steps (multi-bucket),
    also with no_sync accumulation and the DDP options given."""
    accumulate = ddp_kwargs.pop("accumulate", 1)
    unused = ddp_kwargs.get("find_unused_parameters", False)
    ref, ours = model(unused=unused), model(unused=unused)
    ddp_ref = DDP(ref, bucket_cap_mb=CAP, **ddp_kwargs)
    ddp_ours = DDP(ours, bucket_cap_mb=CAP, **ddp_kwargs)
    state = PartialHookState(mode="full", comm=comm)
    ddp_ours.register_comm_hook(state, partial_allreduce_hook)
    train(ddp_ref, comm.rank, 20, accumulate=accumulate)
    train(ddp_ours, comm.rank, 20, accumulate=accumulate)
    assert len(state.colls) >= 3, f"expected several buckets, got {len(state.colls)}"
    state.close()
    params_close(ref, ours)
    assert same_on_every_rank(comm, ours)


class Recorder:
    """Wraps the hook: sums what each rank posts, per parameter (its local gradients)."""

    def __init__(self, model):
        self.sum = {id(p): torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()}

    def hook(self, state, bucket):
        buf = bucket.buffer()
        base = buf.data_ptr()
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            assert g.data_ptr() - base >= 0
            self.sum[id(p)] += g.detach().double().reshape(p.shape)
        return partial_allreduce_hook(state, bucket)


def nothing_lost(comm, m, w0, lr, flushed, local_sum):
    """applied updates + the final flush == the sum of every rank's local gradients."""
    for p, p0 in zip(m.parameters(), w0):
        applied = ((p0.double() - p.detach().double()) / lr).cpu()      # the flush is host data
        total = applied + flushed.get(id(p), 0)
        everyone = np.empty(p.numel())
        comm.Allreduce(local_sum[id(p)].cpu().numpy().ravel(), everyone)
        assert np.allclose(total.cpu().numpy().ravel(), everyone, rtol=1e-4, atol=1e-4), \
            np.abs(total.cpu().numpy().ravel() - everyone).max()


def flushed_by_param(state):
    """Collective: close the hook state; its final results mapped to parameters."""
    entries = list(state.colls.values())
    results = state.close()
    out = {}
    for i, e in enumerate(entries):
        data = torch.from_numpy(host(results[i].data).astype(np.float64))
        for p, off in zip(e.params, e.offsets):
            out[id(p)] = data[off:off + p.numel()].reshape(p.shape)
    return out


@pytest.mark.parametrize("mode,opts,start_iter,average",
                         [(m, o, 2, "none") for m, o in MODES] + [("solo", {}, 0, "none"), ("solo", {}, 0, "world")],
                         ids=[m for m, _ in MODES] + ["solo_from_iteration_0", "solo_world_average"])
def test_hook_every_mode(comm, pcg, mode, opts, start_iter, average):
    """30+ steps of a multi-bucket model in each mode, a different rank late now and then:
    the loss falls, nothing is lost (late="fold", average="none"). start_iter=0 makes the
    first collectives before DDP's bucket rebuild, so the rebuild must flush them.
    average="world": the collectives divide by P themselves (divisor=P), the flushes too."""
    if mode == "quorum" and comm.size < 2:
        pytest.skip("quorum=2 needs P >= 2")
    m = model()
    ddp = DDP(m, bucket_cap_mb=CAP)
    state = PartialHookState(mode=mode, comm=comm, average=average, late="fold", start_iter=start_iter, **opts)
    rec = Recorder(m)
    ddp.register_comm_hook(state, rec.hook)
    lr = 0.3 / comm.size
    w0 = [p.detach().clone() for p in m.parameters()]
    before = held_out_loss(m)
    train(ddp, comm.rank, 32, lr=lr, slow=lambda s: (s * 7) % (comm.size + 2))
    p_ = comm.size if average == "world" else 1
    assert all(e.coll.divisor == p_ for e in state.colls.values())
    flush = {k: v * p_ for k, v in flushed_by_param(state).items()}
    for res in state.flushed:                                  # closed at the rebuild: applied later
        assert res.data is not None
    nothing_lost(comm, m, w0, lr / p_, flush, rec.sum)
    assert held_out_loss(m) < before, mode
    if start_iter == 0:
        assert state.flushed, "DDP rebuilt its buckets, but the hook's collectives were not flushed"


@pytest.mark.parametrize("mode,opts", MODES, ids=[m for m, _ in MODES])
def test_hook_uneven_steps(comm, pcg, mode, opts):
    """Ranks take different numbers of steps (rank r: 12 + 5 r, as with uneven inputs):
    a rank that is done closes the hook state (collective), and from then on shadows the
    rounds of the ranks still training, as PyTorch's Join does. Every mode, full
    included, completes, and nothing is lost."""
    if mode == "quorum" and comm.size < 2:
        pytest.skip("quorum=2 needs P >= 2")
    m = model()
    ddp = DDP(m, bucket_cap_mb=CAP)
    state = PartialHookState(mode=mode, comm=comm, late="fold", start_iter=2, **opts)   # average="world"
    rec = Recorder(m)
    ddp.register_comm_hook(state, rec.hook)
    lr, p_ = 0.3, comm.size
    w0 = [p.detach().clone() for p in m.parameters()]
    train(ddp, comm.rank, 12 + 5 * comm.rank, lr=lr)
    flush = {k: v * p_ for k, v in flushed_by_param(state).items()}
    nothing_lost(comm, m, w0, lr / p_, flush, rec.sum)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_hook_half(comm, pcg, dtype):
    """float16/bfloat16 models through the hook (full) agree with gloo's DDP to half tolerance."""
    ref, ours = model(dtype), model(dtype)
    ddp_ref, ddp_ours = DDP(ref, bucket_cap_mb=CAP), DDP(ours, bucket_cap_mb=CAP)
    state = PartialHookState(mode="full", comm=comm)
    ddp_ours.register_comm_hook(state, partial_allreduce_hook)
    train(ddp_ref, comm.rank, 6, dtype=dtype)
    train(ddp_ours, comm.rank, 6, dtype=dtype)
    state.close()
    params_close(ref, ours, rtol=2e-2, atol=2e-2)
    assert same_on_every_rank(comm, ours)
    # and a partial mode runs on half tensors
    m = model(dtype)
    ddp = DDP(m, bucket_cap_mb=CAP)
    st = PartialHookState(mode="solo", comm=comm, late="fold")
    ddp.register_comm_hook(st, partial_allreduce_hook)
    train(ddp, comm.rank, 5, dtype=dtype)
    st.close()


def test_real_mlp(comm, pcg):
    """The issue's model at its size: the 2.9M-parameter MLP (784-1024-1024-1024-10, 11.6 MB
    of gradients) with DDP's default buckets (a 1 MiB first bucket, then 25 MiB), which the
    old hook crashed on at step 2. Full mode equals DDP on gloo after 6 steps; solo mode
    with a late rank runs 8 steps and loses nothing."""
    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                   torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                   torch.nn.Linear(1024, 10)).to(DEV)

    def steps(ddp, n, lr, slow=False):
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        for step in range(n):
            if slow and comm.rank == step % comm.size:
                time.sleep(0.01)
            g = torch.Generator().manual_seed(100 * step + comm.rank)
            x, y = torch.randn(32, 784, generator=g).to(DEV), torch.randint(0, 10, (32,), generator=g).to(DEV)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

    ref, ours = mlp(), mlp()
    ddp_ours = DDP(ours)
    state = PartialHookState(mode="full", comm=comm)
    ddp_ours.register_comm_hook(state, partial_allreduce_hook)
    steps(DDP(ref), 6, 0.01)
    steps(ddp_ours, 6, 0.01)
    assert len(state.colls) >= 2, f"expected several buckets, got {len(state.colls)}"
    state.close()
    params_close(ref, ours)
    assert same_on_every_rank(comm, ours)

    m = mlp()
    ddp = DDP(m)
    state = PartialHookState(mode="solo", comm=comm, average="none", late="fold")
    rec = Recorder(m)
    ddp.register_comm_hook(state, rec.hook)
    lr = 0.01 / comm.size
    w0 = [p.detach().clone() for p in m.parameters()]
    steps(ddp, 8, lr, slow=True)
    nothing_lost(comm, m, w0, lr, flushed_by_param(state), rec.sum)


# -- without DDP --------------------------------------------------------------------------------
def local_gradients(m):
    """Each parameter's sum of its local gradients, recorded by tensor hooks (they run
    before the optimizer wrapper's)."""
    local = {id(p): torch.zeros_like(p, dtype=torch.float64) for p in m.parameters()}
    def record(p):
        def hook(g):
            local[id(p)].add_(g.double())
        return hook
    for p in m.parameters():
        p.register_hook(record(p))
    return local


def flushed_of(opt, scale):
    """Collective: close the optimizer; its final results mapped to parameters, times scale."""
    flushed = {}
    for b, res in zip(opt._sync.buckets, opt.close()):
        data = torch.from_numpy(host(res.data).astype(np.float64))
        off = 0
        for p in b.params:
            flushed[id(p)] = data[off:off + p.numel()].reshape(p.shape) * scale
            off += p.numel()
    return flushed


def test_optimizer_full_equals_ddp(comm, pcg):
    ref, ours = model(), model()
    train(DDP(ref, bucket_cap_mb=CAP), comm.rank, 20)
    opt = DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05), mode="full", comm=comm,
                               bucket_mb=CAP)
    assert isinstance(opt, torch.optim.Optimizer) and len(opt._sync.buckets) >= 3
    train(ours, comm.rank, 20, opt=opt)
    opt.close()
    params_close(ref, ours)


@pytest.mark.parametrize("average", ["none", "world"])
def test_optimizer_solo_nothing_lost(comm, pcg, average):
    """average="world" divides in the collective (PartialAllreduce(divisor=P)): what was
    applied and the final flush are then both the sums / P, each divided exactly once."""
    m = model()
    lr = 0.3 / comm.size
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=lr), mode="solo", comm=comm,
                               average=average, late="fold", bucket_mb=CAP)
    p_ = comm.size if average == "world" else 1
    assert all(b.coll.divisor == p_ for b in opt._sync.buckets)
    w0 = [p.detach().clone() for p in m.parameters()]
    local = local_gradients(m)
    before = held_out_loss(m)
    train(m, comm.rank, 30, opt=opt, slow=lambda s: s % (comm.size + 1))
    nothing_lost(comm, m, w0, lr / p_, flushed_of(opt, p_), local)
    assert held_out_loss(m) < before


@pytest.mark.parametrize("mode", ["solo", "full"])
def test_optimizer_uneven_steps(comm, pcg, mode):
    """DistributedOptimizer where rank r takes 12 + 5 r steps: the ranks that are done
    close() (collective) while the others still step; nothing is lost."""
    m = model()
    lr, p_ = 0.3, comm.size
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=lr), mode=mode, comm=comm, late="fold",
                               bucket_mb=CAP)                        # average="world"
    w0 = [p.detach().clone() for p in m.parameters()]
    local = local_gradients(m)
    train(m, comm.rank, 12 + 5 * comm.rank, opt=opt)
    nothing_lost(comm, m, w0, lr / p_, flushed_of(opt, p_), local)


def test_synchronizer_nap_and_model_sync(comm, pcg):
    """GradientSynchronizer by hand: average="nap" divides by the round's NAP; the models
    are made identical every 5 steps."""
    m = model()
    with torch.no_grad():
        for p in m.parameters():
            p += 0.01 * comm.rank                          # models differ
    sync = GradientSynchronizer(m.parameters(), mode="majority", comm=comm, average="nap",
                                model_sync_every=5)
    for step in range(10):
        x, y = batch(comm.rank, step)
        m.zero_grad()
        loss_of(m, x, y).backward()
        res = sync.sync()[0]
        assert 1 <= res.nap <= comm.size * res.rounds
        flat = torch.cat([p.grad.reshape(-1) for p in sync.buckets[0].params])
        assert np.array_equal(flat.cpu().numpy(), host(res.data)), "the result is not the gradients"
        # a round's sum is the same everywhere: grad * nap agrees among ranks given the same round
        everyone = comm.allgather((res.round, res.rounds, flat.double().cpu().numpy() * res.nap))
        for rnd, rounds, summed in everyone:
            if (rnd, rounds) == (res.round, res.rounds):
                assert np.allclose(summed, flat.double().cpu().numpy() * res.nap, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.01 * p.grad
    sync.close()
    assert same_on_every_rank(comm, m), "models differ after sync"
    sync_parameters(m.parameters(), comm, how="broadcast")



def _params_of_every_kind(rank):
    """Parameters of four dtypes, values that differ per rank (one not contiguous)."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 7, generator=g).t(), torch.randn(300, generator=g, dtype=torch.float64),
            torch.randn(33, generator=g).half(), torch.randn(4, 4, generator=g).bfloat16(),
            torch.randn(1000, generator=g)]


def test_sync_parameters_average_and_broadcast(comm, pcg):
    """sync_parameters over parameters of four dtypes: "average" equals the mean computed
    with mpi4py (float64, then the parameter's dtype), "broadcast" equals rank 0's, bit for
    bit; the tensors are updated where they are (a non-contiguous one included)."""
    ps = _params_of_every_kind(comm.rank)
    everyone = comm.allgather([p.double().numpy() for p in ps])
    ids = [id(p) for p in ps]
    pct.sync_parameters(ps, comm)
    assert [id(p) for p in ps] == ids
    for i, p in enumerate(ps):
        mean = np.mean([e[i] for e in everyone], axis=0)
        want = torch.from_numpy(mean).to(p.dtype)
        tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(p.dtype, 1e-6)
        assert torch.allclose(p.double(), want.double(), rtol=tol, atol=tol), (i, p.dtype)
    ps = _params_of_every_kind(comm.rank)
    root = [p.clone() for p in _params_of_every_kind(0)]
    pct.sync_parameters(ps, comm, how="broadcast")
    assert all(torch.equal(p, q) for p, q in zip(ps, root))


def test_sync_parameters_errors(comm, pcg):
    """Bad input raises on every rank, before any MPI call."""
    expect_raises(pc.ArgumentError, pct.sync_parameters, [torch.ones(3)], comm, how="sum", match="how")
    expect_raises(pc.ArgumentError, pct.sync_parameters, [torch.ones(3), torch.arange(4)], comm, match="floating-point")
    ints = [torch.arange(4) * (comm.rank + 1)]
    pct.sync_parameters(ints, comm, how="broadcast")
    assert torch.equal(ints[0], torch.arange(4))


def test_sync_parameters_a_missing_rank_is_a_timeout(comm, pcg):
    """A rank that does not reach sync_parameters (it took fewer steps): the others raise
    Timeout after `timeout` seconds, instead of waiting in MPI for ever (and spinning a
    core there); the late rank's call then completes the allreduce they left in flight."""
    if comm.size == 1:
        pytest.skip("needs a rank that misses the call (P >= 2)")
    dup = comm.Dup()
    ps = [torch.full((100,), float(comm.rank))]
    if comm.rank != 0:
        t0 = time.monotonic()
        expect_raises(pc.Timeout, pct.sync_parameters, ps, dup, timeout=0.3, match="sync_parameters' allreduce")
        assert time.monotonic() - t0 < 5.0
    comm.Barrier()                  # rank 0 comes after every other rank timed out
    if comm.rank == 0:
        pct.sync_parameters(ps, dup)
        assert torch.equal(ps[0], torch.full((100,), sum(range(comm.size)) / comm.size))
    comm.Barrier()
    dup.Free()

if __name__ == "__main__":
    run_module(__file__)
