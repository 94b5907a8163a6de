"""PyTorch integration (issue 6): python torch_checks.py

PC_TEST_TORCH_DEVICE=cuda runs the model on the GPU: its gradients then reach the
library as CuPy views (issue 7)."""
from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist

from partialcoll.integrations.torch import (GradientSynchronizer, PartialHookState, partial_allreduce_hook,
                                            sync_parameters)
from _util import main

D = 16
DEV = torch.device(os.environ.get("PC_TEST_TORCH_DEVICE", "cpu"))


def host(x) -> np.ndarray:
    """A NumPy copy of a tensor, a CuPy array or a NumPy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if type(x).__module__.split(".")[0] == "cupy":
        if DEV.type == "cuda":
            assert x.device.id == torch.cuda.current_device()
        return x.get()
    assert DEV.type == "cpu", f"a CUDA model's result came back as {type(x).__name__}"
    return x


def init_gloo(comm):
    if DEV.type == "cuda":
        torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    port = comm.bcast(29500 + (os.getpid() % 2000) if comm.rank == 0 else None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, D, generator=g)
    return x.to(DEV), (x @ torch.arange(D, dtype=torch.float32) / D).to(DEV)


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(D, 1, bias=False).to(DEV)


def ddp_full_matches_ddp(comm):
    """mode="full" through the hook gives DDP's own parameters after 20 steps."""
    ref, ours = model(), model()
    ddp_ref = torch.nn.parallel.DistributedDataParallel(ref)
    ddp_ours = torch.nn.parallel.DistributedDataParallel(ours)
    state = PartialHookState(mode="full", comm=comm)
    ddp_ours.register_comm_hook(state, partial_allreduce_hook)
    for m in (ddp_ref, ddp_ours):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in range(20):
            x, y = batch(comm.rank, step)
            opt.zero_grad()
            ((m(x).squeeze() - y) ** 2).mean().backward()
            opt.step()
    state.close()
    assert torch.allclose(ref.weight, ours.weight, rtol=1e-5, atol=1e-6), (ref.weight - ours.weight).abs().max()


def solo_nothing_lost(comm):
    """solo with one slow rank: the loss falls, and sum of applied updates + the flush
    equals the sum of all local gradients (on a linear model)."""
    m = model()
    lr = 0.05
    sync = GradientSynchronizer(m.parameters(), mode="solo", comm=comm, average="none", late="fold")
    w0 = m.weight.detach().clone()
    local_sum = torch.zeros_like(m.weight)
    losses = []
    for step in range(30):
        if comm.rank == comm.size - 1:
            time.sleep(0.01)                     # the slow rank
        x, y = batch(comm.rank, step)
        m.zero_grad()
        loss = ((m(x).squeeze() - y) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        local_sum += m.weight.grad
        sync.sync()
        with torch.no_grad():
            m.weight -= lr * m.weight.grad
    flushed = host(sync.close()[0].data).reshape(tuple(m.weight.shape))
    applied = host((w0 - m.weight.detach()) / lr)      # sum of applied (summed) gradients
    everyone = np.empty(D, np.float32)
    comm.Allreduce(host(local_sum).ravel(), everyone)
    assert np.allclose((applied + flushed).ravel(), everyone, rtol=1e-4, atol=1e-4)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses


def nap_average_and_model_sync(comm):
    m = model()
    with torch.no_grad():
        m.weight += comm.rank                          # models differ
    sync = GradientSynchronizer(m.parameters(), mode="majority", comm=comm, average="nap",
                                model_sync_every=5)
    for step in range(10):
        x, y = batch(comm.rank, step)
        m.zero_grad()
        ((m(x).squeeze() - y) ** 2).mean().backward()
        res = sync.sync()[0]
        assert np.allclose(host(m.weight.grad).ravel(), host(res.data) / res.nap, rtol=1e-6), "not divided by nap"
        with torch.no_grad():
            m.weight -= 0.01 * m.weight.grad
    sync.close()
    weights = comm.allgather(host(m.weight).copy())   # step 10 synced the model
    assert all(np.array_equal(weights[0], w) for w in weights), "models differ after sync"
    sync_parameters(m.parameters(), comm, how="broadcast")


def body(comm):
    init_gloo(comm)
    ddp_full_matches_ddp(comm)
    solo_nothing_lost(comm)
    nap_average_and_model_sync(comm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(body)
