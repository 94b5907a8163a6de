"""Torch's processes as MPI sees them: the MPI communicator of a torch process group,
this node's ranks, the ``mpi://`` rendezvous and a TCPStore found over MPI.

Torch numbers processes by their rank in its default group ("global ranks"); MPI by
their rank in a communicator. ``set_world`` names the communicator whose ranks are the
global ranks (the one ``init_process_group`` or ``mpi://`` started torch on; by default
COMM_WORLD). A group of another backend (gloo, nccl) maps to MPI through its global
ranks, after its members have checked over the torch group itself that the two
numberings agree (``comm_of_group``): a mismatch is an error on every member, never
a collective over the wrong processes.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import List, Optional, Tuple, cast

import torch.distributed as dist
from mpi4py import MPI

from .._errors import ArgumentError

SCHEME = "mpi"
_world: MPI.Comm = MPI.COMM_WORLD          # the communicator whose ranks are torch's global ranks
_node: Optional[Tuple[int, int]] = None    # (local rank, local size), found once


def set_world(comm: MPI.Comm) -> None:
    global _world
    _world = comm


def group_comm(global_ranks: List[int]) -> MPI.Comm:
    """A new communicator of the processes with these global ranks (collective over them;
    every process of the world if the list is empty). The caller frees it."""
    world = _world
    if not global_ranks or list(global_ranks) == list(range(world.Get_size())):
        return world.Dup()
    everyone = world.Get_group()
    members = everyone.Incl(list(global_ranks))
    try:
        return cast(MPI.Intracomm, world).Create_group(members)   # set_world() took an intracommunicator
    finally:
        members.Free()
        everyone.Free()


def _is_ours(group) -> bool:
    return hasattr(group, "comm") and getattr(group, "getBackendName", lambda: "")() == "partialcoll"


def comm_of_group(group=None, comm: Optional[MPI.Comm] = None) -> Tuple[MPI.Comm, bool]:
    """(the MPI communicator of torch process group `group`, whether the caller must free it).

    Collective over the group's members. group None: the default group (COMM_WORLD, or
    comm, when torch.distributed is not initialized). The partialcoll backend's group:
    its communicator. Another backend's: a new communicator of the same processes, in
    the same order. comm, if given, must be that communicator (the same processes in the
    same order): otherwise ArgumentError on every member."""
    if not dist.is_initialized():
        if group is not None:
            raise ArgumentError("a process group was given, but torch.distributed is not initialized")
        return (comm if comm is not None else MPI.COMM_WORLD), False
    if group is None:
        group = dist.group.WORLD
    if _is_ours(group):
        if comm is not None and MPI.Comm.Compare(comm, group.comm) not in (MPI.IDENT, MPI.CONGRUENT):
            raise ArgumentError(f"comm is not the communicator of the partialcoll process group {group!r} "
                                f"(rank {comm.Get_rank()} of {comm.Get_size()} in comm): pass one of them")
        return group.comm, False
    ranks = dist.get_process_group_ranks(group)            # global ranks, in group-rank order
    world = _world
    mine: tuple = (world.Get_rank(),)
    if comm is not None:
        mine += (comm.Get_size(), comm.Get_rank(), tuple(_world_ranks_of(comm)))
    everyone: list = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=group)    # the same list on every member
    wrong = [(i, g, e[0]) for i, (g, e) in enumerate(zip(ranks, everyone)) if e[0] != g]
    if wrong:
        i, g, m = wrong[0]
        raise ArgumentError(f"torch's global rank {g} (rank {i} of the group {group!r}) is rank {m} of the MPI "
                            f"communicator torch was started on: torch.distributed must be initialized over "
                            f"MPI's numbering (partialcoll.integrations.torch.init_process_group, or "
                            f"init_method='mpi://')")
    if comm is None:
        return group_comm(ranks), True
    for i, (size, rank, members) in enumerate(e[1:] for e in everyone):
        if size != len(ranks) or rank != i or list(members) != list(ranks):
            raise ArgumentError(f"comm does not match the torch process group: the group's rank {i} is global "
                                f"rank {ranks[i]} of a group of {len(ranks)} ({list(ranks)}), but is rank "
                                f"{rank} of a communicator of {size} whose processes are {list(members)}")
    return comm, False


def _world_ranks_of(comm: MPI.Comm) -> List[int]:
    """The ranks in the world communicator of comm's processes, in comm's order."""
    g, w = comm.Get_group(), _world.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(g, list(range(comm.Get_size())), w)]
    finally:
        g.Free()
        w.Free()


# -- this node --------------------------------------------------------------------------------
def node_ranks(comm: Optional[MPI.Comm] = None) -> Tuple[int, int]:
    """(rank, size) of this process among the processes of comm (default COMM_WORLD) on
    its node: MPI_Comm_split_type(COMM_TYPE_SHARED), collective the first time."""
    global _node
    if _node is None or comm is not None:
        node = (comm or MPI.COMM_WORLD).Split_type(MPI.COMM_TYPE_SHARED)
        _node = (node.Get_rank(), node.Get_size())
        node.Free()
    return _node


def local_rank() -> int:
    """This process's rank among the processes on its node (Horovod's local_rank(); the
    LOCAL_RANK torchrun sets). Collective the first time it or local_size() is called,
    unless init_process_group() has run."""
    return node_ranks()[0]


def local_size() -> int:
    """How many processes run on this node (Horovod's local_size(); torchrun's LOCAL_WORLD_SIZE)."""
    return node_ranks()[1]


def set_launch_env(comm: MPI.Comm) -> None:
    """What torchrun sets, from MPI, where the user has not: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE (collective over comm)."""
    lrank, lsize = node_ranks(comm)
    for key, value in (("RANK", comm.Get_rank()), ("WORLD_SIZE", comm.Get_size()),
                       ("LOCAL_RANK", lrank), ("LOCAL_WORLD_SIZE", lsize)):
        os.environ.setdefault(key, str(value))


# -- mpi:// ------------------------------------------------------------------------------------
def register_rendezvous() -> None:
    """Add the ``mpi://`` scheme to torch's rendezvous handlers (idempotent)."""
    from torch.distributed.rendezvous import _rendezvous_handlers, register_rendezvous_handler
    if SCHEME not in _rendezvous_handlers:
        register_rendezvous_handler(SCHEME, _mpi_rendezvous)


