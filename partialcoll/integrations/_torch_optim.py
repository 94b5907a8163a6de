"""Partial-allreduce gradient averaging without DDP: Horovod's DistributedOptimizer,
and the same machinery driven by hand (GradientSynchronizer).

Parameters are fused into buckets (reverse registration order: roughly the order in
which backward produces their gradients). Each bucket is reduced by one persistent
PartialAllreduce, posted by a post-accumulate-grad hook as soon as backward has
accumulated the bucket's last gradient, while backward goes on with earlier layers.

Whose memory is whose. Each bucket has two flat buffers of its own. The gradients the
user sees (``p.grad``) are never memory the engine is reducing into:

- until ``synchronize()``, ``p.grad`` holds this rank's local gradients. The bucket
  posts a flat buffer that no ``p.grad`` views (their values copied into it, and the
  round runs in it: ``post(x, out=x)``), or, where backward accumulated into views of
  the buffer the user was given last time (``zero_grad(set_to_none=False)``), posts that
  buffer with the other one as ``out=`` (the engine reads it during the post only);
- ``synchronize()`` waits for every round, and the gradients become views of the buffer
  the result landed in, which the engine no longer touches: ``clip_grad_norm_``,
  ``GradScaler.unscale_`` or logging may then read and write them;
- the next backward's post uses the buffers by the same rule.

So the engine reads and writes a buffer only between its post and synchronize(), and
the user's gradients are views of a buffer only after synchronize(). In the full mode a
step costs one pass over the gradients (the copy into the bucket, or the post's copy
into out=), as DDP's does.

Threads: a bucket is posted on the thread that runs its hook (autograd's; for CUDA
gradients its device thread) and waited for in synchronize(), on the caller's thread;
close() runs after those waits (PartialAllreduce: close() refuses while another thread
waits).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import _stats
from .._agree import agree, as_problem
from .._errors import ArgumentError, StateError, as_timeout
from .._partial import PartialAllreduce, PartialRequest, Result, close_all
from .._rc import rc
from .._types import integer
from ..averager import _wait_collective
from ..hierarchical import SpeedGrouping, group_args
from ._torch_horovod import Adasum, Average, Compression, Sum, wire_dtype
from ._torch_common import (ShrinkWatch, buffer_of, check_average, contributor_scale, divisor, fused_divisor, host_copy, host_view,
                            np_dtype, settle, tensor_of, warn_drift)


class _Bucket:
    """Parameters whose gradients are reduced together, through two flat buffers of the
    bucket's own (module docstring: whose memory is whose)."""

    def __init__(self, params: List[torch.nn.Parameter], coll_args: dict, average: str,
                 compression=None, predivide: float = 1.0) -> None:
        self.params = params
        p0 = params[0]
        self.wire = wire_dtype(compression, p0.dtype)     # what the round reduces (Compression.fp16)
        self.predivide = float(predivide)                 # Horovod's gradient_predivide_factor
        self.numel = sum(p.numel() for p in params)
        self.flats: List[Optional[torch.Tensor]] = [None, None]
        self._views: List[Optional[List[torch.Tensor]]] = [None, None]
        self.shown: Optional[int] = None      # the flat whose views are the params' .grad
        self.dst = 0                          # the flat the posted round's result lands in
        size = coll_args.get("comm", MPI.COMM_WORLD).Get_size()
        like = torch.empty(0, dtype=self.wire, device=p0.device)
        self.coll = PartialAllreduce(self.numel, np_dtype(like), MPI.SUM,
                                     divisor=fused_divisor(average, size, like), **coll_args)
        self.pending = 0                  # parameters of this step still to be accumulated
        self.request: Optional[PartialRequest] = None
        self.land: Optional[Callable[[], None]] = None

    def views(self, i: int) -> List[torch.Tensor]:
        """Each parameter's view of flat buffer i (made on first use)."""
        views = self._views[i]
        if views is None:
            p0 = self.params[0]
            flat = self.flats[i] = torch.zeros(self.numel, dtype=self.wire, device=p0.device)
            out, offset = [], 0
            for p in self.params:
                out.append(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            views = self._views[i] = out
        return views

    def post(self) -> None:
        """Post this rank's gradients (a None gradient counts as zeros)."""
        src = self.shown if self.shown is not None else 0
        lend = True                       # may the round run in flat src?
        for p, view in zip(self.params, self.views(src)):
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() == view.data_ptr() and g.shape == view.shape:
                lend = False              # backward accumulated into what the user sees
            else:
                view.copy_(g)
        self.dst = src if lend else 1 - src
        self.views(self.dst)
        flat_src, flat_dst = self.flats[src], self.flats[self.dst]
        assert flat_src is not None and flat_dst is not None      # views() made them
        if self.predivide != 1.0:
            flat_src.div_(self.predivide)
        x, land = buffer_of(flat_src)
        if not lend:
            out, land = buffer_of(flat_dst)
        else:
            out = x
        self.land = land
        self.request = self.coll.post(x, out=out)

    def finish(self, average: str, size: int, watch: Optional[ShrinkWatch] = None) -> Result:
        """Wait for the round; the gradients become views of its result."""
        assert self.request is not None   # post() came first
        res = self.request.wait()
        self.request = None
        if watch is not None and watch.note(self.coll):
            size = watch.size
        settle(res, self.land, average, size, self.coll.divisor, self.wire)
        self.land = None
        if self.predivide != 1.0:
            flat = self.flats[self.dst]
            assert flat is not None
            flat.mul_(self.predivide)
        for p, view in zip(self.params, self.views(self.dst)):
            p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
        self.shown = self.dst
        return res


def _make_buckets(params: List[torch.nn.Parameter], bucket_mb: float, coll_args: dict, average: str,
                  first_bucket_mb: Optional[float] = None, compression=None,
                  predivide: float = 1.0) -> List[_Bucket]:
    """Buckets in reverse registration order (roughly the order backward produces the
    gradients): the first of at most first_bucket_mb (DDP's 1 MiB, so the first round
    starts early in backward), the others of at most bucket_mb; one dtype and device each."""
    groups: List[List[torch.nn.Parameter]] = [[]]
    first = bucket_mb if first_bucket_mb is None else min(first_bucket_mb, bucket_mb)
    limit, size = first * (1 << 20), 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        last = groups[-1]
        if last and (size + nbytes > limit or p.dtype != last[0].dtype or p.device != last[0].device):
            groups.append([])
            size, limit = 0, bucket_mb * (1 << 20)
        groups[-1].append(p)
        size += nbytes
    return [_Bucket(g, coll_args, average, compression, predivide) for g in groups if g]


def _unique_params(params: Iterable[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class GradientSynchronizer:
    """Partial-allreduce gradient averaging for models trained without DDP, by hand:

        sync = GradientSynchronizer(model.parameters(), mode="solo", average="nap")
        loss.backward(); sync.sync(); optimizer.step()

    (``DistributedOptimizer`` does the same while backward runs.)

    hierarchy="auto": RNA's hierarchical synchronization (partialcoll.hierarchical).
    The ranks start as one group; every ``regroup_every`` steps they regroup by their
    measured step times (the compute time between two syncs, waits excluded; RNA's
    rule, ``hysteresis`` points in a row), the buckets' partial allreduces run on the group's communicator, and every
    ``average_every`` steps each group's model is averaged with the other groups' latest
    through an AsyncAverager on ``server``. A regrouping closes the buckets: what their
    final rounds flush is added to the next step's gradients (nothing lost).
    Regrouping points are collective over ``comm`` at the same step on every rank:
    every rank must reach each of them (train the same number of steps, or bound the
    points with ``regroup_points``: group from the first few points, then keep the
    groups). Within a group, every member syncs the same number of steps (averaging is
    collective over the group).

    on_failure="shrink": a rank that fails is left out and the others go on
    (docs/faults.md): averages divide by the survivors from the step it failed in, and
    ``on_shrink(failed_ranks, new_size)`` (ranks of comm) is called once per failure, in
    the sync that first sees it, before the gradients are handed back; the partialcoll
    default process group, if one is set up, then refuses later calls (StateError). Not
    with hierarchy=.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], mode: str = "full",
                 comm: MPI.Comm = MPI.COMM_WORLD, average: str = "world", bucket_mb: float = 25.0,
                 model_sync_every: Optional[int] = None, first_bucket_mb: Optional[float] = None,
                 hierarchy: Optional[str] = None, average_every: Optional[int] = None, regroup_every: int = 20,
                 server: int = 0, window: int = 8, hysteresis: int = 2, regroup_points: Optional[int] = None,
                 compression=None, gradient_predivide_factor: float = 1.0, on_failure: Optional[str] = None,
                 on_shrink: Optional[Callable[[Tuple[int, ...], int], None]] = None, **options) -> None:
        self.params = _unique_params(params)
        self.shrink = ShrinkWatch(on_failure, on_shrink, comm.Get_size(),
                                  dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)

        if self.params:
            wire_dtype(compression, self.params[0].dtype)            # checked before anything collective
        self._compression = compression
        self._predivide = float(gradient_predivide_factor)
        self.comm, self.average = comm, check_average(average)
        self.steps = 0
        self.last: List[Result] = []
        self.grouping: Optional[SpeedGrouping] = None
        self._carry: Optional[List[torch.Tensor]] = None
        self._t_last: Optional[float] = None
        self._bucket_args = (bucket_mb, dict(mode=mode, **options, **self.shrink.coll_args()), first_bucket_mb)
        warn_drift(mode, options.get("late", "latest"), model_sync_every, options.get("max_staleness"))
        self.hierarchy, self.average_every, self.every = self._agreed_options(
            comm, hierarchy, average_every, regroup_every, server, window, hysteresis, regroup_points, model_sync_every)
        if self.hierarchy and on_failure == "shrink":
            raise ArgumentError("on_failure='shrink' with hierarchy=: the speed groups are not rebuilt after a "
                                "failure; leave one of them out")
        # made before the buckets (collective over comm): every rank that takes part at all has it
        self.model_sync = ModelSync(self.params, comm, **self.shrink.coll_args()) if self.every else None
        if self.hierarchy:
            self.grouping = SpeedGrouping(comm, server=server, window=window, hysteresis=hysteresis,
                                          regroup_every=regroup_every, regroup_points=regroup_points)
            self._flat_dtype = start_averaging(self.grouping, self.params)
        self._build(self.grouping.group_comm if self.grouping else comm)

    @staticmethod
    def _agreed_options(comm, hierarchy, average_every, regroup_every, server, window, hysteresis, points,
                        model_sync_every):
        """The hierarchy options and model_sync_every, checked and agreed across ranks (an
        error on every rank); returns (hierarchy, average_every, model_sync_every or None)."""
        problem = params = None
        try:
            every = integer(model_sync_every, "model_sync_every", 1) if model_sync_every else None
            if hierarchy not in (None, "auto"):
                raise ArgumentError(f"hierarchy must be None or 'auto', not {hierarchy!r}")
            if average_every is not None:
                if hierarchy is None:
                    raise ArgumentError("average_every= averages the groups' models: it needs hierarchy='auto'")
                average_every = integer(average_every, "average_every", 1)
            integer(regroup_every, "regroup_every", 1)
            integer(window, "window", 1)
            integer(hysteresis, "hysteresis", 1)
            if points is not None:
                integer(points, "regroup_points", 0)
            if not 0 <= integer(server, "server", 0) < comm.Get_size():
                raise ArgumentError(f"server {server} is outside the communicator (size {comm.Get_size()})")
            params = {"hierarchy": hierarchy, "average_every": average_every, "regroup_every": regroup_every,
                      "server": server, "window": window, "hysteresis": hysteresis, "regroup_points": points,
                      "model_sync_every": every}
        except Exception as exc:         # noqa: BLE001 - reported on every rank below
            problem = as_problem(exc, "options")
        agree(comm, "options", problem, params, what="the same hierarchy options and model_sync_every")
        assert params is not None
        return hierarchy, (average_every or 10) if hierarchy else None, params["model_sync_every"]

    def _build(self, comm: MPI.Comm) -> None:
        """The buckets, their partial allreduces over comm (collective over comm)."""
        bucket_mb, args, first = self._bucket_args
        self.size = comm.Get_size()
        args = group_args(args, comm, self.comm)     # comm: a speed group's, with hierarchy="auto"
        self.buckets = _make_buckets(self.params, bucket_mb, dict(comm=comm, **args), self.average, first,
                                     self._compression, self._predivide)
        for b in self.buckets:
            self.shrink.watch(b.coll, self.average)

    @property
    def colls(self) -> List[PartialAllreduce]:
        return [b.coll for b in self.buckets]

    def stats(self) -> _stats.Stats:
        """Who is slow over the buckets' collectives (docs/who-is-slow.md; collective)."""
        return _stats.merge([c.stats() for c in _stats.ordered(self.colls)], "the synchronizer's buckets")

    def in_flight(self) -> bool:
        return any(b.request is not None for b in self.buckets)

    def _post_unposted(self) -> None:
        for b in self.buckets:
            if b.request is None:
                b.post()

    def _finish_all(self) -> List[Result]:
        entered = time.perf_counter()    # this step's compute ended: its rounds are posted
        self.last = [b.finish(self.average, self.size, self.shrink) for b in self.buckets]
        if self.shrink.failed:
            self.size = self.shrink.size
        if self._carry is not None:      # what a regrouping flushed joins this step's gradients
            for b, carry in zip(self.buckets, self._carry):
                flat = b.flats[b.dst]
                assert flat is not None          # finish() made the views of flat dst
                flat.add_(carry.to(flat.device))
            self._carry = None
        self.steps += 1
        if self.grouping is not None:
            self._hierarchy_step(self.grouping, entered)
        if self.model_sync is not None and self.steps % self.every == 0:
            self.model_sync.sync()
        return self.last

    def _hierarchy_step(self, grouping: SpeedGrouping, entered: float) -> None:
        """After a step's gradients: note its compute time (from the end of the previous
        sync to the start of this one: RNA groups by how fast a rank computes, not by how
        long it waits for others), average the groups' models every average_every steps,
        regroup at a point where a new grouping is due."""
        if self._t_last is not None:
            grouping.note(max(entered - self._t_last, 1e-9))
        if self.average_every and self.steps % self.average_every == 0:
            average_models(grouping, self.params, self._flat_dtype)
        if grouping.point(self.steps) and grouping.decide():
            self._regroup(grouping)
        self._t_last = time.perf_counter()

    def _regroup(self, grouping: SpeedGrouping) -> None:
        """Collective over comm: close the buckets (their flush becomes the next step's
        carry), adopt the new grouping, build the buckets on the new group."""
        carry = []
        for b, res in zip(self.buckets, close_all([b.coll for b in self.buckets])):
            data = tensor_of(np.array(res.data, copy=True), b.params[0].dtype).to(b.params[0].dtype)
            d = divisor(res, self.average, self.size, b.coll.divisor) if res.rounds else 1
            carry.append(data / d if d != 1 else data)
        self._carry = carry
        grouping.adopt(grouping.proposed)
        grouping.regroupings += 1
        self._build(grouping.group_comm)

    @property
    def last_model_sync(self) -> Optional[Result]:
        """The latest model_sync_every average's Result (posts: how many ranks' models it
        averaged), None before the first."""
        return self.model_sync.last if self.model_sync is not None else None

    def lr_scale(self) -> float:
        """RNA's linear scaling: the contributors of the latest step (each bucket's NAP per
        round, averaged over the buckets whose results hold data) over the ranks that
        could contribute; 1.0 where no result holds data."""
        return contributor_scale(self.last, self.size)

    def sync(self) -> List[Result]:
        """Post every bucket; the gradients become the averaged round results."""
        self._post_unposted()
        return self._finish_all()

    def close(self) -> List[Result]:
        """Collective: flush the accumulators (gradients not yet applied anywhere)."""
        for b in self.buckets:
            if b.request is not None:
                b.request.wait()
                b.request = None
        out = close_with([b.coll for b in self.buckets], self.model_sync)
        self.buckets = []
        if self.grouping is not None:
            self.grouping.free()
            self.grouping = None
        return out


def _average_of(op, average: Optional[str], predivide: float) -> str:
    """DistributedOptimizer's average= from Horovod's op= (Average: "world", Sum: "none";
    None: Average, or what average= says), checked: an explicit average= must agree with
    an explicit op; gradient_predivide_factor needs op=Average (as Horovod)."""
    if op is None:
        op = Sum if average == "none" else Average
    elif average is not None and (op == Sum) != (average == "none"):
        raise ArgumentError(f"op={op!r} and average={average!r} disagree (op=Sum is average='none')")
    if op == Adasum:
        raise ArgumentError("op=Adasum is not offered by partialcoll: use op=Average or op=Sum")
    if op not in (Average, Sum):
        raise ArgumentError(f"op must be Average or Sum, not {op!r}")
    if predivide != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if float(predivide) <= 0:
        raise ArgumentError(f"gradient_predivide_factor must be positive, not {predivide!r}")
    if average is None:
        return "world" if op == Average else "none"
    return check_average(average)


def _checked_named(optimizer: torch.optim.Optimizer, named_parameters) -> List[torch.nn.Parameter]:
    """The parameters to reduce, in order: named_parameters' (checked as Horovod checks
    them: (name, parameter) tuples, unique names, every parameter of the optimizer named),
    else the optimizer's param groups'."""
    in_groups = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return in_groups
    named = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    seen, dups = set(), []
    for k, _ in named:
        if k in seen and k not in dups:
            dups.append(k)
        seen.add(k)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s" % ", ".join(dups))
    named_ids = {id(p) for _, p in named}
    unnamed = [p for p in in_groups if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named "
                         f"({len(unnamed)} of the optimizer's {len(in_groups)}, shapes "
                         f"{', '.join(str(tuple(p.shape)) for p in unnamed[:4])}): their gradients would not be "
                         "averaged and the ranks' models would drift apart")
    return [p for _, p in named]


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer instance (Horovod's DistributedOptimizer contract): gradients
    are averaged by partial allreduces, each bucket posted while backward runs::

        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        # the default, mode="full", averages every step as Horovod does; a partial mode:
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode="solo", late="fold")
        loss.backward(); opt.step()              # step() synchronizes, then steps
        ...
        loss.backward()
        opt.synchronize()                        # the averaged gradients, in p.grad
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        opt.close()                              # collective: flush the accumulators

    The wrapped optimizer is kept as it is (``opt.optimizer``): its ``state``,
    ``param_groups``, ``defaults``, ``state_dict()`` and ``load_state_dict()`` are the
    wrapper's, so learning-rate schedulers made on either keep working, whatever its
    constructor took. With ``torch.amp.GradScaler``: ``scaler.scale(loss).backward();
    opt.synchronize(); scaler.unscale_(opt); clip...; with opt.skip_synchronize():
    scaler.step(opt)``. Every rank must wrap the same parameters in the same order.
    ``opt.last`` holds the latest step's Results.

    Horovod's arguments, in Horovod's order: ``named_parameters`` (checked: a ValueError
    where names repeat or some of the optimizer's parameters are not named),
    ``compression`` (Compression.none, or Compression.fp16: gradients reduced in float16,
    given back in their dtype), ``backward_passes_per_step``, ``op`` (Average, the default, or
    Sum: average="none"), ``gradient_predivide_factor`` (gradients divided by it before the
    sum and multiplied by it after, op=Average only); ``num_groups``, ``groups``,
    ``sparse_as_dense`` and ``process_set`` are refused with the option to use instead.
    partialcoll's options are keyword-only: ``mode`` (default "full"), ``late``,
    ``average``, ``model_sync_every``, ...; those a call does not pass come from
    ``pc.rc.torch`` (environment ``PARTIALCOLL_TORCH="mode=solo,late=fold"``), so a
    launcher picks a partial mode for a Horovod script as it is. A partial mode with late="latest" and no
    model_sync_every warns once (the models drift). The object is an instance of the
    wrapped optimizer's class too (``isinstance(opt, torch.optim.SGD)``), as Horovod's.

    RNA's options: ``hierarchy="auto"`` with ``average_every=k`` (and ``regroup_every``,
    ``server``, ``window``, ``hysteresis``): hierarchical synchronization, see
    GradientSynchronizer. ``lr_scaling="contributors"``: each step runs with the
    learning rate times the share of ranks whose gradients the step's rounds hold (NAP
    per round over the group's size; RNA's linear scaling rule, best with average="nap"),
    the base rate restored after the step.
    """

    _classes: Dict[type, type] = {}

    def __new__(cls, optimizer=None, *args, **kwargs):
        # as Horovod: the wrapper is an instance of the wrapped optimizer's class (a subclass
        # made once per class, DistributedOptimizer's methods first), so isinstance(opt,
        # torch.optim.SGD) holds; the wrapped instance still does the work (self._optim)
        base = type(optimizer)
        if cls is DistributedOptimizer and isinstance(optimizer, torch.optim.Optimizer) \
                and base is not torch.optim.Optimizer and not issubclass(base, DistributedOptimizer):
            sub = DistributedOptimizer._classes.get(base)
            if sub is None:
                sub = type(f"Distributed{base.__name__}", (DistributedOptimizer, base), {"__module__": __name__})
                DistributedOptimizer._classes[base] = sub
            cls = sub
        return object.__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step: int = 1, op=None, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups=None, sparse_as_dense: bool = False, process_set=None, *,
                 mode: Optional[str] = None, comm: MPI.Comm = MPI.COMM_WORLD, average: Optional[str] = None,
                 bucket_mb: float = 25.0, model_sync_every: Optional[int] = None,
                 first_bucket_mb: Optional[float] = 1.0, lr_scaling: Optional[str] = None, **options) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ArgumentError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        # the launcher's choice (pc.rc.torch, PARTIALCOLL_TORCH) where the call passes nothing
        launcher = dict(rc.torch)
        mode = mode if mode is not None else launcher.pop("mode", "full")
        average = average if average is not None else launcher.pop("average", None)
        model_sync_every = model_sync_every if model_sync_every is not None else launcher.pop("model_sync_every", None)
        lr_scaling = lr_scaling if lr_scaling is not None else launcher.pop("lr_scaling", None)
        for key in ("mode", "average", "model_sync_every", "lr_scaling"):
            launcher.pop(key, None)
        options = {**launcher, **options}
        if lr_scaling not in (None, "contributors"):
            raise ArgumentError(f"lr_scaling must be None or 'contributors', not {lr_scaling!r}")
        average = _average_of(op, average, gradient_predivide_factor)
        if num_groups or groups is not None:
            raise ArgumentError("num_groups= and groups= are Horovod's tensor fusion: partialcoll fuses gradients "
                                "into buckets of bucket_mb MiB (the first of first_bucket_mb)")
        if sparse_as_dense:
            raise ArgumentError("sparse_as_dense=True: sparse gradients are not reduced by partialcoll; make the "
                                "embedding dense (sparse=False)")
        if process_set is not None:
            raise ArgumentError("process_set= is Horovod's; pass comm= (an MPI communicator of the processes)")
        self._optim = optimizer
        self._lr_scaling = lr_scaling
        params = _checked_named(optimizer, named_parameters)
        self._sync = GradientSynchronizer(params, mode=mode, comm=comm, average=average, bucket_mb=bucket_mb,
                                          model_sync_every=model_sync_every, first_bucket_mb=first_bucket_mb,
                                          compression=compression,
                                          gradient_predivide_factor=gradient_predivide_factor, **options)
        self._passes = max(1, int(backward_passes_per_step))
        self._counts: Dict[int, int] = {}
        self._synchronized = False        # synchronize() ran, and no gradient arrived since
        self._skip = False                # inside skip_synchronize()
        where = {}
        for i, b in enumerate(self._sync.buckets):
            for p in b.params:
                where[id(p)] = i          # the bucket's index: a regrouping rebuilds the buckets alike
            b.pending = len(b.params)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_of(where[id(p)]))
                         for p in self._sync.params]

    # -- the wrapped optimizer ------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optim

    param_groups = property(lambda self: self._optim.param_groups,
                            lambda self, v: setattr(self._optim, "param_groups", v))
    state = property(lambda self: self._optim.state, lambda self, v: setattr(self._optim, "state", v))
    defaults = property(lambda self: self._optim.defaults, lambda self, v: setattr(self._optim, "defaults", v))

    # GradScaler.step hands a fused optimizer its scale and inf flags as these two
    # attributes (and deletes them after the step): they are the wrapped optimizer's
    grad_scale = property(lambda self: self._optim.grad_scale,
                          lambda self, v: setattr(self._optim, "grad_scale", v),
                          lambda self: delattr(self._optim, "grad_scale"))
    found_inf = property(lambda self: self._optim.found_inf,
                         lambda self, v: setattr(self._optim, "found_inf", v),
                         lambda self: delattr(self._optim, "found_inf"))

    def __getattr__(self, name: str):
        optim = self.__dict__.get("_optim")
        if optim is None:
            raise AttributeError(name)
        return getattr(optim, name)

    def state_dict(self) -> dict:
        return self._optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._optim.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise ArgumentError("DistributedOptimizer reduces the parameters it was made with (its buckets are made "
                            "collectively): add every param group before wrapping the optimizer")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optim!r})"

    # -- gradients --------------------------------------------------------------------------
    def _hook_of(self, index: int):
        def hook(p: torch.Tensor) -> None:
            bucket = self._sync.buckets[index]
            self._synchronized = False
            n = self._counts.get(id(p), 0) + 1
            self._counts[id(p)] = n
            if n < self._passes:
                return
            if n > self._passes or bucket.request is not None:
                raise StateError("gradients were computed more than backward_passes_per_step times before "
                                 "step() or synchronize(): raise backward_passes_per_step to accumulate "
                                 "gradients locally")
            bucket.pending -= 1
            if bucket.pending == 0:      # the bucket's last gradient: post it now
                bucket.post()
        return hook

    def synchronize(self) -> List[Result]:
        """Wait for every bucket's round (posting those backward did not reach) and make
        the averaged gradients the parameters' .grad. Until the next backward, a second
        call returns the same results and posts nothing."""
        sync = self._sync
        if self._synchronized:
            return sync.last
        sync._post_unposted()
        res = sync._finish_all()
        for b in sync.buckets:
            b.pending = len(b.params)
        self._counts.clear()
        self._synchronized = True
        return res

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``with opt.skip_synchronize(): opt.step()`` steps without synchronizing (after an
        explicit synchronize())."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None, **kwargs):
        if closure is not None:
            raise ArgumentError("DistributedOptimizer.step(closure): the closure's backward would run inside "
                                "the step, after the gradients were averaged; call backward and step apart")
        if not self._skip:
            self.synchronize()
        elif self._sync.in_flight():
            raise StateError("step() inside skip_synchronize() while gradients are still being averaged: "
                             "call synchronize() first")
        scaled = []
        if self._lr_scaling == "contributors":
            # RNA's linear scaling rule: lr times the share of ranks that contributed; the
            # base rate is restored after the step (schedulers keep setting it)
            scale = self._sync.lr_scale()
            for group in self._optim.param_groups:
                scaled.append((group, group["lr"]))
                group["lr"] = group["lr"] * scale
        try:
            return self._optim.step(**kwargs)
        finally:
            for group, lr in scaled:
                group["lr"] = lr
            self._synchronized = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._sync.in_flight():
            raise StateError("zero_grad() after backward() but before step() or synchronize(): the gradients "
                             "of this step are still being averaged")
        self._optim.zero_grad(set_to_none=set_to_none)

    def close(self) -> List[Result]:
        """Collective: flush the accumulators; removes the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
        return self._sync.close()

    @property
    def last(self) -> List[Result]:
        return self._sync.last

    @property
    def last_model_sync(self) -> Optional[Result]:
        """The latest model_sync_every average's Result (GradientSynchronizer's)."""
        return self._sync.last_model_sync

    def stats(self) -> _stats.Stats:
        """Who is slow over the gradients' collectives (GradientSynchronizer's; collective)."""
        return self._sync.stats()


def start_averaging(grouping: SpeedGrouping, params: Sequence[torch.Tensor]) -> np.dtype:
    """Collective over the grouping's comm: its averager for the parameters, flattened in
    their dtype (float64 where they differ or are not floating); returns that dtype."""
    dtype = np_dtype(params[0]) if len({p.dtype for p in params}) == 1 and params[0].is_floating_point() \
        else np.dtype(np.float64)
    grouping.averaging(sum(p.numel() for p in params), dtype)
    return dtype


def average_models(grouping: SpeedGrouping, params: Sequence[torch.Tensor], dtype: np.dtype) -> None:
    """Collective over the group: the parameters become the mean of every group's latest
    (RNA's asynchronous averaging through the grouping's AsyncAverager)."""
    wide = dtype == np.float64           # mixed dtypes: averaged in float64
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).cpu().to(torch.float64 if wide else p.dtype) for p in params])
        mean = grouping.average(host_view(flat.contiguous()))
        off = 0
        for p in params:
            p.copy_(tensor_of(mean[off:off + p.numel()], None if wide else p.dtype).reshape(p.shape))
            off += p.numel()


