"""RNA in the PyTorch integration: python torch_rna_checks.py (P >= 1).

DistributedOptimizer(hierarchy="auto", average_every=k), and the DDP hook with the same
options, regroup a slow rank into its own group from measured step times, and right
after each averaging every member of a group holds the same parameters;
lr_scaling="contributors" applies lr times the share of contributors, and the base rate
is back after the step; bad options raise everywhere."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from partialcoll import ArgumentError
from partialcoll.integrations.torch import DistributedOptimizer, GradientSynchronizer, partial_ddp
from _util import expect_raises, progress, run_module
from torch_checks import batch, held_out_loss, loss_of, model
from torch_checks import pcg as pcg   # the process group fixture, for pytest


def flat(m):
    return torch.cat([p.detach().double().reshape(-1) for p in m.parameters()]).numpy()


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("mode", [dict(mode="probe"), dict(mode="quorum", quorum=2)], ids=["probe", "quorum"])
def test_hierarchy_regroups_and_averages(comm, mode):
    """quorum=2: the slow rank's group, of one, waits for its one rank (k of each group,
    at most the group's size)."""
    p, r = comm.size, comm.rank
    m = model()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), **mode, comm=comm, average="nap",
                               late="fold", hierarchy="auto", average_every=2, regroup_every=4, window=3,
                               hysteresis=1, regroup_points=1)
    sync = opt._sync
    assert sync.grouping.groups == (0,) * p
    before = held_out_loss(m)
    for step in range(14):
        time.sleep(0.12 if r == p - 1 else 0.02)    # step times far apart, each well above the noise
        x, y = batch(r, step)
        opt.zero_grad()
        loss = loss_of(m, x, y)
        loss.backward()
        opt.synchronize()
        if sync.steps % 2 == 0:           # averaged just now (before the step): equal in the group
            mine = flat(m)
            assert all(np.array_equal(mine, f) for f in sync.grouping.group_comm.allgather(mine))
        with opt.skip_synchronize():
            opt.step()
    assert sync.grouping.regroupings == 1           # at step 4, the only point
    groups = sync.grouping.groups
    assert groups[p - 1] == max(groups) > 0 and groups.count(groups[p - 1]) == 1, groups
    assert sync.size == groups.count(groups[r])
    opt.close()
    assert held_out_loss(m) < before


def test_lr_scaling_contributors(comm):
    r = comm.rank
    m = model()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), mode="solo", comm=comm, average="nap",
                               lr_scaling="contributors")
    for step in range(6):
        time.sleep(0.002 * ((step + r) % 3))
        x, y = batch(r, step)
        opt.zero_grad()
        loss_of(m, x, y).backward()
        opt.synchronize()
        before = [q.detach().clone() for q in m.parameters()]
        grads = [q.grad.detach().clone() for q in m.parameters()]
        scale = opt._sync.lr_scale()
        naps = [res.nap / max(res.rounds, 1) for res in opt.last if res.nap]
        assert scale == (pytest.approx(min(1.0, sum(naps) / len(naps) / comm.size)) if naps else 1.0)
        assert 0 < scale <= 1
        with opt.skip_synchronize():
            opt.step()
        assert opt.param_groups[0]["lr"] == 0.1          # the base rate is back
        for q, b, g in zip(m.parameters(), before, grads):
            assert torch.allclose(q.detach(), b - 0.1 * scale * g, rtol=1e-5, atol=1e-7)
    opt.close()
    full = DistributedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), mode="full", comm=comm,
                                lr_scaling="contributors")
    mm = full._sync.params
    x, y = batch(r, 0)
    full.zero_grad()
    torch.nn.functional.mse_loss(sum(q.sum() for q in mm), torch.tensor(0.0)).backward()
    full.step()
    assert full._sync.lr_scale() == 1.0                    # every rank in every full round
    full.close()


class _SlowForward(torch.nn.Module):
    """The checks' model, its forward slowed by `delay` seconds (a slow device)."""

    def __init__(self, delay):
        super().__init__()
        self.net, self.delay = model(), delay

    def forward(self, x):
        time.sleep(self.delay)
        return self.net(x)


@pytest.mark.mpi(min_size=3)
def test_ddp_hook_hierarchy(comm, pcg):
    """The DDP hook with hierarchy="auto": the rank whose forward is slow ends alone in
    the slowest group; right after each averaging every member of a group holds the same
    parameters; lr_scale() is the contributors' share. Mode quorum(2): the slow rank's
    group, of one, waits for its one rank."""
    p, r = comm.size, comm.rank
    m = _SlowForward(0.12 if r == p - 1 else 0.02)
    ddp, state = partial_ddp(m, mode="quorum", quorum=2, comm=comm, average="nap", late="fold", hierarchy="auto",
                             average_every=2, regroup_every=4, regroup_points=1, hysteresis=1, window=3,
                             start_iter=1)
    checked = []

    def after_sync(module, args):             # runs after the state's sync_hook (registered first)
        if state.iter and state.iter % 2 == 0 and state.iter not in checked:
            checked.append(state.iter)
            mine = flat(m)
            assert all(np.array_equal(mine, f) for f in state.grouping.group_comm.allgather(mine)), state.iter
    ddp.register_forward_pre_hook(after_sync)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(11):
        x, y = batch(r, step)
        opt.zero_grad()
        loss_of(ddp, x, y).backward()
        assert 0 < state.lr_scale() <= 1
        opt.step()
    assert state.grouping.regroupings == 1
    groups = state.grouping.groups
    assert groups[p - 1] == max(groups) > 0 and groups.count(groups[p - 1]) == 1, groups
    assert checked == [2, 4, 6, 8, 10]
    state.close()


def test_bad_options_everywhere(comm):
    p, r = comm.size, comm.rank
    m = model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    expect_raises(ArgumentError, DistributedOptimizer, sgd, comm=comm, lr_scaling="linear", match="lr_scaling")
    expect_raises(ArgumentError, GradientSynchronizer, m.parameters(), comm=comm, hierarchy="static",
                  match="hierarchy")
    expect_raises(ArgumentError, GradientSynchronizer, m.parameters(), comm=comm, average_every=3,
                  match="average_every")
    expect_raises(ArgumentError, GradientSynchronizer, m.parameters(), comm=comm, hierarchy="auto", server=p,
                  match="server")
    if p > 1:
        expect_raises(ArgumentError, GradientSynchronizer, m.parameters(), comm=comm, hierarchy="auto",
                      average_every=2 + r, match="average_every")
        expect_raises(ArgumentError, GradientSynchronizer, m.parameters(), comm=comm, model_sync_every=2 + r,
                      match="model_sync_every differs")
    expect_raises(ArgumentError, GradientSynchronizer, m.parameters(), comm=comm, model_sync_every=-3 if r == 0 else 4,
                  match="model_sync_every")


def test_hierarchy_needs_the_servers_progress_thread(comm):
    """hierarchy="auto" averages the groups' models through an AsyncAverager, whose server
    serves on its progress thread: with the server's process progressing inline the
    optimizer raises on every rank when it is made (it used to hang at its first
    averaging, where the server waited in an MPI call while the others waited for it)."""
    if comm.size == 1:
        pytest.skip("alone, the server has nobody to serve: inline works")
    m = model()
    with progress("inline", here=comm.rank == 0):
        expect_raises(ArgumentError, DistributedOptimizer, torch.optim.SGD(m.parameters(), lr=0.1), mode="probe",
                      comm=comm, hierarchy="auto", average_every=2, match="inline")


if __name__ == "__main__":
    run_module(__file__)
