"""The contracts PyTorch and Horovod users know, on the torch integration: python torch_contract_checks.py

- Horovod's DistributedOptimizer: synchronize() / clip / skip_synchronize(), AMP's
  GradScaler, the wrapped instance kept (momentum, schedulers, state_dict), gradients
  the user sees never being the engine's memory; each against a plain loop whose
  gradients are averaged with mpi4py's Allreduce.
- DDP's process group: the hook reduces over DDP's group (two data-parallel groups of
  2 give the within-group average), a communicator that is not the group's is an error;
  DDP's join() with uneven inputs, over the group and through the hook.
- model_sync_every: the models are identical after a synchronisation.
- PyTorch's test_c10d_pypg.py checks that apply to a Python process group (DDP on it
  equals training on the global batch, Work objects, init_sync=False, attributes,
  functional collectives, batch_isend_irecv, abort); the functional and coalesced
  collectives (DTensor, FSDP2) and FSDP2 training; the group's timeout; the engine
  allreduces evicted from the group's cache while their rounds are waited for.

The default group is gloo (its store found over MPI); ``pcg`` is a partialcoll group.
PC_TEST_TORCH_DEVICE as in torch_checks.py.
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import partialcoll as pc
import partialcoll.integrations.torch as pct
from partialcoll.integrations import _torch_common
from _util import expect_raises, run_module

KIND = os.environ.get("PC_TEST_TORCH_DEVICE", "cpu")
if KIND in ("emulated", "fakecupy"):      # CPU tensors through the device path (see torch_checks.py)
    _torch_common.DEVICE_TYPES.append("cpu")
DEV = torch.device("cuda" if KIND == "cuda" else "cpu")
if KIND == "cuda":                        # one GPU per rank where there are several
    torch.cuda.set_device(pct.local_rank() % torch.cuda.device_count())
D, H, C = 12, 32, 5
CAP = 0.0002                              # MiB: several DDP buckets
STEPS = 20


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, H),
                                        torch.nn.ReLU(), torch.nn.Linear(H, C))

    def forward(self, x):
        return self.body(x)


def model():
    torch.manual_seed(0)
    return Net().to(DEV)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, D, generator=g) * (1 + rank)          # ranks' gradients differ
    y = (x[:, :C] * 2).argmax(1)
    return x.to(DEV), y.to(DEV)


def flat_params(m):
    return torch.cat([p.detach().float().cpu().reshape(-1) for p in m.parameters()])


def assert_params_close(ref, ours, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        diff = (p.detach().float() - q.detach().float()).abs().max().item()
        assert torch.allclose(p.detach().float(), q.detach().float(), rtol=rtol, atol=atol), (name, diff)


def same_everywhere(comm, m):
    everyone = comm.allgather(flat_params(m).numpy())
    return all(np.array_equal(everyone[0], f) for f in everyone)


def mpi_average_grads(m, comm):
    """The reference's gradient averaging: one MPI Allreduce per gradient, then / P."""
    for p in m.parameters():
        g = p.grad.detach().cpu().numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, g)
        p.grad.copy_(torch.from_numpy(g / comm.size).to(p.grad.device))