class ModelSync:
    """``model_sync_every``'s averaging of the parameters, on a persistent allreduce of
    partialcoll's in the full mode (collective to make over comm; float16, bfloat16 and
    mixed dtypes averaged in float64, complex in complex128 where mixed).

    As for the gradients' collectives, a rank that is done calls close(), and from then on
    the other ranks' syncs complete without it: each sync gives the ranks that took part
    the mean of their parameters (the round's sum over ``Result.posts``, the number of
    ranks inside it), so ranks may take different numbers of steps (sync_parameters
    needs every rank at every sync). ``last`` is the latest sync's Result. It keeps a flat
    host copy of the parameters (in the averaging dtype) between syncs.

    Whose memory is whose: the flat host buffer is this object's; the engine reads and
    writes it from sync()'s post to its wait, on the thread that calls sync()."""

    def __init__(self, params: Sequence[torch.Tensor], comm: MPI.Comm, **options) -> None:
        self.params = list(params)
        dtypes = {p.dtype for p in self.params}
        exact = (torch.float32, torch.float64, torch.complex64, torch.complex128)
        if len(dtypes) == 1 and next(iter(dtypes)) in exact:
            wide = next(iter(dtypes))
        else:
            wide = torch.complex128 if any(d.is_complex for d in dtypes) else torch.float64
        self.flat = torch.empty(sum(p.numel() for p in self.params), dtype=wide)
        # options: another mode (partial_ddp's buffers: solo); full by default
        self.coll = PartialAllreduce(self.flat.numel(), np_dtype(self.flat), MPI.SUM, comm,
                                     **{"mode": "full", **options})
        self.last: Optional[Result] = None

    def sync(self) -> Result:
        """Collective over the ranks not closed: the parameters become their mean."""
        flat, off = self.flat, 0
        with torch.no_grad():
            for p in self.params:
                flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                off += p.numel()
            x = host_view(flat)
            res = self.coll.post(x, out=x).wait()
            if res.posts > 1:
                flat /= res.posts
            off = 0
            for p in self.params if res.posts else ():      # a round that holds nobody's: as they were
                mean = flat[off:off + p.numel()].view_as(p)
                p.copy_(mean.real if mean.is_complex() and not p.is_complex() else mean)
                off += p.numel()
        self.last = res
        return res


