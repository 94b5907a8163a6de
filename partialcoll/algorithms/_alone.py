"""What every allreduce builder does with nothing to exchange (one rank, or no elements)."""
from __future__ import annotations

from typing import Optional

from .._buffers import BufRef
from ..schedule import ScheduleOp, Schedule


def alone(s: Schedule, buf: BufRef, after: Optional[ScheduleOp], divisor: float) -> ScheduleOp:
    """buf is already the result: divide it in place if asked, else a NOP."""
    if divisor != 1.0 and buf.count > 0:
        return s.copy(buf, buf, after=after, divisor=divisor, label="buf = buf / divisor (alone)")
    return s.nop(after=after, label="allreduce: nothing to exchange")