AMP = {"fp32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(amp):
    if AMP[amp] is None:
        return contextlib.nullcontext()
    return torch.autocast(DEV.type, dtype=AMP[amp])


def scaler_for(amp):
    # GradScaler on CPU exists in this torch; growth_interval small so the scale moves
    return torch.amp.GradScaler(DEV.type, init_scale=2.0 ** 10, growth_interval=3) if amp != "fp32" else None


def loss_of(m, x, y, amp):
    with autocast(amp):
        out = m(x)
    return torch.nn.functional.cross_entropy(out.float(), y)


def amp_step(m, opt, scaler, x, y, amp, clip, after_backward=None, stepping=contextlib.nullcontext):
    """backward (scaled), after_backward(), unscale_ and clip_grad_norm_ (unless clip is
    None), step (inside stepping())."""
    loss = loss_of(m, x, y, amp)
    (scaler.scale(loss) if scaler else loss).backward()
    if after_backward is not None:
        after_backward()
    if clip is not None:
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
    with stepping():
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()


def plain_step(m, opt, x, y, comm=None):
    """zero_grad, backward, (gradients averaged with mpi4py over comm), step."""
    opt.zero_grad()
    loss_of(m, x, y, "fp32").backward()
    if comm is not None:
        mpi_average_grads(m, comm)
    opt.step()


def reference_step(m, opt, scaler, x, y, amp, clip, comm):
    opt.zero_grad()
    amp_step(m, opt, scaler, x, y, amp, clip, after_backward=lambda: mpi_average_grads(m, comm))


@pytest.fixture(scope="module")
def pcg(comm):
    pct.init_process_group(comm, backend="gloo")
    yield dist.new_group(backend="partialcoll")
    dist.destroy_process_group()


# -- DistributedOptimizer: Horovod's contract ---------------------------------------------------
@pytest.mark.parametrize("amp", list(AMP))
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_"])
def test_optimizer_clip_amp_equals_mpi4py(comm, pcg, amp, set_to_none):
    """synchronize() / clip_grad_norm_ / GradScaler.unscale_ / skip_synchronize() through
    DistributedOptimizer (full mode, momentum SGD) == the same steps with gradients averaged
    by mpi4py, after 20 steps. Before synchronize() each p.grad is this rank's local
    gradient, and zeroing it then changes nothing the ranks average: the engine never
    reduces in the user's gradients. zero_grad(set_to_none=False) makes backward
    accumulate into the views synchronize() gave out (the other buffer path)."""
    ref, ours = model(), model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = pct.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9), mode="full",
                                   comm=comm, bucket_mb=CAP)
    assert len(opt._sync.buckets) >= 3
    ref_scaler, scaler = scaler_for(amp), scaler_for(amp)
    clip = 0.5
    for step in range(STEPS):
        x, y = batch(comm.rank, step)
        reference_step(ref, ref_opt, ref_scaler, x, y, amp, clip, comm)
        opt.zero_grad(set_to_none=set_to_none)
        expected = None
        if step < 2:          # this rank's own gradient, computed aside (no hook runs)
            loss = loss_of(ours, x, y, amp)
            expected = torch.autograd.grad(scaler.scale(loss) if scaler else loss, list(ours.parameters()))

        def then_synchronize(expected=expected):
            if expected is not None:      # until synchronize(), p.grad is the local gradient
                for p, e in zip(ours.parameters(), expected):
                    assert torch.equal(p.grad, e)
            for p in ours.parameters():
                p.grad.zero_()            # the user's memory, never the engine's
            opt.synchronize()

        amp_step(ours, opt, scaler, x, y, amp, clip, after_backward=then_synchronize, stepping=opt.skip_synchronize)
    if scaler:
        assert scaler.get_scale() == ref_scaler.get_scale()
    opt.close()
    assert_params_close(ref, ours)
    assert same_everywhere(comm, ours)
    # momentum was used and kept by the wrapped instance
    for p in ours.parameters():
        assert opt.state[p]["momentum_buffer"] is opt.optimizer.state[p]["momentum_buffer"]


def test_optimizer_fused_adam_grad_scaler(comm, pcg):
    """A fused Adam under GradScaler without unscale_: the scaler hands the optimizer its
    scale and inf flags as attributes (grad_scale, found_inf), which must reach the wrapped
    instance: it unscales, and skips the step whose gradients overflowed (step 7, rank 0's
    input blown up); == the mpi4py reference after 20 steps (float16 autocast)."""
    amp = "float16"
    ref, ours = model(), model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=True)
    opt = pct.DistributedOptimizer(torch.optim.Adam(ours.parameters(), lr=0.01, fused=True), mode="full",
                                   comm=comm, bucket_mb=CAP)
    ref_scaler, scaler = scaler_for(amp), scaler_for(amp)
    for step in range(STEPS):
        x, y = batch(comm.rank, step)
        if step == 7 and comm.rank == 0:
            x = x * 1e6                               # float16 overflows: every rank must skip
        reference_step(ref, ref_opt, ref_scaler, x, y, amp, None, comm)
        opt.zero_grad()
        amp_step(ours, opt, scaler, x, y, amp, None, after_backward=opt.synchronize, stepping=opt.skip_synchronize)
    assert scaler.get_scale() == ref_scaler.get_scale() < 2.0 ** 10 * 2 ** 6, "no step was skipped"
    assert not hasattr(opt.optimizer, "grad_scale"), "GradScaler's attributes were left behind"
    opt.close()
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    assert_params_close(ref, ours, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("amp", list(AMP))
def test_hook_clip_amp_equals_mpi4py(comm, pcg, amp):
    """The same through DDP and the hook (partial_ddp, full mode, several buckets): DDP
    has waited for every bucket when backward returns, so unscale_ and clipping follow
    as without partialcoll; == the mpi4py reference after 20 steps."""
    ref, ours = model(), model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ddp, state = pct.partial_ddp(ours, mode="full", bucket_cap_mb=CAP)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_scaler, scaler = scaler_for(amp), scaler_for(amp)
    clip = 0.5
    for step in range(STEPS):
        x, y = batch(comm.rank, step)
        reference_step(ref, ref_opt, ref_scaler, x, y, amp, clip, comm)
        opt.zero_grad()
        amp_step(ddp, opt, scaler, x, y, amp, clip)
    assert len(state.colls) >= 3, f"expected several buckets, got {len(state.colls)}"
    state.close()
    assert_params_close(ref, ours)
    assert same_everywhere(comm, ours)


def test_optimizer_wraps_the_instance(comm, pcg):
    """The user's optimizer instance is kept: momentum buffers made before wrapping, a
    scheduler made on it, state_dict(), and an optimizer whose constructor needs arguments.
    Training on equals the mpi4py reference with the same history."""
    class NeedsArgs(torch.optim.SGD):            # a required constructor argument
        def __init__(self, params, lr, label):
            super().__init__(params, lr=lr, momentum=0.9)
            self.label = label

    ref, ours = model(), model()
    ref_opt, base = NeedsArgs(ref.parameters(), 0.05, "ref"), NeedsArgs(ours.parameters(), 0.05, "ours")
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=3, gamma=0.5)
    for step in range(3):                         # plain training: momentum buffers appear
        for m, o, s in ((ref, ref_opt, ref_sched), (ours, base, sched)):
            plain_step(m, o, *batch(comm.rank, step), comm)
            s.step()
    buffers = {id(p): base.state[p]["momentum_buffer"] for p in ours.parameters()}
    opt = pct.DistributedOptimizer(base, mode="full", comm=comm, bucket_mb=CAP)
    assert opt.optimizer is base and opt.label == "ours" and opt.param_groups is base.param_groups
    assert all(opt.state[p]["momentum_buffer"] is buffers[id(p)] for p in ours.parameters()), \
        "the momentum buffers were dropped"
    assert opt.state_dict()["state"].keys() == base.state_dict()["state"].keys()
    for step in range(3, 9):
        plain_step(ref, ref_opt, *batch(comm.rank, step), comm)
        ref_sched.step()
        plain_step(ours, opt, *batch(comm.rank, step))
        sched.step()                              # made on the instance before wrapping
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.05 * 0.5 ** 3
    assert_params_close(ref, ours)
    sd = opt.state_dict()
    opt.load_state_dict(sd)                       # round trip through the wrapper
    assert all(torch.equal(opt.state[p]["momentum_buffer"], sd["state"][i]["momentum_buffer"])
               for i, p in enumerate(ours.parameters()))
    # a scheduler made on the wrapper works too
    sched2 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.zero_grad()
    loss_of(ours, *batch(comm.rank, 9), "fp32").backward()
    opt.step()
    sched2.step()
    assert opt.param_groups[0]["lr"] == 0.05 * 0.5 ** 4
    opt.close()


