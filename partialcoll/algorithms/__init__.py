"""Allreduce schedules. The registry key is the name users pass as ``algorithm=``."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

from . import model, ps, rabenseifner, recursive_doubling, ring, tree

ALGORITHMS: Dict[str, Callable] = {
    "recursive_doubling": recursive_doubling.allreduce,
    "ring": ring.allreduce,
    "rabenseifner": rabenseifner.allreduce,
    "tree": tree.allreduce,          # takes groups=, seed= and rotation= (see tree.py)
    "ps": ps.allreduce,              # takes block_bytes=, assignment=, servers=, timers= (see ps.py)
}
# the algorithms whose blocks have owners (balance= moves blocks between them)
OWNED = ("ps",)

def nontrivial_regions(levels: Optional[Sequence[Sequence[int]]]) -> bool:
    """Whether some level cuts the ranks into several regions, one of them of several
    ranks: only then has a tree fewer cross-region bytes than a flat algorithm."""
    for level in levels or ():
        if len(set(level)) > 1 and len(set(level)) < len(level):
            return True
    return False


def auto_may_choose_tree(algorithm: str, nbytes: int, size: int, params: model.Params = model.DEFAULTS) -> bool:
    """Whether choose() could pick the tree for some regions (nodes of 2, 4, ... ranks):
    the caller then finds them (the shared-memory nodes, a collective call) when the user
    gave none."""
    if algorithm != "auto" or size <= 2 or nbytes <= 0:
        return False
    ppn = 2
    while ppn < size:
        if model.best(size, nbytes, ppn, params, tree_ok=True)[0] == "tree":
            return True
        ppn *= 2
    return False


def explain(algorithm: str, nbytes: int, size: int, groups=None, params: model.Params = model.DEFAULTS,
            itemsize: int = 1) -> Tuple[str, str]:
    """(the algorithm "auto" resolves to, and why) for a vector of nbytes on size ranks.

    groups: the regions, if known (tree.normalize_groups' form: the user's groups=, or the
    shared-memory nodes): their innermost level gives the ranks per node, and the tree is
    a candidate where they are non-trivial. params: the model's (the same on every rank:
    the collective passes rank 0's). A named algorithm is checked and kept."""
    if algorithm != "auto":
        check_algorithm(algorithm)
        return algorithm, "named"
    if size <= 1 or nbytes <= 0:
        return "recursive_doubling", "nothing to exchange"
    ppn = model.ranks_per_node(groups, size)
    tree_ok = nontrivial_regions(groups)
    chunks = tree.default_chunks(max(nbytes // itemsize, 1), itemsize, groups) if tree_ok and groups else None
    return model.best(size, nbytes, ppn, params, tree_ok, chunks)


def choose(algorithm: str, nbytes: int, size: int, groups=None, params: model.Params = model.DEFAULTS) -> str:
    """Resolve "auto" (and check a name) for a vector of nbytes on size ranks: the
    algorithm of least predicted time (model.py; see explain())."""
    return explain(algorithm, nbytes, size, groups, params)[0]


def check_algorithm(algorithm: str) -> None:
    """ArgumentError unless algorithm is "auto" or one of ALGORITHMS."""
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        from .._errors import ArgumentError
        raise ArgumentError(f"unknown algorithm {algorithm!r}; use 'auto', " +
                            ", ".join(repr(a) for a in ALGORITHMS))
