"""The alpha-beta model that algorithm="auto" chooses by.

One allreduce of n bytes on P ranks, ppn of them per node, costs per message alpha
(latency), per byte beta (a link's time per byte), per byte reduced gamma, and o per
receive and per reduction in the engine. Inside a node the links are alpha_node and
beta_node; between nodes alpha and beta, and a node's ranks share its network link.
Per algorithm, from the schedules the builders make (docs/scaling.md has the same
formulas; bench/scale.py checks them against an event simulation of the real schedules):

    recursive_doubling  per step: alpha + n beta + n gamma + 2 o           (log2 P' steps)
    rabenseifner        per halving step k: alpha + (n / 2^(k+1))(beta + gamma) + 2 o,
                        per doubling step the same bytes without gamma     (2 log2 P' steps)
    ring                (P - 1)(alpha + (n/P)(beta + gamma) + 2 o) + (P - 1)(alpha + (n/P) beta + o)
    tree                inside the node: up, (k - 1) chunks reduced, down; the top
                        allreduce among the nodes' aggregators of each chunk, the chunks'
                        allreduces sharing the node's link
    (P not a power of two: recursive doubling and rabenseifner fold the extra ranks in
    and out, (alpha + n beta + n gamma + 2 o) + (alpha + n beta + o) more.)

Quorum's activation (``quorum``): from the k-th post to the round's start at rank 0,
the leader's alpha + (P - 1) o, or the sorting network's in boxes of fan wires,
(D_k + 1) alpha + (D_k (fan - 1) + 1) o (D_k its box hops).

A hypercube step between ranks mask apart stays inside a node when mask < ppn (ranks
are placed node by node); across nodes the ppn ranks of a node send at once through its
link (beta x ppn).

Parameters: ``load()`` reads those ``partialcoll-bench calibrate`` measured on this
machine (cached in $PARTIALCOLL_CALIBRATION, or ~/.cache/partialcoll/calibration-HOST.json),
else DEFAULTS. A collective chooses with rank 0's parameters, agreed at construction,
so every rank runs the same algorithm; the builders' own inner choices (the tree's top
allreduce) use DEFAULTS, so that a schedule stays a pure function of its arguments.
"""
from __future__ import annotations

import json
import math
import os
import socket
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

# the flat algorithms "auto" considers (ps has owners and is named, never chosen)
FLAT = ("recursive_doubling", "rabenseifner", "ring")


class Params(NamedTuple):
    """The model's parameters, in seconds (per message, per byte, per op)."""
    alpha: float = 5e-6           # a message between nodes (25 Gb/s Ethernet class)
    beta: float = 0.32e-9         # a byte between nodes (25 Gb/s)
    gamma: float = 0.15e-9        # a byte reduced (float32 SUM, one core)
    o: float = 0.1e-6             # the engine's cost of a receive or a reduction
    alpha_node: float = 1.5e-6    # a message inside a node (shared memory)
    beta_node: float = 0.15e-9    # a byte inside a node
    source: str = "defaults"      # where they come from: "defaults" or the cache file

    def describe(self) -> str:
        return (f"alpha {self.alpha * 1e6:.3g} us, beta {self.beta * 1e9:.3g} ns/B, gamma {self.gamma * 1e9:.3g} "
                f"ns/B, o {self.o * 1e6:.3g} us, node alpha {self.alpha_node * 1e6:.3g} us, node beta "
                f"{self.beta_node * 1e9:.3g} ns/B ({self.source})")


DEFAULTS = Params()


def cache_path() -> str:
    """Where calibrate writes this machine's parameters and load() reads them."""
    env = os.environ.get("PARTIALCOLL_CALIBRATION")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "partialcoll", f"calibration-{socket.gethostname()}.json")


def load(path: Optional[str] = None) -> Params:
    """This machine's calibrated parameters, or DEFAULTS where there are none (or they do
    not parse: a broken cache never stops a collective)."""
    path = path or cache_path()
    try:
        with open(path) as f:
            raw = json.load(f)
        fields = {k: float(raw[k]) for k in Params._fields if k != "source" and k in raw}
        if not all(v >= 0 and math.isfinite(v) for v in fields.values()):
            return DEFAULTS
        return DEFAULTS._replace(source=path, **fields)
    except (OSError, ValueError, TypeError, KeyError):
        return DEFAULTS


def save(params: Params, path: Optional[str] = None) -> str:
    path = path or cache_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({k: v for k, v in params._asdict().items() if k != "source"}, f, indent=1)
    return path


def _link(q: Params, mask: int, p: int, ppn: int) -> Tuple[float, float]:
    """(alpha, beta) of a hypercube step between ranks mask apart."""
    if ppn >= p or mask < ppn:
        return q.alpha_node, q.beta_node
    return q.alpha, q.beta * max(ppn, 1)


def _fold(q: Params, n: float, p: int, ppn: int) -> float:
    """The extra ranks folded in and out (neighbours r, r + 1: mask 1)."""
    a, b = _link(q, 1, p, ppn)
    return (a + n * b + n * q.gamma + 2 * q.o) + (a + n * b + q.o)