def test_optimizer_horovod_rules(comm, pcg):
    """synchronize() twice, or synchronize() then step() without skip_synchronize(), posts
    nothing twice; zero_grad() with rounds in flight, step() under skip_synchronize() with
    rounds in flight, a second backward before step(), and step(closure) are errors."""
    m = model()
    opt = pct.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), mode="full", comm=comm,
                                   bucket_mb=CAP)       # full: round n is every rank's post n
    x, y = batch(comm.rank, 0)
    opt.zero_grad()
    loss_of(m, x, y, "fp32").backward()
    first = opt.synchronize()
    again = opt.synchronize()
    assert [r.round for r in first] == [r.round for r in again] and again is first
    opt.step()                                    # no skip_synchronize(): still no second post
    opt.zero_grad()
    loss_of(m, x, y, "fp32").backward()
    expect_raises(pc.StateError, opt.zero_grad, match="still being averaged")
    with opt.skip_synchronize():
        expect_raises(pc.StateError, opt.step, match="synchronize() first")
    expect_raises(pc.StateError, loss_of(m, x, y, "fp32").backward, match="backward_passes_per_step")
    res = opt.synchronize()
    assert [r.round for r in first] == [0] * len(first) and [r.round for r in res] == [1] * len(res), \
        "a post was counted twice"
    expect_raises(pc.ArgumentError, opt.step, lambda: 0.0, match="closure")
    opt.close()


# -- DDP's process group -----------------------------------------------------------------------
def dp_groups(comm):
    """Data-parallel groups of 2 (the last of 1 at odd P): [[0, 1], [2, 3], ...]."""
    return [list(range(i, min(i + 2, comm.size))) for i in range(0, comm.size, 2)]


@pytest.mark.parametrize("backend", ["gloo", "partialcoll"])
def test_two_dp_groups(comm, pcg, backend):
    """partial_ddp(model, mode="full", process_group=g) with data-parallel groups of 2
    equals the within-group reference (MPI Allreduce over the group) after 12 steps, and
    differs from the world-wide average (so averaging across groups would fail here)."""
    groups = [dist.new_group(r, backend=backend) for r in dp_groups(comm)]     # every rank makes every group
    mine = next(i for i, r in enumerate(dp_groups(comm)) if comm.rank in r)
    sub = comm.Split(mine, comm.rank)
    ref, world_ref, ours = model(), model(), model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    world_opt = torch.optim.SGD(world_ref.parameters(), lr=0.1)
    ddp, state = pct.partial_ddp(ours, mode="full", process_group=groups[mine], bucket_cap_mb=CAP)
    assert state.comm.Get_size() == sub.Get_size()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(12):
        x, y = batch(comm.rank, step)
        plain_step(ref, ref_opt, x, y, sub)
        plain_step(world_ref, world_opt, x, y, comm)
        plain_step(ddp, opt, x, y)
    assert len(state.colls) >= 2, "the hook never left its warm-up iterations"
    state.close()
    assert_params_close(ref, ours)
    if comm.size > 2:
        assert not torch.allclose(flat_params(world_ref), flat_params(ours), rtol=1e-4, atol=1e-5)
    sub.Free()


