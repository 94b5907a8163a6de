"""What the torch integrations share: tensors as library buffers, device tensors staged
through the host, a thread that completes torch futures, and the averaging of a round.

Buffers. A contiguous CPU tensor reaches the library as a NumPy view of its memory
(``Tensor.numpy()`` shares it; bfloat16 through a 16-bit view, see ``_types.BFLOAT16``).
A CUDA tensor reaches it as a CuPy view (DLPack, no copy) where CuPy can use the GPU:
the library then stages it through pinned host memory itself (``_device.py``); without
CuPy (and for bfloat16, which CuPy lacks) it is copied into pinned host memory here and
the result copied back after the wait (``buffer_of``). MPI calls of the process group
take host memory: ``host_copy`` stages a device tensor for them.

Which tensors take the device path is ``DEVICE_TYPES``: tests add "cpu" to run the
device path on machines without a GPU (tests/mpi/torch_checks.py, PC_TEST_TORCH_DEVICE).

Threads. ``Completer`` is one thread that waits for rounds in the order they were
posted and completes their futures; it owns those waits. A collective whose requests
it waits for is closed only by a job on the same thread, or after ``stop()`` has
joined it (PartialAllreduce: close() refuses to run while another thread waits).
"""
from __future__ import annotations

import queue
import threading
import warnings
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import torch

from .. import _device
from .._errors import ArgumentError, InvalidBufferError
from .._partial import Result
from .._types import BFLOAT16

AVERAGES = ("world", "nap", "none")
DEVICE_TYPES = ["cuda"]          # tensors of these device types take the device path


def check_average(average: str) -> str:
    if average not in AVERAGES:
        raise ArgumentError(f"average must be one of {AVERAGES}, not {average!r}")
    return average


def np_dtype(t: torch.Tensor) -> np.dtype:
    """The NumPy dtype the library uses for a tensor's dtype (bfloat16: _types.BFLOAT16)."""
    if t.dtype == torch.bfloat16:
        return BFLOAT16
    if t.dtype.is_complex or t.dtype.is_floating_point or t.dtype in _INTS:
        return np.dtype(str(t.dtype).replace("torch.", ""))
    raise InvalidBufferError(f"tensors of dtype {t.dtype} cannot be reduced by partialcoll")


