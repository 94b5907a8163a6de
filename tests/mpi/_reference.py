"""Independent references the checks compare the engine with (no MPI, no partialcoll):
written from the definitions (docs/semantics.md, the comments of native/), never by
calling the library."""
from __future__ import annotations

from typing import Tuple

import numpy as np

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """Steele, Lea and Flood's SplitMix64 finaliser of x + the golden gamma (64-bit wrap)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def candidates(seed: int, round: int, size: int, q: int) -> Tuple[int, ...]:
    """Round `round`'s q candidates out of size ranks: the first q places of a Fisher-Yates
    shuffle of 0..size-1 whose i-th swap partner is i + h_i mod (size - i), with
    h_i = splitmix64(key + i), key = splitmix64(seed ^ splitmix64(round)) (round as its
    64-bit two's complement)."""
    perm = list(range(size))
    key = splitmix64((seed & MASK) ^ splitmix64(round & MASK))
    for i in range(q):
        j = i + splitmix64((key + i) & MASK) % (size - i)
        perm[i], perm[j] = perm[j], perm[i]
    return tuple(perm[:q])


DIGITS = 6          # up to this P, 1000**(P - 1) times a rank's posts fits an int64


def contribution(r: int, p: int) -> np.ndarray:
    """Rank r's post that says whose posts a SUM holds: e_r (int64), whose element r counts
    rank r's posts, and one more element 1000**r (where P <= DIGITS) whose base-1000 digit
    r must say the same."""
    x = np.zeros(p + 1, np.int64)
    x[r] = 1
    x[p] = 1000 ** r if p <= DIGITS else 0
    return x