@pytest.mark.parametrize("how", ["process_group", "hook_full"])
def test_ddp_join_uneven_inputs(comm, pcg, how):
    """DDP's join() with uneven inputs (rank r takes 5 + 3 r steps): joined ranks shadow
    the others' allreduces through the process group, or through the comm hook (DDP runs
    it on zero buckets). Over the partialcoll group, or with partial_ddp(mode="full"),
    the models equal DDP's over gloo, on every rank."""
    ref, ours = model(), model()
    ddp_ref = DDP(ref, bucket_cap_mb=CAP)                     # the default group: gloo
    if how == "process_group":
        ddp, state = DDP(ours, process_group=pcg, bucket_cap_mb=CAP), None
    else:
        ddp, state = pct.partial_ddp(ours, mode="full", bucket_cap_mb=CAP)
    for m, d in ((ref, ddp_ref), (ours, ddp)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with d.join():
            for step in range(5 + 3 * comm.rank):
                plain_step(d, opt, *batch(comm.rank, step))
    if state is not None:
        assert len(state.colls) >= 2, "the hook never left its warm-up iterations"
        state.close()
    assert_params_close(ref, ours)
    assert same_everywhere(comm, ours)


@pytest.mark.parametrize("how", ["process_group", "hook_full"])
def test_a_failed_round_fails_backward(comm, pcg, how):
    """A round that fails (here: rank 0 is later than the timeout) fails backward() on the
    ranks that waited for it, with a RuntimeError naming the exception; the process goes
    on, and rank 0's late backward then completes the rounds. DDP's reducer reads the
    future of the process group's Work, or of the comm hook, in C++, where a Python
    future's set_exception() is the future's value: over the process group the reducer
    took a tensor from it that is not there and crashed the process (SIGSEGV); through the
    hook it failed with "Unable to cast". The buckets are over the group's engine
    threshold (64 KiB), so its allreduces are waited for on its thread, as the hook's."""
    if comm.size < 2:
        pytest.skip("needs a rank later than the others (P >= 2)")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(D, 192), torch.nn.Tanh(), torch.nn.Linear(192, 192),
                            torch.nn.Linear(192, C)).to(DEV)
    old = pc.rc.timeout
    if how == "process_group":
        g = dist.new_group(backend="partialcoll", timeout=timedelta(seconds=0.5))
        ddp, state = DDP(m, process_group=g, bucket_cap_mb=0.15), None
    else:
        ddp, state = pct.partial_ddp(m, mode="full", bucket_cap_mb=0.15)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(3):                               # DDP's bucket rebuild, the hook's warm-up
        plain_step(ddp, opt, *batch(comm.rank, step))
    if state is not None:
        assert state.colls, "the hook never left its warm-up iterations"
    if comm.rank != 0:
        pc.rc.timeout = 0.5
        try:
            expect_raises(RuntimeError, plain_step, ddp, opt, *batch(comm.rank, 3), match="Timeout: ")
        finally:
            pc.rc.timeout = old
    comm.Barrier()
    if comm.rank == 0:
        plain_step(ddp, opt, *batch(comm.rank, 3))      # its posts complete the others' rounds
    comm.Barrier()
    if state is not None:
        state.close()
    else:
        dist.destroy_process_group(g)


def test_group_comm_mismatch_is_an_error(comm, pcg):
    """A communicator that is not the process group's is an ArgumentError on every member
    (not a silent average over other processes): another size, or the same size with
    other processes."""
    groups = [dist.new_group(r) for r in dp_groups(comm)]
    ours = [dist.new_group(r, backend="partialcoll") for r in dp_groups(comm)]
    mine = next(i for i, r in enumerate(dp_groups(comm)) if comm.rank in r)
    if comm.size > 2:
        for g in (groups[mine], ours[mine]):
            expect_raises(pc.ArgumentError, pct.PartialHookState, mode="full", process_group=g, comm=comm,
                          match="comm")
    if comm.size >= 4:        # same size, other processes: {0, 2}, {1, 3} against {0, 1}, {2, 3}
        other = comm.Split(comm.rank % 2 if comm.rank < 4 else comm.rank, comm.rank)
        if comm.rank < 4:
            expect_raises(pc.ArgumentError, pct.PartialHookState, mode="full", process_group=groups[mine],
                          comm=other, match="does not match")
            expect_raises(pc.ArgumentError, pct.PartialHookState, mode="full", process_group=ours[mine],
                          comm=other, match="comm")
        other.Free()
    st = pct.PartialHookState(mode="full", process_group=groups[mine])     # derived: fine
    assert st.comm.Get_size() == len(dp_groups(comm)[mine])
    st.close()


def test_model_sync_every(comm, pcg):
    """partial_ddp(..., model_sync_every=4) in solo mode with a late rank: the models are
    identical right after each synchronisation (the forward pass that follows 4 steps)."""
    m = model()
    ddp, state = pct.partial_ddp(m, mode="solo", model_sync_every=4, late="latest", bucket_cap_mb=CAP)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    synced = 0
    for step in range(13):
        if comm.rank == step % comm.size:
            time.sleep(0.004)
        x, y = batch(comm.rank, step)
        opt.zero_grad()
        before = state._synced_at
        out = ddp(x)
        if state._synced_at != before:               # this forward synchronised the models
            synced += 1
            assert same_everywhere(comm, m), f"models differ right after the sync at step {step}"
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()
    assert synced == 3, synced                       # after iterations 4, 8, 12
    state.close()


