"""The DDP communication hook: each gradient bucket reduced by a persistent partial
allreduce over the MPI communicator of DDP's process group (PowerSGD's shape: a small
function of (state, bucket), everything else in the state object).

The communicator comes from the torch process group (``_torch_comm.comm_of_group``):
the partialcoll backend's group gives its own; another backend's group (gloo, nccl) a
communicator of the same processes in the same order, checked over the group itself.
A ``comm=`` that is not that communicator is an error on every member.

Threads: the hook posts on the thread that runs it (autograd's) and returns a future;
the state's Completer thread waits for the rounds and completes the futures. The
state's collectives are closed (a bucket rebuild, ``close()``) only after that thread
has been joined, so no close runs under one of its waits.
"""
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import _stats
from .._partial import PartialAllreduce, Result, close_all
from . import _torch_comm
from ..hierarchical import SpeedGrouping, group_args
from .._errors import ArgumentError
from ._torch_common import (Completer, ShrinkWatch, buffer_of, check_average, contributor_scale, divisor, for_torch, fused_divisor,
                            np_dtype, settle, tensor_of, warn_drift)
from ._torch_optim import GradientSynchronizer, ModelSync, average_models, close_with, start_averaging
from ._torch_pg import init_process_group

_HOOK_OPTIONS = ("late", "max_staleness", "seed", "candidates", "quorum", "algorithm", "start_iter",
                 "model_sync_every", "accumulate", "hierarchy", "average_every", "regroup_every", "server", "window",
                 "hysteresis", "regroup_points", "buffer_sync_every", "report_every", "on_failure", "on_shrink")


class BufferSync(ModelSync):
    """The floating buffers of a module (BatchNorm's running statistics) averaged over the
    ranks through a solo partial allreduce, so no rank waits for another to have them:
    each sync posts this rank's buffers and takes the mean of what the round holds
    (``Result.posts``: the round's sum over the number of posts inside it, leftovers of
    ranks that were late included; a round that holds none leaves them as they were).
    Integer buffers (num_batches_tracked) stay each rank's. Collective to make over comm."""

    def __init__(self, buffers: List[torch.Tensor], comm: MPI.Comm, **options) -> None:
        super().__init__([b for b in buffers if b.is_floating_point()], comm, mode="solo", late="latest", **options)

    @property
    def buffers(self) -> List[torch.Tensor]:
        return self.params


class _BucketColl:
    """One DDP bucket's collective, and where each of its parameters lies in the bucket."""

    __slots__ = ("coll", "params", "offsets", "iteration")

    def __init__(self, coll: PartialAllreduce, params: List[torch.Tensor], offsets: List[int],
                 iteration: int) -> None:
        self.coll, self.params, self.offsets, self.iteration = coll, params, offsets, iteration


