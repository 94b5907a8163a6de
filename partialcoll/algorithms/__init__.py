"""Allreduce schedules. The registry key is the name users pass as ``algorithm=``."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from . import ps, recursive_doubling, ring, tree

ALGORITHMS: Dict[str, Callable] = {
    "recursive_doubling": recursive_doubling.allreduce,
    "ring": ring.allreduce,
    "tree": tree.allreduce,          # takes groups=, seed= and rotation= (see tree.py)
    "ps": ps.allreduce,              # takes block_bytes=, assignment=, servers=, timers= (see ps.py)
}
# the algorithms whose blocks have owners (balance= moves blocks between them)
OWNED = ("ps",)

# "auto": recursive doubling up to this many bytes, ring above (measured: see docs/benchmarks.md).
AUTO_RING_BYTES = 64 * 1024
# "auto": the tree above this many bytes (where it would otherwise pick ring), where the
# regions are known and non-trivial (measured across emulated hosts: docs/tree.md, "auto").
AUTO_TREE_BYTES = AUTO_RING_BYTES


def nontrivial_regions(levels: Optional[Sequence[Sequence[int]]]) -> bool:
    """Whether some level cuts the ranks into several regions, one of them of several
    ranks: only then has a tree fewer cross-region bytes than a flat algorithm."""
    for level in levels or ():
        if len(set(level)) > 1 and len(set(level)) < len(level):
            return True
    return False


def auto_may_choose_tree(algorithm: str, nbytes: int, size: int) -> bool:
    """Whether choose() could pick the tree, given regions: the caller then finds them
    (the shared-memory nodes, a collective call) when the user gave none."""
    return algorithm == "auto" and nbytes > AUTO_TREE_BYTES and size > 2


def choose(algorithm: str, nbytes: int, size: int, groups=None) -> str:
    """Resolve "auto" (and check a name) for a vector of nbytes on size ranks.

    groups: the regions, if known (tree.normalize_groups' form: the user's groups=, or the
    shared-memory nodes). "auto" picks "tree" where they are non-trivial and nbytes >
    AUTO_TREE_BYTES, i.e. in place of ring (the tree sends one vector across regions each
    way, ring 1.75 with two contiguous regions; across slower links between regions that
    is what counts); otherwise recursive doubling up to AUTO_RING_BYTES and ring above."""
    if algorithm == "auto":
        if auto_may_choose_tree(algorithm, nbytes, size) and nontrivial_regions(groups):
            return "tree"
        return "ring" if nbytes > AUTO_RING_BYTES and size > 1 else "recursive_doubling"
    check_algorithm(algorithm)
    return algorithm


def check_algorithm(algorithm: str) -> None:
    """ArgumentError unless algorithm is "auto" or one of ALGORITHMS."""
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        from .._errors import ArgumentError
        raise ArgumentError(f"unknown algorithm {algorithm!r}; use 'auto', " +
                            ", ".join(repr(a) for a in ALGORITHMS))