@contextlib.contextmanager
def short_timeouts(seconds):
    """pc.rc.timeout and close_timeout at `seconds`: a wait for a rank that never comes fails
    the check in seconds, not after the defaults' minutes."""
    old = pc.rc.timeout, pc.rc.close_timeout
    pc.rc.timeout = pc.rc.close_timeout = seconds
    try:
        yield
    finally:
        pc.rc.timeout, pc.rc.close_timeout = old


@pytest.mark.parametrize("how", ["hook", "optimizer"])
def test_model_sync_every_uneven_steps(comm, pcg, how):
    """model_sync_every=3 where rank r takes 7 + 4 r steps, each rank's parameters nudged
    apart before every step: a rank that is done closes, and the others go on syncing
    without it (nobody waits for it). Each sync gives every rank that took part the exact
    mean of their parameters before it, and the ranks that took part in sync n are exactly
    those that reached it (last_model_sync.posts says how many)."""
    every, steps = 3, 7 + 4 * comm.rank
    m = model()
    records = []                                     # (sync n, before, after, posts)
    with short_timeouts(30):
        if how == "hook":
            ddp, state = pct.partial_ddp(m, mode="solo", model_sync_every=every, bucket_cap_mb=CAP)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        else:
            ddp = m
            state = opt = pct.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), mode="solo",
                                                   comm=comm, model_sync_every=every, bucket_mb=CAP)
        for step in range(steps):
            with torch.no_grad():
                for p in m.parameters():
                    p += 1e-3 * (comm.rank + 1)              # the ranks' models differ before every sync
            x, y = batch(comm.rank, step)
            opt.zero_grad()
            before, seen = flat_params(m), state.last_model_sync
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            if how == "hook" and state.last_model_sync is not seen:     # this forward synced
                records.append((len(records) + 1, before, flat_params(m), state.last_model_sync.posts))
            loss.backward()
            if how == "optimizer":
                before = flat_params(m)
                opt.synchronize()                            # syncs the models after every 3rd step
                if state.last_model_sync is not seen:
                    records.append((len(records) + 1, before, flat_params(m), state.last_model_sync.posts))
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        state.close()
    # the hook syncs before forward passes 3, 6, ..., the optimizer after steps 3, 6, ...
    assert len(records) == ((steps - 1) // every if how == "hook" else steps // every), (len(records), steps)
    everyone = comm.allgather([(n, b.numpy(), a.numpy(), posts) for n, b, a, posts in records])
    for n in range(1, max(len(r) for r in everyone) + 1):
        took_part = [r[n - 1] for r in everyone if len(r) >= n]
        befores = np.array([b for _, b, _, _ in took_part], np.float64)
        for _, _, after, posts in took_part:
            assert posts == len(took_part), (n, posts, len(took_part))
            assert np.array_equal(after, took_part[0][2]), f"sync {n}: the models differ after it"
            assert np.allclose(after, befores.mean(axis=0), rtol=1e-5, atol=1e-7), f"sync {n}: not the mean"


# -- PyTorch's test_c10d_pypg.py, on the partialcoll group -----------------------------------------
class Tiny(torch.nn.Module):
    """test_c10d_common's Net."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(2, 10, bias=False)
        self.fc2 = torch.nn.Linear(10, 50, bias=False)
        self.fc3 = torch.nn.Linear(50, 4, bias=False)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return torch.softmax(self.fc3(x), dim=1)


@pytest.mark.parametrize("views", [False, True], ids=["copies", "gradient_as_bucket_view"])
def test_pypg_ddp_equals_global_batch(comm, pcg, views):
    """test_c10d_pypg's test_ddp_with_pypg(_with_grad_views): DDP over the group on this
    rank's shard == one model on the global batch, for 2 iterations."""
    torch.manual_seed(123)
    local = Tiny().to(DEV)
    ddp = DDP(copy.deepcopy(local), process_group=pcg, bucket_cap_mb=0.001, gradient_as_bucket_view=views)
    g = torch.Generator().manual_seed(7)
    inp, target = torch.randn(comm.size, 2, generator=g).to(DEV), torch.randn(comm.size, 4, generator=g).to(DEV)
    for it in range(2):
        for m, xs, ts in ((local, inp, target), (ddp, inp[comm.rank:comm.rank + 1], target[comm.rank:comm.rank + 1])):
            torch.nn.functional.mse_loss(m(xs), ts).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= p.grad
                    p.grad = None
        for p, q in zip(local.parameters(), ddp.module.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), it
        torch.manual_seed(1337 + it)             # as the original: a new permutation each iteration
        perm = torch.randperm(comm.size)
        inp, target = inp[perm], target[perm]


def at_one_size(comm):
    """torch.compile and FSDP2 cost seconds of CPU per rank, and what they check does not
    depend on P: on CPU tensors they run at P = 5 only (uneven shards); the device paths
    (KIND) run them at their one P."""
    if KIND == "cpu" and comm.size != 5:
        pytest.skip("on CPU tensors at P = 5 only (the torch job at P = 5 runs it)")


def test_compiled_ddp_equals_global_batch(comm, pcg):
    """torch.compile (aot_eager) of DDP over the partialcoll group, with the partial hook
    in the full mode and without a hook, several buckets (DDPOptimizer splits the graph at
    them): equal to one model trained on the global batch. Before, Dynamo traced into the
    group's methods when the compiled forward reached them and failed ("unregistered
    member on an OpaqueObject")."""
    at_one_size(comm)
    torch._dynamo.reset()
    for hook in (True, False):
        torch.manual_seed(5)
        net = torch.nn.Sequential(torch.nn.Linear(12, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                  torch.nn.ReLU(), torch.nn.Linear(512, C)).to(DEV)
        ref = copy.deepcopy(net)
        ddp = DDP(net, process_group=pcg, bucket_cap_mb=1)
        if hook:
            state = pct.PartialHookState(mode="full", comm=comm, process_group=pcg)
            ddp.register_comm_hook(state, pct.partial_allreduce_hook)
        compiled = torch.compile(ddp, backend="aot_eager")
        opt, ropt = torch.optim.SGD(ddp.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            xs, ys = torch.randn(4 * comm.size, 12, generator=g).to(DEV), torch.randint(0, C, (4 * comm.size,), generator=g).to(DEV)
            mine = slice(4 * comm.rank, 4 * comm.rank + 4)
            for model, o, x, y in ((compiled, opt, xs[mine], ys[mine]), (ref, ropt, xs, ys)):
                o.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                o.step()
        for p, q in zip(net.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), (hook, (p - q).abs().max())
        if hook:
            state.close()
    torch._dynamo.reset()


def test_pypg_work_and_attributes(comm, pcg):
    """Work objects of the public API (wait, get_future, is_completed, result), the group's
    name/rank/size, and DDP(init_sync=False) making no collective call."""
    assert pcg.name() == "partialcoll" and pcg.rank() == comm.rank and pcg.size() == comm.size
    t = torch.full((70000,), 1.0, device=DEV)          # the engine's allreduce, completed by a thread
    work = dist.all_reduce(t, group=pcg, async_op=True)
    assert isinstance(work, dist.Work)
    fut = work.get_future()
    assert work.wait() and work.is_completed() and work.is_success() and work.exception() is None
    assert fut.value()[0] is t and torch.all(t == comm.size)
    small = torch.ones(3, device=DEV)
    w2 = dist.all_reduce(small, group=pcg, async_op=True)
    assert w2.is_completed() and w2.result()[0] is small

    class Spy(pct.ProcessGroupPartialcoll):
        calls: list = []

        def broadcast(self, *args):
            self.calls.append("broadcast")
            return super().broadcast(*args)

        def allgather(self, *args):
            self.calls.append("allgather")
            return super().allgather(*args)

    spy = Spy(comm)
    DDP(Tiny().to(DEV), process_group=spy, init_sync=False)
    assert Spy.calls == [], Spy.calls
    DDP(Tiny().to(DEV), process_group=spy)         # and with it, the group is used
    assert Spy.calls, "DDP's init sync did not reach the group"
    spy.shutdown()


def test_pypg_work_wait_timeout(comm, pcg):
    """Work.wait(timeout) as torch's: Timeout after it where the call has not completed
    (here rank 0's allreduce, whose peers come later); the call goes on, and the next
    wait() returns its result."""
    if comm.size < 2:
        pytest.skip("needs a rank that comes later (P >= 2)")
    t = torch.full((70000,), float(comm.rank + 1), device=DEV)     # the engine's allreduce
    if comm.rank == 0:
        work = dist.all_reduce(t, group=pcg, async_op=True)
        t0 = time.monotonic()
        expect_raises(pc.Timeout, work.wait, timedelta(seconds=0.2), match="within wait()'s timeout")
        assert 0.2 <= time.monotonic() - t0 < 5.0
        assert not work.is_completed()
    comm.Barrier()
    if comm.rank != 0:
        work = dist.all_reduce(t, group=pcg, async_op=True)
    assert work.wait(timedelta(seconds=60)) and work.is_completed()
    assert torch.all(t == comm.size * (comm.size + 1) / 2)


def test_pypg_gather_scatter_and_p2p(comm, pcg):
    """all_gather_single and reduce_scatter_tensor reach the group's overrides, and a ring
    of dist.batch_isend_irecv (send and recv)."""
    P, r = comm.size, comm.rank
    got = torch.empty(2 * P, device=DEV)
    pcg.all_gather_single(got, torch.full((2,), float(r), device=DEV)).wait()     # the override itself
    assert got.cpu().tolist() == [float(q) for q in range(P) for _ in range(2)]
    rs = torch.empty(3, device=DEV)
    dist.reduce_scatter_tensor(rs, torch.arange(3 * P, dtype=torch.float32, device=DEV), group=pcg)
    assert rs.cpu().tolist() == [P * float(3 * r + i) for i in range(3)]
    send = torch.full((4,), float(r), device=DEV)
    recv = torch.zeros(4, device=DEV)
    right, left = (r + 1) % P, (r - 1) % P
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group=pcg),
                                   dist.P2POp(dist.irecv, recv, left, group=pcg)])
    for req in reqs:
        req.wait()
    assert recv.cpu().tolist() == [float(left)] * 4
    if P > 1:                                           # recv from any source names it
        if r == 0:
            w = pcg.recv_anysource([recv], 5)
            w.wait()
            assert w._source_rank() == P - 1
        elif r == P - 1:
            pcg.send([send], 0, 5).wait()
    dist.barrier(group=pcg)


