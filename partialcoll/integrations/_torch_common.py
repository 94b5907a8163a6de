"""What the torch integrations share: tensors as library buffers without copies, a
thread that completes torch futures, and the averaging of a round's result.

A contiguous CPU tensor is handed to the library as a NumPy view of its memory
(``Tensor.numpy()`` shares it; bfloat16 through a 16-bit view, see ``_types.BFLOAT16``),
so ``post(x, out=x)`` reduces a gradient bucket where it lies: the full mode runs the
round in it, the partial modes copy it into the accumulator once and write the result
back into it. A CUDA tensor goes to the library as a CuPy view (DLPack) where CuPy can
use the GPU, else through a host copy.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from .. import _device
from .._errors import ArgumentError, InvalidBufferError
from .._partial import Result
from .._types import BFLOAT16

AVERAGES = ("world", "nap", "none")


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


def host_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing the memory of a contiguous CPU tensor (no copy)."""
    t = t.detach()
    if not t.is_contiguous():
        raise InvalidBufferError("the tensor must be contiguous")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


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

    CPU: a NumPy view (nothing to run). CUDA: a CuPy view where CuPy can use the GPU,
    else a host copy that is copied back after the wait."""
    if not t.is_cuda:
        return host_view(t), None
    if gpu_usable() and t.dtype != torch.bfloat16:
        return _device.cupy_backend().adopt(t.detach()), None
    host = t.detach().cpu()
    return host_view(host), lambda: t.copy_(host)


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


class Completer:
    """One daemon thread that runs jobs in submission order and completes their futures.

    A job waits for a round (the engine's wait releases the GIL, so backward goes on in
    the meantime) and returns the future's value. Rounds are waited for in the order
    they were posted, which is the order DDP and the optimizer wrapper wait for them.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], object]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put((job, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            try:
                value = job()
            except BaseException as exc:      # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)
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