def _mpi_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """init_method="mpi://": rank and size from MPI.COMM_WORLD, a TCPStore every rank finds
    over MPI; RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set where unset."""
    comm = MPI.COMM_WORLD
    query = dict(kv.split("=", 1) for kv in url.partition("?")[2].split("&") if "=" in kv)
    for key, mine in (("rank", comm.Get_rank()), ("world_size", comm.Get_size())):
        if key in query and int(query[key]) not in (-1, mine):
            raise ArgumentError(f"mpi:// takes {key} from MPI ({mine}), but {query[key]} was given")
    set_world(comm)
    set_launch_env(comm)
    yield (mpi_store(comm, timeout), comm.Get_rank(), comm.Get_size())
    raise RuntimeError("Unable to perform re-rendezvous using mpi://")


# -- a TCPStore found over MPI -----------------------------------------------------------------
def mpi_store(comm: MPI.Comm, timeout: timedelta) -> "dist.Store":
    """A TCPStore at rank 0 of comm on a free port, found by every rank over MPI.

    The store listens on every interface of rank 0's host; rank 0 sends its addresses
    (loopback last) and every other rank takes the first one it can connect to. The
    address its host name resolves to is not enough: Debian-style /etc/hosts map it to
    127.0.1.1, and ranks in separate network namespaces share a host name (tests/hosts.py)
    -- the other ranks then waited for the store's timeout. If some rank reaches none,
    every rank raises. Gloo's own connections then go out of the interface this rank
    reached rank 0 through (GLOO_SOCKET_IFNAME, unless the user set it)."""
    interfaces = _interfaces()
    if comm.Get_rank() == 0:
        candidates = _local_addresses(interfaces)
        store = dist.TCPStore(candidates[0], 0, comm.Get_size(), is_master=True, timeout=timeout,
                              wait_for_workers=False)
        comm.bcast((candidates, store.port), root=0)
        host: Optional[str] = candidates[0]
        mine = host
    else:
        candidates, port = comm.bcast(None, root=0)
        host, mine = _first_reachable(candidates, port)
    unreached = [r for r, h in enumerate(comm.allgather(host)) if h is None]
    if unreached:
        raise RuntimeError(f"ranks {unreached} reach none of rank 0's addresses {', '.join(candidates)} "
                           f"(the TCPStore of torch.distributed over MPI); set MASTER_ADDR and MASTER_PORT")
    if "GLOO_SOCKET_IFNAME" not in os.environ and mine is not None and not mine.startswith("127."):
        name = next((n for n, a in interfaces if a == mine), None)
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    if comm.Get_rank() == 0:
        return store
    assert host is not None               # this rank is not among the unreached
    return dist.TCPStore(host, port, comm.Get_size(), is_master=False, timeout=timeout)


def _interfaces() -> List[tuple]:
    """(name, IPv4 address) of this host's interfaces that have one (Linux; else none)."""
    out = []
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:               # SIOCGIFADDR: the interface's IPv4 address
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                    out.append((name, socket.inet_ntoa(packed[20:24])))
                except OSError:    # no IPv4 address
                    pass
    except (ImportError, OSError, AttributeError):
        pass
    return out


def _local_addresses(interfaces: List[tuple]) -> List[str]:
    """This host's IPv4 addresses: its interfaces', then its name's; loopback last."""
    found = [a for _, a in interfaces]
    try:
        found += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    found = list(dict.fromkeys(found))
    ordered = [a for a in found if not a.startswith("127.")] + [a for a in found if a.startswith("127.")]
    return ordered or ["127.0.0.1"]


def _first_reachable(candidates: List[str], port: int) -> tuple:
    """(the first address of candidates that accepts a connection on port, this rank's own
    address on that connection); (None, None) where none does."""
    for addr in candidates:
        try:
            with socket.create_connection((addr, port), timeout=2.0) as conn:
                return addr, conn.getsockname()[0]
        except OSError:
            continue
    return None, None
