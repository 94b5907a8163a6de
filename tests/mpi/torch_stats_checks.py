"""Who is slow through the DDP hook: python torch_stats_checks.py

partial_ddp(report_every=5): every rank takes equal steps, but rank P - 1 sleeps 20 ms
before each backward (the reference: the delay this check injects). The table logged on
"partialcoll" after the first 5 steps names it: first in the full mode, with the most
mean lateness in the solo mode (where every rank but the initiator joins late), and
state.stats() (collective) does too; so do DistributedOptimizer.stats() and the
partialcoll process group's stats().
"""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from partialcoll.integrations.torch import partial_ddp
from _util import run_module


class _Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(model, opt, slow: bool, steps: int) -> None:
    """steps of SGD on one batch; a slow rank sleeps 20 ms before each backward."""
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if slow:
            time.sleep(0.02)
        loss.backward()
        opt.step()


@pytest.mark.parametrize("mode", ["full", "solo"])
def test_ddp_report_names_the_slow_rank(comm, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ddp, state = partial_ddp(model, mode=mode, report_every=5, start_iter=1)
    grab = _Grab()
    log = logging.getLogger("partialcoll")
    old = log.level
    log.setLevel(logging.INFO)
    log.addHandler(grab)
    slow = comm.size - 1
    try:
        _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), comm.rank == slow, 7)
        stats = state.stats()
    finally:
        log.removeHandler(grab)
        log.setLevel(old)
        state.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    tables = [line for line in grab.lines if "who is slow" in line]
    assert tables, grab.lines
    rows = [line.split() for line in tables[0].splitlines()[2:2 + comm.size]]
    if mode == "full":               # the table is in stragglers() order: it heads it
        assert int(rows[0][0]) == slow, f"{mode}: rank {slow} slept 20 ms per step\n{tables[0]}"
        assert stats.stragglers()[0] == slow, f"{mode}\n{stats}"
    else:
        # solo: nobody waits, and every rank but the round's initiator joins it late (by the
        # time it takes to post after it), so the count of late rounds cannot tell the
        # ranks apart; how late they were does: the slow rank's mean lateness is the most,
        # in the logged table and in blame()
        mean = {int(r[0]): _seconds(r[2:4]) for r in rows}
        assert max(mean, key=mean.get) == slow, f"{mode}: rank {slow} slept 20 ms per step\n{tables[0]}"
        assert int(np.argmax(stats.blame())) == slow, f"{mode}\n{stats}"


def _seconds(tokens) -> float:
    """A duration as the table prints it ("31.3 ms"; "-": none recorded, 0 here)."""
    if tokens[0] == "-":
        return 0.0
    return float(tokens[0]) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[tokens[1]]


def test_optimizer_stats_name_the_slow_rank(comm):
    """DistributedOptimizer(mode="full").stats(): the rank sleeping 20 ms before each
    backward is named first."""
    from partialcoll.integrations.torch import DistributedOptimizer
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), mode="full", comm=comm)
    slow = comm.size - 1
    try:
        _train(model, opt, comm.rank == slow, 6)
        stats = opt.stats()
    finally:
        opt.close()
    assert stats.stragglers()[0] == slow and stats.full == stats.rounds, stats


def test_process_group_stats_name_the_slow_rank(comm):
    """The partialcoll process group's stats(): dist.all_reduce of a tensor large enough to
    go through the engine, rank P - 1 sleeping 20 ms before each; it is named first."""
    import partialcoll.integrations.torch as pct
    pct.init_process_group(comm)
    slow = comm.size - 1
    try:
        pg = dist.group.WORLD                     # the partialcoll process group itself
        t = torch.ones(40000)
        for _ in range(6):
            if comm.rank == slow:
                time.sleep(0.02)
            dist.all_reduce(t)
        stats = pg.stats()
    finally:
        dist.destroy_process_group()
    assert t[0].item() == comm.size ** 6          # the allreduces did run (the reference: P^6)
    assert stats.rounds >= 6 and stats.stragglers()[0] == slow, stats


if __name__ == "__main__":
    run_module(__file__)
