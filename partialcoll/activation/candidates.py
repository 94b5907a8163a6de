"""Counter-based choice of round n's candidates, the same on every rank without messages."""
from __future__ import annotations

from typing import Tuple


def candidates(seed: int, round: int, size: int, q: int = 1) -> Tuple[int, ...]:
    """The q distinct ranks eligible to start round `round` (majority: q = 1; RNA: q = 2)."""
    from .._engine import ffi, lib
    from .._status import check
    from .._types import integer
    seed, round, size = integer(seed, "seed"), integer(round, "round"), integer(size, "size", 1)
    q = integer(q, "q", 1, size)
    out = ffi.new("int[]", max(q, 1))
    check(lib.pc_candidates(seed & 0xFFFFFFFFFFFFFFFF, round, size, q, out))
    return tuple(out[i] for i in range(q))
