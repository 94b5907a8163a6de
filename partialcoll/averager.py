"""Asynchronous averaging through a server rank (RNA's parameter server between groups).

    avg = pc.AsyncAverager(count, np.float32, comm=comm, server=0)
    mean = avg.push(params, key=group).wait()     # mean of every key's latest push
    avg.close()                                   # collective

How it works. The server holds, for each rank c of the communicator, one persistent
schedule of the native engine (native/avg.c):

    recv push <- c  ->  deliver: latest[key] = data, reply = mean(latest[k] for every key k)
                    ->  send reply -> c

which the engine re-arms when it completes: the server serves from its progress thread,
whether or not it also trains, and no Python runs there per push. The server's own
pushes fold on its calling thread, without a message. A client's push is a
schedule of its own (send the push, receive the reply) on the same communicator; its
k-th push matches the k-th execution of the server's schedule for it. So a push waits
for its own round trip and for no other rank: a slow key never delays a fast one. The
key travels with the push (an int64 in its header), so keys are not ranks: a group of
ranks pushes under its group id, whichever rank of the group pushes.

The mean is taken wide and rounded once: real floating types (float16 and bfloat16
included) and complex parts in double, integers in 64 bits with the quotient truncated
toward zero. bool has no mean.

Memory: two buffers of 16 + count * itemsize bytes per rank (the push and the reply),
and on the server two per rank plus one per key.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from mpi4py import MPI

from . import _device, _engine, _shrink
from ._agree import agree, as_problem
from ._buffers import SLOT_MASK, SLOT_WORK, BufRef, as_buffer
from ._errors import OpError, StateError, Timeout
from ._status import busy_seconds, check, failed_peers_check, wait_request
from ._rc import rc
from ._typing import Buffer, DTypeLike
from ._types import as_dtype, check_comm, dtype_code, dtype_name, integer
from .schedule import Request, Schedule, op_table

# why on_failure="shrink" is refused (docs/faults.md)
NO_SHRINK = ("its server holds every key's latest vector (a dead server takes them all with it) and its close() "
             "is collective over every rank; a failed peer raises PeerError or MPIError")
HEADER = 16          # bytes in front of a push (key, 0) and a reply (keys, pushes)


def server_schedule(server: int, size: int, client: int, nbytes: int) -> Schedule:
    """Pure builder of the server's schedule for one client: receive the push, fold it
    and make the mean (deliver), send the reply. Buffers are the engine's slots: WORK
    holds the push, MASK the reply (16 + nbytes bytes each)."""
    s = Schedule(rank=server, size=size)
    push = BufRef.slot_ref(SLOT_WORK, HEADER + nbytes, np.uint8)
    reply = BufRef.slot_ref(SLOT_MASK, HEADER + nbytes, np.uint8)
    got = s.recv(push, source=client, label="the client's push: key, data")
    folded = s._deliver(after=got)            # latest[key] = data; reply = the mean
    s.send(reply, dest=client, after=folded, label="the mean of every key's latest push")
    return s


def client_schedule(rank: int, size: int, server: int, push: np.ndarray, reply: np.ndarray) -> Schedule:
    """Pure builder of a client's push: send push to the server, receive its reply."""
    s = Schedule(rank=rank, size=size)
    s.send(push, dest=server, label="key, data")
    s.recv(reply, source=server, label="keys, pushes, mean")
    return s


class AverageRequest:
    """One push: ``wait(timeout=None)`` -> the mean (a new array), ``test()`` -> bool.

    After the wait, ``keys`` is how many keys the mean covers and ``pushes`` how many
    pushes the server had served when it made it (this one included)."""

    def __init__(self, averager: "AsyncAverager", request: Optional[Request], device=None) -> None:
        self._averager = averager
        self._request = request
        self._device = device            # (backend, the pushed device array): the mean goes there too
        self._mean: Optional[np.ndarray] = None
        self.keys = 0
        self.pushes = 0

    def test(self) -> bool:
        """True once the server's reply is here."""
        return self._mean is not None or self._request is None or self._request.test()

    def wait(self, timeout: Optional[float] = None) -> np.ndarray:
        """Block until the server's reply is here; the mean of every key's latest push."""
        if self._mean is None:
            if self._request is not None:    # None: the server's own push, folded already
                self._request.wait(timeout)
            mean, self.keys, self.pushes = self._averager._read_reply()
            if self._device is not None:
                backend, like = self._device
                mean = _device.copy_out(backend, mean, None, like)
            self._mean = mean
        return self._mean

    Wait = wait
    Test = test