def test_pypg_functional_and_coalesced_collectives(comm, pcg):
    """The collectives DTensor, FSDP2 and torch.compile'd code call: the functional ones
    (they reach a Python group through its *_coalesced methods), the coalesced ones,
    all_to_all with uneven splits and sizes, and all_gather_into_tensor in place (the
    input a view of this rank's chunk of the output, as FSDP2 gathers); each against the
    values every rank knows."""
    import torch.distributed._functional_collectives as funcol
    P, r = comm.size, comm.rank

    def full(n, v):
        return torch.full((n,), float(v), device=DEV)

    a, b = funcol.all_reduce_coalesced([full(3, r + 1), full(70000, 2 * r)], "sum", pcg)
    assert a.cpu().tolist() == [P * (P + 1) / 2] * 3 and torch.all(b == P * (P - 1))
    g = funcol.all_gather_tensor(torch.arange(2, dtype=torch.float32, device=DEV) + 10 * r, 0, pcg)
    assert g.cpu().tolist() == [float(10 * q + i) for q in range(P) for i in range(2)]
    gs = funcol.all_gather_into_tensor_coalesced([full(2, r), full(1, -r)], pcg)
    assert [t.cpu().tolist() for t in gs] == [[float(q) for q in range(P) for _ in range(2)],
                                              [float(-q) for q in range(P)]]
    rs = funcol.reduce_scatter_tensor(torch.arange(2 * P, dtype=torch.float32, device=DEV) + r, "sum", 0, pcg)
    assert rs.cpu().tolist() == [float(P * (2 * r + i) + P * (P - 1) // 2) for i in range(2)]
    both = torch.arange(3 * P, dtype=torch.float32, device=DEV) + r       # the output a view of the input
    dist.reduce_scatter_tensor(both[3 * r:3 * r + 3], both, group=pcg)
    assert both[3 * r:3 * r + 3].cpu().tolist() == [float(P * (3 * r + i) + P * (P - 1) // 2) for i in range(3)]
    # rank r sends q + 1 rows to rank q, each row [100 r + q, q]; it receives r + 1 from each
    rows = [[100.0 * r + q, float(q)] for q in range(P) for _ in range(q + 1)]
    got = funcol.all_to_all_single(torch.tensor(rows, device=DEV), [r + 1] * P, [q + 1 for q in range(P)], pcg)
    assert got.cpu().tolist() == [[100.0 * q + r, float(r)] for q in range(P) for _ in range(r + 1)]
    even = funcol.all_to_all_single(torch.arange(P, dtype=torch.float32, device=DEV) + 10 * r, None, None, pcg)
    assert even.cpu().tolist() == [float(10 * q + r) for q in range(P)]
    outs = [torch.empty(q + 1, dtype=torch.int64, device=DEV) for q in range(P)]
    dist.all_to_all(outs, [torch.full((r + 1,), 100 * r + q, dtype=torch.int64, device=DEV) for q in range(P)],
                    group=pcg)
    assert [o.cpu().tolist() for o in outs] == [[100 * q + r] * (q + 1) for q in range(P)]
    lists = [[torch.empty(2, device=DEV), torch.empty(1, device=DEV)] for _ in range(P)]
    dist.all_gather_coalesced(lists, [full(2, r), full(1, -r)], group=pcg)
    assert [[t.cpu().tolist() for t in ts] for ts in lists] == [[[float(q)] * 2, [float(-q)]] for q in range(P)]
    tensors = [full(3, r), full(5, 1)]
    dist.all_reduce_coalesced(tensors, group=pcg)
    assert tensors[0].cpu().tolist() == [P * (P - 1) / 2] * 3 and tensors[1].cpu().tolist() == [float(P)] * 5
    out = torch.full((4 * P,), -1.0, device=DEV)
    mine = out[4 * r:4 * (r + 1)]
    mine.copy_(full(4, r + 0.5))
    dist.all_gather_into_tensor(out, mine, group=pcg)
    assert out.cpu().tolist() == [q + 0.5 for q in range(P) for _ in range(4)]
    shifted = torch.arange(4 * P + 1, dtype=torch.float32, device=DEV)      # overlapping, not its chunk
    dist.all_gather_into_tensor(shifted[:4 * P], shifted[1:5], group=pcg)
    assert shifted[:4 * P].cpu().tolist() == [float(i) for _ in range(P) for i in range(1, 5)]
    expect_raises(pc.ArgumentError, funcol.all_to_all_single, torch.zeros(P + 1, device=DEV), [1] * P,
                  [1] * P, pcg, match="split sizes")


def test_fsdp2_equals_global_batch(comm, pcg):
    """FSDP2 (fully_shard) over the group: its all-gathers in place, reduce-scatters and
    DTensor's full_tensor(); the sharded model after 4 steps on this rank's shard equals
    one model trained on the global batch, and torch.distributed.checkpoint saves it and
    loads it into another sharded model, bit for bit."""
    at_one_size(comm)
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        pytest.skip(f"this torch has no FSDP2 (fully_shard): {e}")
    mesh = DeviceMesh.from_group(pcg, DEV.type)
    ref, sharded = model(), model()
    for layer in sharded.body:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, sharded)]
    for step in range(4):
        shards = [batch(q, step) for q in range(comm.size)]
        xs, ys = torch.cat([x for x, _ in shards]), torch.cat([y for _, y in shards])
        for m, opt, (x, y) in ((ref, opts[0], (xs, ys)), (sharded, opts[1], shards[comm.rank])):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for (name, p), q in zip(ref.named_parameters(), sharded.parameters()):
        q = q.full_tensor()
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-5), (name, (p - q).abs().max().item())
    # torch.distributed.checkpoint over the group: the sharded state saved, loaded into another
    import tempfile
    import torch.distributed.checkpoint as dcp
    where = comm.bcast(tempfile.mkdtemp(prefix="pc-dcp-") if comm.rank == 0 else None)
    dcp.save({"model": sharded.state_dict()}, checkpoint_id=where, process_group=pcg)
    other = model()
    for layer in other.body:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(other, mesh=mesh)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=where, process_group=pcg)
    other.load_state_dict(state["model"])
    for p, q in zip(sharded.parameters(), other.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor())
    comm.Barrier()
    if comm.rank == 0:
        import shutil
        shutil.rmtree(where, ignore_errors=True)


