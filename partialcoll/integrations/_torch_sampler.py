"""A sampler that gives each rank a share of the epoch in proportion to its measured
speed (PSLD's load distribution away from slow servers, applied to data): with one
persistent straggler and a partial mode, the fast ranks take more of the epoch instead of
idling at its end, where Horovod's loop synchronises (test metrics, a barrier).

Shares are decided at ``set_epoch()``, which is collective (as every rank calls
DistributedSampler.set_epoch in Horovod's and torch's loops): the ranks exchange their
measured rates (indices per second over the previous epoch, one small allgather) and cut
the epoch's permutation, the same on every rank, into consecutive pieces of those sizes.
The rate is measured by the sampler itself, from the first index it yields to the end of
its iteration (num_workers=0: the loader pulls indices as the steps run), or set by
``note(rate)``. Under a synchronous mode every rank's rate is the slowest's, so the
shares stay equal there.
"""
from __future__ import annotations

import time
from typing import Iterator, List, Optional, Sized, Union

import torch
from mpi4py import MPI

from .._errors import ArgumentError
from .._types import integer


class SpeedAwareSampler(torch.utils.data.Sampler):
    """``DistributedSampler``'s role (this rank's part of each epoch, shuffled by
    ``seed + epoch``), with parts in proportion to the ranks' measured speeds::

        sampler = pct.SpeedAwareSampler(train_set)
        loader = DataLoader(train_set, batch_size=32, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)         # collective: the shares of this epoch
            for x, y in loader: ...

    It takes DistributedSampler's arguments (``num_replicas`` and ``rank``, checked
    against ``comm``; ``drop_last`` changes nothing: the parts cover the epoch exactly,
    nothing is padded or dropped), so a script puts it in DistributedSampler's place by
    its name. The first epoch's parts are equal (nothing is measured yet). ``min_share`` (default
    0.25) bounds a rank's part from below, as a fraction of an equal part, so a rank slowed
    by a passing hiccup still sees its data. ``shares`` holds the latest fractions (one per
    rank, summing to 1)."""

    def __init__(self, dataset: Union[Sized, int], num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *, comm: MPI.Comm = MPI.COMM_WORLD,
                 min_share: float = 0.25, smoothing: float = 0.5) -> None:
        # DistributedSampler's arguments, so that the one is put in the other's place by its name
        if num_replicas is not None and num_replicas != comm.Get_size():
            raise ArgumentError(f"num_replicas={num_replicas!r}: the sampler's ranks are comm's, "
                                f"{comm.Get_size()} of them (pass comm= for another set)")
        if rank is not None and rank != comm.Get_rank():
            raise ArgumentError(f"rank={rank!r}: this process is rank {comm.Get_rank()} of comm")
        if not isinstance(drop_last, bool):
            raise ArgumentError(f"drop_last must be a bool, not {drop_last!r}")
        self.n = integer(dataset, "dataset length", 0) if isinstance(dataset, int) else len(dataset)
        self.comm, self.shuffle, self.seed = comm, shuffle, int(seed)
        if not 0.0 <= min_share <= 1.0:
            raise ArgumentError(f"min_share must be within [0, 1], not {min_share!r}")
        if not 0.0 <= smoothing < 1.0:
            raise ArgumentError(f"smoothing must be within [0, 1), not {smoothing!r}")
        self.min_share, self.smoothing = float(min_share), float(smoothing)
        size = comm.Get_size()
        self.shares: List[float] = [1.0 / size] * size
        self.epoch = 0
        self._rate: Optional[float] = None       # this rank's indices per second, measured
        self._smoothed: Optional[List[float]] = None
        self._counts = self._cut(self.shares)

    def note(self, rate: float) -> None:
        """Set this rank's rate (indices per second) for the next set_epoch()."""
        self._rate = float(rate)

    def set_epoch(self, epoch: int) -> None:
        """Collective over comm: the epoch's seed, and the shares from the rates measured."""
        self.epoch = int(epoch)
        rates = self.comm.allgather(self._rate)
        if all(r is not None and r > 0 for r in rates):
            if self._smoothed is not None:
                a = self.smoothing
                rates = [a * old + (1 - a) * new for old, new in zip(self._smoothed, rates)]
            self._smoothed = list(rates)
            total = sum(rates)
            size = len(rates)
            floor = self.min_share / size
            shares = [max(r / total, floor) for r in rates]
            norm = sum(shares)
            self.shares = [s / norm for s in shares]
        self._counts = self._cut(self.shares)

    def _cut(self, shares: List[float]) -> List[int]:
        """Sizes of the ranks' parts: floor(n * share), the rest one by one to the largest
        remainders (the same on every rank)."""
        raw = [self.n * s for s in shares]
        counts = [int(x) for x in raw]
        order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
        for i in order[:self.n - sum(counts)]:
            counts[i] += 1
        return counts

    def __len__(self) -> int:
        return self._counts[self.comm.Get_rank()]

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.n))
        rank = self.comm.Get_rank()
        start = sum(self._counts[:rank])
        mine = order[start:start + self._counts[rank]]
        t0 = None
        for i, index in enumerate(mine):
            if i == 1:
                t0 = time.perf_counter()     # from the second pull: the first batch's step is the first timed
            yield index
        if t0 is not None and len(mine) > 1:
            elapsed = time.perf_counter() - t0
            if elapsed > 0:
                self._rate = (len(mine) - 1) / elapsed