class PartialHookState:
    """Options and per-bucket collectives of ``partial_allreduce_hook`` (PowerSGDState's role).

    Args:
        process_group: DDP's process group (default: the default group): its processes are
            the ones the hook reduces over, through their MPI communicator
        comm: optional: that communicator itself (checked against the group)
        mode, late, max_staleness, ...: options of each bucket's PartialAllreduce
        average: "world": divide the round's sum by P (eager-SGD); "nap": by the number
            of posts inside it (RNA's NAP, counting leftovers: the exact mean of
            what it holds); "none": leave the sum
        start_iter: iterations reduced by a plain allreduce of ``process_group`` first (as
            PowerSGD's start_powerSGD_iter): DDP rebuilds its buckets after the
            first iteration, so collectives made before would be thrown away
        model_sync_every: k: every k iterations, the parameters are averaged over the group
            before the forward pass (``sync_hook``, a forward pre-hook of the DDP
            module; partial_ddp registers it), which bounds how far the partial
            modes let the models drift apart. Over the ranks that have not closed:
            ranks may take different numbers of steps (``last_model_sync``: the
            latest average's Result, ``posts`` the ranks it averaged)

    hierarchy="auto", average_every=k (regroup_every, server, window, hysteresis,
                 regroup_points): RNA's hierarchical synchronization, as in
                 GradientSynchronizer; the ranks' compute time is measured from the
                 forward pre-hook to the last bucket's hook (``sync_hook``, which
                 partial_ddp registers, also regroups and averages the groups' models)
    on_failure="shrink": a rank that fails (killed, exits, raises) is left out and the
                 others train on (docs/faults.md): averages divide by the survivors
                 from the step it failed in; ``on_shrink(failed_ranks, new_size)`` is
                 called once per failure (on the hook's thread, before that step's
                 backward() returns) to rescale the learning rate or batch; later
                 calls through the partialcoll process group raise StateError (its
                 size counts the dead). Not with hierarchy=; the first start_iter
                 iterations (the process group's allreduce) do not survive a failure.
    lr_scale()   RNA's linear scaling factor of the latest iteration's results (the
                 contributors' share): multiply the learning rate by it
    stats()      who is slow over the buckets' collectives (collective; pc.Stats); with
                 report_every=N, every N iterations, before the forward pass, that table
                 is logged on logger "partialcoll" (INFO; collective: the ranks take the
                 same numbers of steps)

    Collectives are keyed by the bucket's parameters, never by ``bucket.index()``: a
    bucket that changes (DDP rebuilt its buckets) gets a new collective, and the old
    ones are closed (collectively, every rank sees the same change at the same bucket);
    what their accumulators still held is added to the next results of the same
    parameters, so nothing is lost or lands on another parameter. Collective to make
    (over the group's members).
    """

    def __init__(self, mode: str = "full", comm: Optional[MPI.Comm] = None, average: str = "world",
                 start_iter: int = 2, process_group: Optional[dist.ProcessGroup] = None,
                 model_sync_every: Optional[int] = None, hierarchy: Optional[str] = None,
                 average_every: Optional[int] = None, regroup_every: int = 20, server: int = 0, window: int = 8,
                 hysteresis: int = 2, regroup_points: Optional[int] = None, buffer_sync_every: Optional[int] = None,
                 report_every: Optional[int] = None, on_failure: Optional[str] = None,
                 on_shrink: Optional[Callable[[Tuple[int, ...], int], None]] = None,
                 **options) -> None:
        # what pickling keeps (PowerSGDState's way: the process group is not pickled; an
        # unpickled state is made anew, collectively, over the default group)
        self._args = dict(mode=mode, average=average, start_iter=start_iter, model_sync_every=model_sync_every,
                          hierarchy=hierarchy, average_every=average_every, regroup_every=regroup_every,
                          server=server, window=window, hysteresis=hysteresis, regroup_points=regroup_points,
                          buffer_sync_every=buffer_sync_every, report_every=report_every,
                          on_failure=on_failure, on_shrink=on_shrink, **options)
        self.mode, self.average, self.options = mode, check_average(average), options
        self.buffer_sync_every = int(buffer_sync_every or 0)
        self.buffer_sync: Optional[BufferSync] = None     # made at the first training forward
        warn_drift(mode, options.get("late", "latest"), model_sync_every)
        self.report_every, self._reported = _stats.check_every(report_every), 0    # who is slow
        self.start_iter, self.process_group = int(start_iter), process_group
        self.comm, self._owns_comm = _torch_comm.comm_of_group(process_group, comm)
        self.size = self.comm.Get_size()
        self.hierarchy, self.average_every, self.model_sync_every = GradientSynchronizer._agreed_options(
            self.comm, hierarchy, average_every, regroup_every, server, window, hysteresis, regroup_points,
            model_sync_every)
        self.grouping: Optional[SpeedGrouping] = None
        self.shrink = ShrinkWatch(on_failure, on_shrink, self.size, process_group or
                                  (dist.group.WORLD if dist.is_initialized() else None))
        if self.hierarchy and on_failure == "shrink":
            raise ArgumentError("on_failure='shrink' with hierarchy=: the speed groups are not rebuilt after a "
                                "failure; leave one of them out")
        if self.hierarchy:
            self.grouping = SpeedGrouping(self.comm, server=server, window=window, hysteresis=hysteresis,
                                          regroup_every=regroup_every, regroup_points=regroup_points)
            self.size = self.grouping.group_comm.Get_size()
        self._flat_dtype: Optional[np.dtype] = None     # the averager's, made at the first forward
        self._forward_at: Optional[float] = None
        self._backward_at: Optional[float] = None
        self._hier_iter = -1                 # the iteration sync_hook last acted on
        self.model_sync: Optional[ModelSync] = None     # made at the first training forward
        self.iter = 0
        self._synced_at = 0
        self.colls: Dict[Tuple[int, ...], _BucketColl] = {}
        self.last: Dict[int, Result] = {}                 # bucket index -> its latest result
        self.flushed: List[Result] = []                   # results of collectives closed on a rebuild
        self._carry: Dict[int, torch.Tensor] = {}         # id(param) -> flushed data still to apply
        self._completer = Completer("partialcoll-ddp-hook")

    def __getstate__(self) -> dict:
        return {"args": self._args, "iter": self.iter}

    def __setstate__(self, state: dict) -> None:
        PartialHookState.__init__(self, **state["args"])     # collective, as making one
        self.iter = state["iter"]

    # -- iterations (PowerSGD's maybe_increase_iter) -----------------------------------
    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    # -- collectives --------------------------------------------------------------------
    def coll_for(self, bucket: dist.GradBucket, buf: torch.Tensor) -> _BucketColl:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        entry = self.colls.get(key)
        if entry is None:
            if any(e.iteration < self.iter for e in self.colls.values()):
                self._flush()            # buckets changed since those were made
            base, item = buf.data_ptr(), buf.element_size()
            offsets = [(g.data_ptr() - base) // item for g in bucket.gradients()]
            comm = self.grouping.group_comm if self.grouping is not None else self.comm
            coll = PartialAllreduce(buf.numel(), np_dtype(buf), MPI.SUM, comm, mode=self.mode,
                                    divisor=fused_divisor(self.average, self.size, buf),
                                    **group_args(self.options, comm, self.comm), **self.shrink.coll_args())
            self.shrink.watch(coll, self.average)
            entry = _BucketColl(coll, list(params), offsets, self.iter)
            self.colls[key] = entry
        return entry

    def _flush(self) -> None:
        """Close every collective (collective); keep what they held for their parameters."""
        self._completer.stop()           # DDP waited for every round already; be sure
        entries = list(self.colls.values())
        for entry, res in zip(entries, close_all([e.coll for e in entries])):
            self.flushed.append(res)
            like = entry.params[0] if entry.params else None
            data = tensor_of(res.data, like.dtype if like is not None else None)
            data = data / divisor(res, self.average, self.size, entry.coll.divisor)
            for p, off in zip(entry.params, entry.offsets):
                piece = data[off:off + p.numel()]
                self._carry[id(p)] = self._carry[id(p)] + piece if id(p) in self._carry else piece.clone()
        self.colls.clear()

    def _apply_carry(self, entry: _BucketColl, buf: torch.Tensor) -> None:
        for p, off in zip(entry.params, entry.offsets):
            piece = self._carry.pop(id(p), None)
            if piece is not None:
                buf[off:off + p.numel()] += piece.to(device=buf.device, dtype=buf.dtype)

    # -- drift ---------------------------------------------------------------------------
    def sync_hook(self, module: torch.nn.Module, args) -> None:
        """Forward pre-hook of the DDP module: every model_sync_every iterations, average
        the parameters over the group (collective; training forward passes only)."""
        if self.report_every and self.iter >= self._reported + self.report_every and self.colls:
            self._reported = self.iter           # who is slow: the table every report_every steps
            _stats.report(self.stats(), self.iter)
        every = self.model_sync_every
        if every and module.training and torch.is_grad_enabled():
            if self.model_sync is None:          # collective: every rank that trains gets here first
                self.model_sync = ModelSync([p for p in module.parameters() if p.requires_grad], self.comm,
                                            **self.shrink.coll_args())
            if self.iter - self._synced_at >= every:
                self._synced_at = self.iter
                self.model_sync.sync()
        if self.buffer_sync_every and self.buffer_sync is None and not any(b.is_floating_point()
                                                                           for b in module.buffers()):
            self.buffer_sync_every = 0           # nothing to average (the same model on every rank)
        if self.buffer_sync_every and module.training and torch.is_grad_enabled():
            if self.buffer_sync is None:         # collective, as model_sync's
                self.buffer_sync = BufferSync(list(module.buffers()), self.comm, **self.shrink.coll_args())
            if self.iter % self.buffer_sync_every == 0:
                self.buffer_sync.sync()
        if self.grouping is not None and module.training and torch.is_grad_enabled():
            self._hierarchy_step(self.grouping, [p for p in module.parameters() if p.requires_grad])

    def _hierarchy_step(self, grouping: SpeedGrouping, params: List[torch.Tensor]) -> None:
        """Before a training forward pass (once per iteration; DDP has waited for the
        previous iteration's rounds): note the previous iteration's compute time, average
        the groups' models every average_every iterations, regroup at a point where a new
        grouping is due (the collectives are flushed: their data joins the next results of
        the same parameters)."""
        if self._hier_iter == self.iter:          # a second forward in this iteration
            return
        self._hier_iter = self.iter
        if self._flat_dtype is None:
            self._flat_dtype = start_averaging(grouping, params)
        flat_dtype = self._flat_dtype
        if self._forward_at is not None and self._backward_at is not None and self._backward_at > self._forward_at:
            grouping.note(self._backward_at - self._forward_at)
        if self.average_every and self.iter > 0 and self.iter % self.average_every == 0:
            average_models(grouping, params, flat_dtype)
        if grouping.point(self.iter) and grouping.decide():
            self._flush()
            grouping.adopt(grouping.proposed)
            grouping.regroupings += 1
            self.size = grouping.group_comm.Get_size()
        self._forward_at = time.perf_counter()

    def stats(self) -> _stats.Stats:
        """Who is slow over the buckets' collectives (docs/who-is-slow.md; collective)."""
        return _stats.merge([c.stats() for c in _stats.ordered(e.coll for e in self.colls.values())],
                            "the DDP hook's buckets")

    @property
    def last_model_sync(self) -> Optional[Result]:
        """The latest model_sync_every average's Result (posts: how many ranks' models it
        averaged), None before the first."""
        return self.model_sync.last if self.model_sync is not None else None

    def lr_scale(self) -> float:
        """RNA's linear scaling factor of the latest iteration's results: the share of the
        ranks (of the group) whose gradients they hold."""
        return contributor_scale(list(self.last.values()), self.size)

    def close(self) -> Dict[int, Result]:
        """Collective: flush every bucket's collective; returns the final results by bucket
        position (0 = the first bucket DDP reduced)."""
        self._completer.stop()
        more = [self.buffer_sync.coll] if self.buffer_sync is not None else []
        out = dict(enumerate(close_with([e.coll for e in self.colls.values()], self.model_sync, more)))
        self.colls.clear()
        self.model_sync = None
        self.buffer_sync = None
        if self.grouping is not None:
            self.grouping.free()
            self.grouping = None
        if self._owns_comm and not MPI.Is_finalized():
            self.comm.Free()
            self._owns_comm = False
        return out


# No `from __future__ import annotations` in this module: DDP checks these annotations as objects.
def partial_allreduce_hook(state: PartialHookState,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: reduce the bucket with its persistent partial allreduce.

    Posts the bucket's buffer (in place, no copy in the full mode) and returns at once; a
    thread completes the future when the round completes, after scaling the result in
    the bucket, so later buckets are posted while earlier rounds are in flight."""
    buf = bucket.buffer()
    state._backward_at = time.perf_counter()      # the last bucket's: backward ends about now
    if state.iter < state.start_iter:             # before DDP's rebuild: plain allreduce
        state.maybe_increase_iter(bucket)
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        size = state.size if state.average != "none" else 1   # every rank is active
        return fut.then(lambda f: f.value()[0].div_(size))
    entry = state.coll_for(bucket, buf)
    state.maybe_increase_iter(bucket)
    index = bucket.index()
    x, land = buffer_of(buf)
    req = entry.coll.post(x, out=x)

    def finish() -> torch.Tensor:
        res = req.wait()
        if state.shrink.note(entry.coll):
            state.size = state.shrink.size
        settle(res, land, state.average, state.size, entry.coll.divisor, buf.dtype)
        state.last[index] = res
        if state._carry:
            state._apply_carry(entry, buf)
        return buf

    return for_torch(state._completer.submit(finish, [buf.device]))


def partial_ddp(module: torch.nn.Module, mode: str = "full", comm: Optional[MPI.Comm] = None,
                average: str = "world", hook_options: Optional[dict] = None,
                **ddp_options) -> Tuple[torch.nn.parallel.DistributedDataParallel, PartialHookState]:
    """The common case in one call: the ``partialcoll`` process group (if none is set up
    yet), ``DistributedDataParallel(module, **ddp_options)`` and the partial hook over DDP's
    process group::

        ddp, state = partial_ddp(model, mode="solo", late="fold")   # late= goes to the hook
        ...
        state.close()                                               # collective

    Returns (the DDP module, its PartialHookState). mode="full" (the default) is DDP's own
    synchronous averaging. Keyword arguments that PartialAllreduce takes (late,
    max_staleness, seed, ...), model_sync_every, buffer_sync_every, on_failure and on_shrink
    (PartialHookState: training on without a rank that fails) go to the hook; the
    others (process_group, device_ids, bucket_cap_mb, ...) to DistributedDataParallel.

    Buffers (BatchNorm's running statistics): in the full mode DDP broadcasts them from
    rank 0 at every forward, as without partialcoll. In the partial modes that broadcast
    would make every rank wait for rank 0 at every step, so unless you pass
    ``broadcast_buffers``/``forward_sync_buffers``, DDP's is turned off and the hook
    averages the floating buffers through a solo partial round every ``buffer_sync_every``
    iterations (default 1); passing ``broadcast_buffers=True`` (or
    ``forward_sync_buffers=True``, or ``find_unused_parameters=True``) with a partial
    mode warns: those collectives need every rank at every step."""
    hook = dict(hook_options or {})
    for key in _HOOK_OPTIONS:
        if key in ddp_options:
            hook[key] = ddp_options.pop(key)
    has_buffers = any(b.is_floating_point() for b in module.buffers())
    if mode != "full":
        pacing = [k for k in ("broadcast_buffers", "forward_sync_buffers") if ddp_options.get(k) and has_buffers]
        if ddp_options.get("find_unused_parameters"):
            pacing.append("find_unused_parameters")
        if pacing:
            warnings.warn(f"partial_ddp(mode={mode!r}) with {'=True, '.join(pacing)}=True: DDP then runs a "
                          "collective that needs every rank at every step, so the slowest rank paces the others "
                          "and the partial mode gains nothing", UserWarning, stacklevel=2)
        elif has_buffers and "broadcast_buffers" not in ddp_options and "forward_sync_buffers" not in ddp_options:
            ddp_options["forward_sync_buffers"] = False
            hook.setdefault("buffer_sync_every", 1)
    if not dist.is_initialized():
        init_process_group(comm)
    ddp = torch.nn.parallel.DistributedDataParallel(module, **ddp_options)
    state = PartialHookState(mode=mode, comm=comm, average=average, process_group=ddp.process_group, **hook)
    ddp.register_comm_hook(state, partial_allreduce_hook)
    if state.model_sync_every or state.hierarchy or state.buffer_sync_every or state.report_every:
        ddp.register_forward_pre_hook(state.sync_hook)
    return ddp, state