def predict(alg: str, p: int, nbytes: float, ppn: int = 1, q: Params = DEFAULTS, chunks: Optional[int] = None) -> float:
    """Predicted seconds of one allreduce of nbytes by `alg` on p ranks, ppn per node."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    n, g, o = float(nbytes), q.gamma, q.o
    pof2 = 1 << (p.bit_length() - 1)
    extra = _fold(q, n, p, ppn) if p != pof2 else 0.0
    if alg == "recursive_doubling":
        t, mask = 0.0, 1
        while mask < pof2:
            a, b = _link(q, mask, p, ppn)
            t += a + n * b + n * g + 2 * o
            mask <<= 1
        return t + extra
    if alg == "rabenseifner":
        t, mask, part = 0.0, 1, n
        while mask < pof2:
            a, b = _link(q, mask, p, ppn)
            part /= 2
            t += (a + part * (b + g) + 2 * o) + (a + part * b + o)
            mask <<= 1
        return t + extra
    if alg == "ring":
        a, b = (q.alpha_node, q.beta_node) if ppn >= p else (q.alpha, q.beta)
        s = n / p
        return (p - 1) * (a + s * (b + g) + 2 * o) + (p - 1) * (a + s * b + o)
    if alg == "tree":
        k = min(max(ppn, 1), p)
        nodes = -(-p // k)
        c = max(1, min(k, int(chunks or k)))
        part = n / c
        inside = 2 * q.alpha_node + 2 * (k - 1) * part * q.beta_node + (k - 1) * (part * g + o) + 2 * o
        if nodes <= 1:
            return inside
        top_q = q._replace(beta=q.beta * c)      # the node's c top allreduces share its link
        return inside + min(predict(a, nodes, part, 1, top_q) for a in FLAT)
    if alg == "mpi":                 # MPICH's MPI_Allreduce: recursive doubling up to 2 KiB, else
        return predict("recursive_doubling" if n <= 2048 else "rabenseifner", p, n, ppn, q)
    raise ValueError(f"no model of {alg!r}")


def quorum(how: str, p: int, depth: int = 0, fan: int = 2, q: Params = DEFAULTS) -> float:
    """Predicted seconds from quorum's k-th post to the round's start at the leader (the
    broadcast after it is the same either way). "leader": one hop, then rank 0 takes the
    p - 1 notifications one after another (every rank posting at once: the case that
    makes rank 0 a hot spot); "network": depth box hops, each a message and then up to
    fan - 1 receives taken one after another at the box's rank, then the hop to rank 0
    (activation/quorum_network.py)."""
    if p <= 1:
        return 0.0
    if how == "leader":
        return q.alpha + (p - 1) * q.o
    if how == "network":
        return (depth + 1) * q.alpha + (depth * (fan - 1) + 1) * q.o
    raise ValueError(f"no model of quorum activation {how!r}")


def lower_bound(p: int, nbytes: float, q: Params = DEFAULTS) -> float:
    """The alpha-beta lower bound of an allreduce (between nodes, no engine costs):
    min(ceil(log2 P)(alpha + n beta + n gamma), 2 ceil(log2 P) alpha + 2 ((P-1)/P) n beta + ((P-1)/P) n gamma)."""
    if p <= 1:
        return 0.0
    lg, n, f = math.ceil(math.log2(p)), float(nbytes), (p - 1) / p
    return min(lg * (q.alpha + n * q.beta + n * q.gamma), 2 * lg * q.alpha + 2 * f * n * q.beta + f * n * q.gamma)


def ranks_per_node(levels: Optional[Sequence[Sequence[int]]], p: int) -> int:
    """The largest region of the innermost level (1: every rank on a node of its own)."""
    if not levels:
        return 1
    level = list(levels[0])
    return max(level.count(g) for g in set(level)) if level else 1


def ranking(p: int, nbytes: int, ppn: int, q: Params, tree_ok: bool,
            chunks: Optional[int] = None) -> Dict[str, float]:
    """Predicted seconds of each candidate."""
    out = {a: predict(a, p, nbytes, ppn, q) for a in FLAT}
    if tree_ok:
        out["tree"] = predict("tree", p, nbytes, ppn, q, chunks)
    return out


def best(p: int, nbytes: int, ppn: int = 1, q: Params = DEFAULTS, tree_ok: bool = False,
         chunks: Optional[int] = None) -> Tuple[str, str]:
    """(the algorithm with the least predicted time, why: the predictions it beat)."""
    times = ranking(p, nbytes, ppn, q, tree_ok, chunks)
    # ties: the first in FLAT order (fewest messages), then the tree
    name = min(times, key=lambda a: (times[a], list(times).index(a)))
    others = ", ".join(f"{a} {t * 1e6:.4g}" for a, t in sorted(times.items(), key=lambda kv: kv[1]) if a != name)
    why = (f"{name}: the least predicted time at P={p}, {nbytes} B, {ppn} rank{'s' if ppn != 1 else ''}/node: "
           f"{times[name] * 1e6:.4g} us" + (f" (then {others} us)" if others else "") + f"; {q.describe()}")
    return name, why