class AsyncAverager:
    """Averaging through a server rank, asynchronous between keys (created collectively).

    Construction is collective over comm: one allgather (the ranks agree on count, dtype,
    server and on_failure), comm.Dup() (the averager's own communicator) and, on the
    server, one persistent schedule per rank. close() is collective.

    on_failure: "raise" only (default partialcoll.rc.on_failure): a failed peer raises
    PeerError or MPIError. "shrink" raises ArgumentError on every rank: the server holds
    every key's latest vector, which a dead server takes with it, and close() is
    collective over every rank (docs/faults.md).

    Threads and buffers: push() copies x into this rank's push buffer, which the engine
    reads (the send) until the request completes; the engine writes the reply buffer,
    which wait() copies out once the request completed. A push waits for this rank's
    previous push first (one round trip in flight per rank), so push() and the waits
    belong to one thread at a time: the next push reuses both buffers. On the server
    the progress thread owns the received pushes, the table of latest vectors and the
    replies (under the averager's lock). The server needs that thread: where its process
    progresses inline and it has clients, creation raises ArgumentError on every rank (it
    would serve only inside its own calls of the engine, and its own pushes fold
    locally: every client would wait).
    """

    def __init__(self, count: int, dtype: DTypeLike = np.float32, comm: MPI.Comm = MPI.COMM_WORLD,
                 server: int = 0, on_failure: Optional[str] = None) -> None:
        check_comm(comm, "AsyncAverager")
        size, rank = comm.Get_size(), comm.Get_rank()
        problem = params = None
        try:
            count = integer(count, "count", 0)
            dt = as_dtype(dtype)
            dtype_code(dt)
            if dt == np.bool_:
                raise OpError("AsyncAverager: a mean is not defined for dtype bool")
            server = integer(server, "server", 0)
            if server >= size:
                raise ValueError(f"server {server} is outside the communicator (size {size}; this is rank {rank})")
            params = {"count": count, "dtype": dtype_name(dt), "server": server,
                      "on_failure": _shrink.refuse(on_failure, "AsyncAverager", NO_SHRINK)}
            if rank == server and size > 1:      # alone, nobody waits for it
                _engine.require_thread(f"AsyncAverager: the server (rank {server})")
        except Exception as exc:         # noqa: BLE001 - reported on every rank below
            problem = as_problem(exc, "AsyncAverager")
        agree(comm, "AsyncAverager", problem, params, what="the same count, dtype and server")
        self.count, self.dtype, self.server = count, dt, server
        self.rank, self.size = rank, size
        nbytes = count * dt.itemsize
        self._closed = True
        self._server = None
        self._client: Optional[Schedule] = None
        self._pending: Optional[AverageRequest] = None
        # rank-owned buffers: written by push() and the engine's receive (class docstring)
        self._push = np.zeros(HEADER + nbytes, np.uint8)
        self._reply = np.zeros(HEADER + nbytes, np.uint8)
        _engine.ensure_started()
        dup = comm.Dup()
        dup.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm: Optional[MPI.Comm] = dup
        try:
            # every schedule on dup has one message per pair of ranks: pairs = 1 everywhere
            if rank == server:
                self._client = None          # the server's pushes fold locally
                self._serve(nbytes, dup)
            else:
                self._client = client_schedule(rank, size, server, self._push, self._reply)._commit_on(dup, 1)
        except BaseException:
            self._abandon()
            raise
        self._closed = False

    def _serve(self, nbytes: int, comm: MPI.Comm) -> None:
        ffi, lib = _engine.ffi, _engine.lib
        out = ffi.new("pc_avg **")
        check(lib.pc_avg_create(dtype_code(self.dtype), self.count, self.size, out))
        self._server = out[0]
        for c in range(self.size):
            if c == self.rank:
                continue
            n, specs, nedges, edges = op_table(server_schedule(self.rank, self.size, c, nbytes))
            check(lib.pc_avg_serve(self._server, _engine.comm_handle(comm), c, n, specs, nedges, edges, 1))

    def push(self, x: Buffer, key: Optional[int] = None) -> AverageRequest:
        """Send x to the server under key (default: this rank); returns a request whose
        wait() gives the mean of the latest vector pushed under every key so far."""
        if self._closed:
            raise StateError("this AsyncAverager is closed")
        backend = _device.backend_of(x)
        if backend is not None:          # a device array: copied into the push buffer below
            x = _device.device_buffer(backend, x, self.dtype, self.count, what="push buffer", who="averager")
        else:
            x = as_buffer(x, self.dtype, self.count, writable=False, what="push buffer", who="averager")
        key = self.rank if key is None else integer(key, "key", -2 ** 63, 2 ** 63 - 1)
        if self._pending is not None:
            self._pending.wait()         # one round trip in flight: the buffers are ours again
        self._push[:8].view(np.int64)[0] = key
        if backend is not None:
            _device.copy_in(backend, x, self._push[HEADER:].view(self.dtype))
        else:
            self._push[HEADER:] = x.reshape(-1).view(np.uint8)
        device = None if backend is None else (backend, x)
        if self._client is None:         # the server: fold now, on this thread
            ffi = _engine.ffi
            check(_engine.lib.pc_avg_push_local(self._server, ffi.from_buffer(self._push),
                                                ffi.from_buffer(self._reply)))
            req = AverageRequest(self, None, device)
            req.wait()
            return req
        req = AverageRequest(self, self._client.start(), device)
        self._pending = req
        return req

    def _read_reply(self):
        if self._pending is not None and self._pending._mean is None:
            self._pending = None
        head = self._reply[:HEADER].view(np.int64)
        return self._reply[HEADER:].view(self.dtype).copy(), int(head[0]), int(head[1])

    def state(self) -> tuple:
        """On the server: (keys, pushes) served so far; raises what failed in serving."""
        if self._server is None:
            raise StateError("state() is for the server rank")
        keys, pushes = _engine.ffi.new("int64_t *"), _engine.ffi.new("int64_t *")
        check(_engine.lib.pc_avg_state(self._server, keys, pushes))
        return int(keys[0]), int(pushes[0])

    def close(self, timeout: Optional[float] = None) -> None:
        """Collective: wait for this rank's last push, then the server stops serving."""
        comm = self._comm
        if self._closed or comm is None:
            return
        timeout = rc.close_timeout if timeout is None else float(timeout)
        if self._pending is not None:
            self._pending.wait(timeout)
        # every rank has its last reply: the server's schedules hold nothing but a receive
        _wait_collective(comm.Ibarrier(), "AsyncAverager.close()'s barrier", timeout, comm=comm)
        self._closed = True
        deferred = _engine.ffi.new("int *")
        if self._server is not None:
            check(_engine.lib.pc_avg_free(self._server, 10.0, deferred))
            self._server = None
        if self._client is not None:
            self._client.free()
        if deferred[0]:
            _engine.keep_until_finalize(comm)
        else:
            comm.Free()
        self._comm = None

    def _abandon(self) -> None:
        """Drop the averager on this rank only (no collective call, and no MPI call: __del__
        runs it, on whatever thread collects the object)."""
        self._closed = True
        client = getattr(self, "_client", None)
        if client is not None:
            client._abandon()
            self._client = None
        if getattr(self, "_server", None) is not None and getattr(_engine, "lib", None) is not None:
            # no MPI call here (this may be the garbage collector's thread): the engine
            # withdraws the server's receives on its next pass and frees them after
            deferred = _engine.ffi.new("int *")
            _engine.lib.pc_avg_abandon(self._server, deferred)
            self._server = None
            _engine.keep_until_finalize(self._push, self._reply, self._comm)
        elif getattr(self, "_comm", None) is not None:
            _engine.free_later(self._comm)
        self._comm = None

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._abandon()

    def __enter__(self) -> "AsyncAverager":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            self._abandon()

    def __repr__(self) -> str:
        return f"AsyncAverager(count={self.count}, dtype={self.dtype}, server={self.server}, size={self.size})"


def _wait_collective(req: MPI.Request, what: str, timeout: Optional[float] = None, keep=(),
                     comm: Optional[MPI.Comm] = None, nbytes: int = 0) -> None:
    """Wait for the request of a collective over comm (its buffers in keep); Timeout after
    `timeout` seconds (None: rc.timeout, which may be None: for ever); MPIError as soon as
    the MPI reports a member of comm as failed. The request cannot be cancelled: after
    either its communicator is not to be used again. It waits under the engine's idle
    policy (wait_request), yielding the core for four times the time nbytes take at 1
    GB/s (1 ms at least) before it sleeps."""
    timeout = rc.timeout if timeout is None else timeout
    check = None if comm is None else failed_peers_check(_engine.comm_handle(comm), comm.Get_rank(), what)
    if not wait_request(req, timeout, keep, check=check, busy=busy_seconds(nbytes, 1e-3)):
        raise Timeout(f"{what} did not complete within {timeout} s: a member of the communicator has not "
                      "reached it (these collectives need every member at the same step)")