def close_with(colls: List[PartialAllreduce], model_sync: Optional[ModelSync],
               more: Sequence[PartialAllreduce] = ()) -> List[Result]:
    """Collective: close colls, model_sync's collective and more together (close_all);
    returns the results of colls."""
    extra = ([model_sync.coll] if model_sync is not None else []) + list(more)
    return close_all(colls + extra)[:len(colls)]


def sync_parameters(params, comm: MPI.Comm = MPI.COMM_WORLD, how: str = "average",
                    timeout: Optional[float] = None, root: int = 0) -> None:
    """Make every rank's parameters identical: their average, or root's (how="broadcast").

    params: tensors (``model.parameters()``), (name, tensor) pairs
    (``model.named_parameters()``) or a dict of them (``model.state_dict()``: buffers and
    0-d tensors such as BatchNorm's num_batches_tracked included, in the dict's order).

    Collective over comm, every rank with the same parameters in the same order: one
    nonblocking allreduce (or broadcast) per parameter, in place (float16 and bfloat16
    averaged in float64), each waited for under the engine's idle policy, so a rank that
    waits spins no core for long. A rank that does not
    reach it makes the others raise Timeout after `timeout` seconds (None:
    partialcoll.rc.timeout), instead of blocking in MPI for ever, and a rank the MPI
    reports as failed MPIError; comm then has a collective in flight, which a late
    rank's call completes."""
    if how not in ("average", "broadcast"):
        raise ArgumentError(f"how must be 'average' or 'broadcast', not {how!r}")
    timeout = as_timeout(timeout, "sync_parameters' timeout") if timeout is not None else None
    if not 0 <= integer(root, "root", 0) < comm.Get_size():
        raise ArgumentError(f"root {root} is outside the communicator (size {comm.Get_size()})")
    items = params.values() if isinstance(params, dict) else params
    params = [p[1] if isinstance(p, tuple) else p for p in items]
    wrong = sorted({type(p).__name__ for p in params if not isinstance(p, torch.Tensor)})
    if wrong:
        raise ArgumentError(f"sync_parameters takes tensors, (name, tensor) pairs or a dict of tensors, not "
                            f"{', '.join(wrong)}")
    odd = sorted({str(p.dtype) for p in params if not (p.dtype.is_floating_point or p.dtype.is_complex)})
    if how == "average" and odd:
        raise ArgumentError(f"how='average' needs floating-point parameters, not {', '.join(odd)} "
                            "(how='broadcast' copies rank 0's)")
    what = f"sync_parameters' {'allreduce' if how == 'average' else 'broadcast'}"
    with torch.no_grad():
        for p in params:
            host, land = host_copy(p.detach(), write_back=True)
            wide = host.double() if how == "average" and host.dtype in (torch.float16, torch.bfloat16) else host
            arr = host_view(wide.reshape(-1))             # a 0-d tensor as one element
            if how == "average":
                req = comm.Iallreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
            else:
                arr = arr.view(np.uint8)
                req = comm.Ibcast(arr, root=root)
            _wait_collective(req, what, timeout, keep=(wide, arr), comm=comm, nbytes=arr.nbytes)
            if how == "average":
                wide /= comm.size
                if wide is not host:
                    host.copy_(wide)
            if land is not None:
                land()