def test_pg_timeout_and_abort(comm, pcg):
    """A collective that cannot complete raises Timeout after the group's timeout (MPI's
    own calls have none) and the group refuses further calls; abort() returns at once on
    one rank, failing its Works, while the other ranks do nothing."""
    if comm.size < 2:
        pytest.skip("needs a rank that does not reach the barrier (P >= 2)")
    g = dist.new_group(backend="partialcoll", timeout=timedelta(seconds=1))
    if comm.rank == 0:
        t0 = time.monotonic()
        expect_raises(pc.Timeout, dist.barrier, group=g, match="timeout")
        assert time.monotonic() - t0 < 10
        expect_raises(pc.StateError, dist.all_reduce, torch.ones(2), group=g, match="timed out")
    comm.Barrier()
    if comm.rank != 0:
        g.comm.Ibarrier().Wait()          # the barrier rank 0 left behind (non-blocking: MPI matches it only so)
    comm.Barrier()
    g2 = dist.new_group(backend="partialcoll")
    if comm.rank == 0:
        buf = torch.zeros(4)
        work = g2.recv([buf], 1, 9)                  # rank 1 sends it only after the abort
        t0 = time.monotonic()
        g2.abort()
        assert time.monotonic() - t0 < 1.0, "abort() blocked"
        expect_raises(pc.StateError, work.wait, match="aborted")
        expect_raises(pc.StateError, dist.barrier, group=g2, match="aborted")
    comm.Barrier()
    if comm.rank == 1:
        g2.send([torch.ones(4)], 0, 9).wait()       # ends rank 0's receive (its thread then ends)
    comm.Barrier()