_INTS = (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def on_device(t: torch.Tensor) -> bool:
    """Whether t takes the device path (a CUDA tensor; see DEVICE_TYPES)."""
    return t.device.type in DEVICE_TYPES


def host_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing the memory of a contiguous CPU tensor (no copy)."""
    t = t.detach()
    if not t.is_contiguous():
        raise InvalidBufferError("the tensor must be contiguous")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def host_copy(t: torch.Tensor, write_back: bool) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
    """(a contiguous host tensor with t's values, what copies it back into t or None).

    A contiguous host tensor is itself (nothing to copy back). A device tensor is copied
    into pinned host memory (the copy waits for the work queued on the current stream);
    a non-contiguous one into a contiguous copy."""
    if not on_device(t) and t.is_contiguous():
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    host.copy_(t.detach())

    def back() -> None:
        t.copy_(host)
    return host, (back if write_back else None)


def tensor_of(data, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A tensor sharing a result's memory (NumPy; CuPy through DLPack); bfloat16 results
    come back as bfloat16 tensors."""
    if not isinstance(data, np.ndarray):
        return torch.from_dlpack(data)
    if data.dtype.itemsize == 2 and data.dtype.kind not in "fiu" or dtype == torch.bfloat16:
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(data)


def gpu_usable() -> bool:
    try:
        _device.cupy_backend()
        return True
    except InvalidBufferError:
        return False


def buffer_of(t: torch.Tensor) -> Tuple[object, Optional[Callable[[], None]]]:
    """(what to post as x and out=, what to run after the wait to land the result in t).

    Host: a NumPy view (nothing to run). Device: a CuPy view where CuPy can use the GPU
    (the library stages it), else a pinned host copy that is copied back after the wait."""
    if not on_device(t):
        return host_view(t), None
    if t.dtype != torch.bfloat16 and gpu_usable():
        return _device.cupy_backend().adopt(t.detach()), None
    host, land = host_copy(t, write_back=True)
    return host_view(host), land


def fused_divisor(average: str, size: int, t: torch.Tensor) -> float:
    """The divisor the collective applies itself, in the reduction that makes the sum
    (PartialAllreduce(divisor=)): P for average="world" on a real floating tensor, which
    saves a pass over the bucket; 1.0 (none) where divisor() is applied after the round."""
    return float(size) if average == "world" and t.is_floating_point() else 1.0


def divisor(res: Result, average: str, size: int, fused: float = 1.0) -> int:
    """What a round's sum is still divided by: P (eager-SGD), the number of posts inside
    it (RNA's average: res.posts, so sum / posts is the exact mean of what it holds) or 1;
    1 where the collective divided it already (fused: its divisor)."""
    if fused != 1.0:
        return 1
    if average == "world":
        return size
    if average == "nap":
        return max(res.posts, 1)
    return 1


def settle(res: Result, land: Optional[Callable[[], None]], average: str, size: int, fused: float,
           dtype: torch.dtype) -> None:
    """Scale a round's result where it lies (res.data: a view of the bucket, or of its
    staging copy), then land it in the bucket (buffer_of's land, if any)."""
    d = divisor(res, average, size, fused)
    if d != 1:
        tensor_of(res.data, dtype).div_(d)
    if land is not None:
        land()


def for_torch(fut: torch.futures.Future) -> torch.futures.Future:
    """fut as torch's C++ side must be handed it (DDP's reducer, from a comm hook or from
    a process group's Work): a future that fails there fails as an error.

    A Python future's set_exception() stores the exception as the future's value and
    raises it only where Python reads it; C++ reads the exception object as the result
    (DDP's default hook then took a tensor from it that is not there and crashed the
    process; a Python hook's result failed with "Unable to cast ... to Tensor"). A
    then() callback that raises marks its future failed in C++: backward() raises a
    RuntimeError with the exception's type and message."""
    return fut.then(_value)


def _value(fut: torch.futures.Future):
    return fut.value()


def future(devices: Optional[List[torch.device]] = None) -> torch.futures.Future:
    """A torch future for values on `devices` (CUDA tensors need theirs named: the future
    then records an event on the current stream when it completes, and its waiters
    synchronize with it)."""
    cuda: List[Union[int, str, torch.device]] = [d for d in devices or () if d.type == "cuda"]
    return torch.futures.Future(devices=cuda) if cuda else torch.futures.Future()


class Completer:
    """One daemon thread that runs jobs in submission order and completes their futures.

    A job waits for a round (the engine's wait releases the GIL, so backward goes on in
    the meantime) and returns the future's value. Rounds are waited for in the order
    they were posted, which is the order DDP and the optimizer wrapper wait for them.
    The thread owns the waits it runs: a job submitted after them (``submit``) runs once
    they are over, which is how a collective they wait on is closed (``later``).
    ``abort`` fails the futures not yet completed, at once, without waiting.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._pending: set = set()          # futures submitted and not completed (under _lock)

    def submit(self, job: Callable[[], object], devices: Optional[List[torch.device]] = None
               ) -> torch.futures.Future:
        fut = future(devices)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._pending.add(fut)
            self._jobs.put((job, fut))
        return fut

    def later(self, job: Callable[[], object]) -> None:
        """Run job on the thread after every job submitted so far (its result is dropped)."""
        self.submit(job)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            try:
                value = job()
            except BaseException as exc:      # noqa: BLE001 - handed to the waiter
                self._complete(fut, exc, failed=True)
            else:
                self._complete(fut, value, failed=False)

    def _complete(self, fut: torch.futures.Future, value, failed: bool) -> None:
        with self._lock:
            if fut not in self._pending:     # aborted meanwhile
                return
            self._pending.discard(fut)
        if failed:
            fut.set_exception(value)
        else:
            fut.set_result(value)

    def stop(self) -> None:
        """Finish the jobs already submitted, then end the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None:
            thread.join()

    def abort(self, exc: BaseException, last: Optional[Callable[[], None]] = None) -> None:
        """Fail every future not completed yet with exc, now; the thread runs the jobs it
        has (their results dropped), then `last`, then ends. Never blocks."""
        with self._lock:
            pending, self._pending = self._pending, set()
            thread, self._thread = self._thread, None
            if thread is not None:
                if last is not None:
                    self._jobs.put((last, future()))
                self._jobs.put(None)
        for fut in pending:
            fut.set_exception(exc)
        if thread is None and last is not None:
            last()


class ShrinkWatch:
    """on_failure="shrink" in the torch integrations: the survivors' count and the user's
    callback after a rank fails.

    Every collective of the integration shrinks by itself, in the wait that sees the
    failure (_shrink.py); ``watch(coll)`` makes a fused average="world" divisor the
    survivors' count on its rebuild (a round re-run among the survivors divides by
    them; a round that completed before the death keeps the old divisor: its sum holds
    the dead rank's gradient too). ``note(coll)``, after each of their waits, on one
    thread: the first collective that shows new failed ranks sets ``size``, refuses the
    partialcoll process group's later calls (its communicator still counts the dead
    rank) and calls ``on_shrink(failed_ranks, new_size)`` once per failure: the ranks
    that failed (the process group's numbering), the survivors' count."""

    def __init__(self, on_failure: Optional[str], on_shrink: Optional[Callable[[Tuple[int, ...], int], None]],
                 size: int, process_group=None) -> None:
        if on_shrink is not None and on_failure != "shrink":
            raise ArgumentError("on_shrink= is called after a shrink: pass on_failure='shrink' with it")
        if on_shrink is not None and not callable(on_shrink):
            raise ArgumentError(f"on_shrink must be callable(failed_ranks, new_size), not {on_shrink!r}")
        self.on_failure, self.on_shrink, self.size, self.pg = on_failure, on_shrink, size, process_group
        self.failed: Tuple[int, ...] = ()

    def coll_args(self) -> dict:
        return {} if self.on_failure is None else {"on_failure": self.on_failure}

    def watch(self, coll, average: str) -> None:
        if average == "world" and coll.divisor != 1.0:
            coll.on_rebuild = _survivors_divide

    def note(self, coll) -> bool:
        """Whether coll shows ranks failed that no collective showed before."""
        failed = coll.failed
        if len(failed) <= len(self.failed):
            return False
        new = tuple(r for r in failed if r not in self.failed)
        self.failed, self.size = failed, coll.size
        if self.pg is not None and hasattr(self.pg, "_unusable"):
            self.pg._unusable = (f"rank(s) {new} failed and the others went on without them (on_failure='shrink'); "
                                 f"its communicator still counts them")
        if self.on_shrink is not None:
            self.on_shrink(new, self.size)
        return True


def _survivors_divide(coll) -> None:
    coll.divisor = float(coll.size)


def contributor_scale(results, size: int) -> float:
    """RNA's linear scaling rule: the contributors of a step's results (each NAP per
    round, averaged over the results that hold data) over the ranks that could
    contribute; 1.0 where no result holds data."""
    naps = [r.nap / max(r.rounds, 1) for r in results if r.nap > 0]
    if not naps:
        return 1.0
    return min(1.0, sum(naps) / len(naps) / size)


_warned_drift = False


def warn_drift(mode: str, late: str, model_sync_every, max_staleness=None) -> None:
    """Warn once per process where a partial mode is set up to let the models drift apart
    for good: a mode other than full with late="latest" (a late rank never applies the
    rounds it missed) and no model_sync_every to bring the models back together."""
    global _warned_drift
    if _warned_drift or mode == "full" or late != "latest" or model_sync_every:
        return
    _warned_drift = True
    warnings.warn(f"mode={mode!r} with late='latest' and no model_sync_every: a rank that is late for a round "
                  "never applies that round's gradients, so the ranks' models drift apart and accuracy can fall "
                  "(measured: 89 % -> 26-46 % with one slow rank at P = 2); pass late='fold' (drift-free), or "
                  "model_sync_every=k to average the models every k steps", UserWarning, stacklevel=3)