def test_pg_eviction_while_waited(comm, pcg):
    """More allreduce sizes than the group caches, all in flight at once: evicted
    collectives are closed after their rounds, never under a wait (every result right)."""
    from partialcoll.integrations._torch_pg import ENGINE_MIN_BYTES, MAX_CACHED
    base = ENGINE_MIN_BYTES // 4
    tensors = [torch.full((base + i,), float(comm.rank + i), device=DEV) for i in range(MAX_CACHED + 6)]
    works = [dist.all_reduce(t, group=pcg, async_op=True) for t in tensors]
    for i, (w, t) in enumerate(zip(works, tensors)):
        w.wait()
        assert torch.all(t == sum(r + i for r in range(comm.size))), i


def test_local_rank_and_env(comm, pcg):
    """local_rank()/local_size() from the node's shared-memory communicator; init set
    LOCAL_RANK, LOCAL_WORLD_SIZE, RANK, WORLD_SIZE without overwriting the user's."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    assert (pct.local_rank(), pct.local_size()) == (node.rank, node.size)
    node.Free()
    assert os.environ["LOCAL_RANK"] == str(pct.local_rank())
    assert os.environ["LOCAL_WORLD_SIZE"] == str(pct.local_size())
    assert os.environ["RANK"] == str(comm.rank) and os.environ["WORLD_SIZE"] == str(comm.size)
    from partialcoll.integrations import _torch_comm
    os.environ["LOCAL_RANK"] = "77"
    _torch_comm.set_launch_env(comm)
    assert os.environ["LOCAL_RANK"] == "77"
    os.environ["LOCAL_RANK"] = str(pct.local_rank())


if __name__ == "__main__":
    run_module(__file__)
