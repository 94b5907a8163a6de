"""Errors that need a process of their own: MPI without MPI_THREAD_MULTIPLE, use after
finalize, CuPy-like device arrays without GPU support."""
import pytest

from conftest import run_python as run_py, run_shared


def test_needs_thread_multiple():
    p = run_py("""
        import mpi4py
        mpi4py.rc.thread_level = "single"
        from mpi4py import MPI
        import numpy as np, partialcoll as pc
        try:
            pc.allreduce_init(4, np.float64)
        except pc.EngineError as exc:
            assert "MPI_THREAD_MULTIPLE" in str(exc), exc
            print("clear error")
    """)
    assert p.returncode == 0 and "clear error" in p.stdout, p.stdout + p.stderr


def test_finalize_then_use_restarts_or_errors():
    p = run_py("""
        from mpi4py import MPI
        import numpy as np, partialcoll as pc
        s = pc.Schedule(MPI.COMM_SELF)
        s.recv(np.zeros(1), 0)
        s.commit()
        req = s.start()
        pc.finalize()                      # abandons the pending receive
        try:
            req.wait(timeout=5)
        except pc.PartialcollError as exc:
            print("error:", type(exc).__name__)
        t = pc.Schedule(MPI.COMM_SELF)     # the engine starts again on next use
        t.nop()
        t.commit().start().wait(timeout=5)
        print("restarted")
    """)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "error: StateError" in p.stdout and "restarted" in p.stdout, p.stdout


def test_device_array_is_a_clear_error():
    """Without CuPy, or without a GPU, a device array is an InvalidBufferError that says so."""
    import importlib.util
    if importlib.util.find_spec("cupy") is not None:
        import cupy
        if cupy.cuda.is_available():
            pytest.skip("a GPU is usable here: tests/test_device.py covers device arrays")
    p = run_py("""
        from mpi4py import MPI
        import numpy as np, partialcoll as pc

        class FakeDeviceArray:             # what CuPy arrays expose
            __cuda_array_interface__ = {"shape": (4,), "typestr": "<f8", "data": (0, False), "version": 3}

        coll = pc.allreduce_init(4, np.float64, comm=MPI.COMM_SELF)
        try:
            coll.post(FakeDeviceArray())
        except pc.InvalidBufferError as exc:
            assert "CuPy" in str(exc), exc
            print("clear error")
        coll.close()
    """)
    assert p.returncode == 0 and "clear error" in p.stdout, p.stdout + p.stderr


def test_public_surface():
    """Issue 11, finding 7: names that shadow nothing, an engine OOM is ours, options a
    mode does not use are rejected, NumPy integers are accepted everywhere."""
    p = run_py("""
        import builtins
        import numpy as np
        from mpi4py import MPI
        import partialcoll as pc
        from partialcoll._status import check
        assert pc.InvalidBufferError.__name__ == "InvalidBufferError"
        assert not any(hasattr(builtins, name) for name in pc.__all__ if name[0].isupper()), "shadows a builtin"
        assert "Op" not in pc.__all__ and pc.ScheduleOp.__name__ == "ScheduleOp"
        try:
            check(3)
        except pc.OutOfMemory as exc:
            assert isinstance(exc, MemoryError) and isinstance(exc, pc.PartialcollError)
        else:
            raise SystemExit("check(3), the engine's out-of-memory code, raised nothing")
        for kw in ({"mode": "solo", "candidates": 3}, {"mode": "full", "quorum": 1},
                   {"mode": "majority", "candidates": 2}, {"mode": "quorum", "quorum": True}):
            try:
                pc.PartialAllreduce(4, np.float32, MPI.SUM, MPI.COMM_SELF, **kw)
                raise SystemExit(f"accepted {kw}")
            except pc.ArgumentError:
                pass
        c = pc.PartialAllreduce(np.int64(4), np.float32, MPI.SUM, MPI.COMM_SELF, mode="probe",
                                candidates=np.int32(2), seed=np.uint64(5), max_staleness=np.int16(3))
        assert c.post(np.ones(4, np.float32)).wait().data.tolist() == [1.0] * 4
        c.close()
        c = pc.PartialAllreduce(4, np.float32, MPI.SUM, MPI.COMM_SELF, mode="quorum", quorum=np.int8(1))
        c.close()
        s = pc.Schedule(MPI.COMM_SELF)
        a, b = np.zeros(2), np.zeros(2)
        s.nop(after=[s.send(a, np.int64(0)), s.recv(b, np.int32(0))], need=np.int64(2))
        s.commit().start().wait()
        print("surface ok")
    """)
    assert p.returncode == 0 and "surface ok" in p.stdout, p.stdout + p.stderr


def test_public_surface_integers_and_info():
    """Every integer argument goes through one helper (NumPy integers in, floats and bools
    out, ranges checked), also for dry-built schedules and pc.candidates; info() strips the
    NUL Open MPI counts in MPI_Get_library_version's length."""
    p = run_py("""
        import numpy as np
        from mpi4py import MPI
        import partialcoll as pc

        def rejects(fn, *args, **kw):
            try:
                fn(*args, **kw)
            except pc.ArgumentError:
                return
            raise SystemExit(f"{fn.__name__}{args}{kw} was accepted")

        s = pc.Schedule(rank=np.int64(2), size=np.int32(3))
        assert (s.rank, s.size) == (2, 3) and type(s.rank) is int
        rejects(pc.Schedule, rank=1.5, size=3)
        rejects(pc.Schedule, rank=3, size=3)
        rejects(pc.Schedule, rank=0, size=True)
        rejects(pc.Schedule, rank=0, size=0)
        s.nop(after=[s.nop(), s.nop()], need=np.int8(1))
        rejects(s.nop, after=[s.nop()], need=2)
        rejects(s.nop, after=[s.nop()], need=1.0)
        rejects(s.send, np.zeros(1), 1.0)
        rejects(s.recv, np.zeros(1), np.int64(3))
        assert pc.candidates(np.uint64(7), np.int64(4), np.int32(5), np.int8(2)) == pc.candidates(7, 4, 5, 2)
        rejects(pc.candidates, 7, 4.0, 5, 2)
        rejects(pc.candidates, 7, 4, 5, 6)
        rejects(pc.PartialAllreduce, 4.0, np.float32, MPI.SUM, MPI.COMM_SELF)
        rejects(pc.PartialAllreduce, 4, np.float32, MPI.SUM, MPI.COMM_SELF, seed=1.5)
        rejects(pc.PartialAllreduce, 4, np.float32, MPI.SUM, MPI.COMM_SELF, max_staleness=np.bool_(True))

        for text in ["Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6\\x00",
                     "Open MPI v5.0.5, package: x\\x00\\n", "  Open MPI v5.0.5\\n\\x00",
                     "MPICH Version:  4.2.0\\nMPICH Release date: ...\\n"]:
            MPI.Get_library_version = lambda text=text: text
            name = pc.info()["mpi_library"]
            assert "\\x00" not in name and name.startswith(("Open MPI v", "MPICH Version: 4")) \\
                and name == name.strip() and "\\n" not in name, repr(name)
        print("integers ok")
    """)
    assert p.returncode == 0 and "integers ok" in p.stdout, p.stdout + p.stderr


@pytest.mark.mpiexec
@pytest.mark.shared_job("surface_checks.py")
@pytest.mark.parametrize("nprocs", [2, 3, 5])
def test_public_surface_every_rank(mpirun, request, nprocs):
    """An unused option on one rank, or an engine OOM, raises on every rank; NumPy integers
    agree with Python ints across ranks and give MPI_Allreduce's result (in the shared job)."""
    run_shared(mpirun, request, nprocs)


def test_timeout_names_silent_peers():
    """A Timeout names the peers not heard from (Timeout.ranks); close() has a default
    timeout (pc.rc.close_timeout); with the failure query hidden nothing is reported failed."""
    p = run_py("""
        import os
        import numpy as np
        from mpi4py import MPI
        import partialcoll as pc
        assert pc.rc.close_timeout == 300.0
        os.environ["PARTIALCOLL_CLOSE_TIMEOUT"] = "1.5"      # read when rc is made
        assert type(pc.rc)().close_timeout == 1.5
        s = pc.Schedule(MPI.COMM_SELF)
        s.recv(np.zeros(1), 0)                 # no send: never heard from
        s.commit()
        try:
            s.start().wait(timeout=0.3)
        except pc.Timeout as exc:
            assert exc.ranks == (0,) and "no message from rank 0" in str(exc), (exc.ranks, str(exc))
            print("named")
        e = pc.MPIError("x", ranks=[3])
        assert e.ranks == (3,) and pc.Timeout("y").ranks == ()
        pc.finalize()
    """)
    assert p.returncode == 0 and "named" in p.stdout, p.stdout + p.stderr


def test_report_heard_as_a_wait_times_out_is_a_peer_error():
    """A wait whose deadline passes just as a peer's report is heard raises the PeerError,
    never a Timeout that names nobody: the report withdraws the armed round, after which
    the engine finds no peer missing in it. Here the report lands between the last slice
    and the question which peers were silent (as on a loaded node, where a survivor of a
    rank that never posts timed out while another survivor reported its own Timeout)."""
    p = run_py("""
        from partialcoll import _status
        import partialcoll as pc

        heard = []                  # the engine's state: has the report been heard?
        def look():                 # what the engine says; the report lands right after
            was = bool(heard)       # the first look (on a loaded node: any moment)
            heard.append(1)
            return was
        def silent():               # the armed round: withdrawn once the report was heard
            return "round 7", () if look() else (0,)
        def peer_error():
            if not look():
                raise pc.StateError("no peer reported an error")
            return 2, "Timeout", "round 7 did not complete"
        class Quiet(_status.Peers):
            def failed(self):
                return ()
        for lands_before in (False, True):
            heard[:] = [1] if lands_before else []
            peers = Quiet(None, 1, silent, peer_error)
            try:
                _status.wait_in_slices(lambda s: _status.TIMEOUT_CODE, 0.0, peers=peers, what="round 7")
            except pc.PeerError as exc:
                assert exc.rank == 2 and exc.exc_type == "Timeout", (exc.rank, exc.exc_type)
            else:
                raise AssertionError("no exception")
        print("peer error")
    """)
    assert p.returncode == 0 and "peer error" in p.stdout, p.stdout + p.stderr


def test_c_api_checks_its_caller():
    """The engine's C API checks what the caller passes: a collective's mask size, and
    every op's slot offset and length against the slot's size."""
    p = run_py("""
        from mpi4py import MPI
        import numpy as np, partialcoll as pc
        from partialcoll import _engine
        ffi, lib = _engine.ffi, _engine.lib
        _engine.ensure_started()
        ident = np.zeros(1, np.float32)
        spec = ffi.new("pc_collspec *", {"mode": lib.PC_MODE_SOLO, "late": lib.PC_LATE_LATEST,
            "mask_words": 2, "dtype": lib.PC_DT_FLOAT32, "redop": lib.PC_OP_SUM, "count": 4,
            "identity": ffi.cast("void *", ident.ctypes.data)})
        out = ffi.new("pc_coll **")
        comm = _engine.comm_handle(MPI.COMM_SELF)
        assert lib.pc_coll_create(spec, comm, out) == lib.PC_ERR_ARG
        assert "mask_words" in ffi.string(lib.pc_last_error()).decode()
        spec.mask_words = lib.pc_coll_mask_words(1)
        assert lib.pc_coll_create(spec, comm, out) == 0
        op = ffi.new("pc_opspec[1]")
        op[0].kind, op[0].peer, op[0].nbytes, op[0].need = lib.PC_SEND, 0, 16, 0
        op[0].slot[0], op[0].off[0] = lib.PC_SLOT_WORK, 8          # 8 + 16 > 16 bytes of work
        s = ffi.new("pc_sched **")
        assert lib.pc_sched_create(comm, 1, op, 0, ffi.new("int[1]"), out[0], 0, 1, s) == lib.PC_ERR_ARG
        assert "of buffer slot" in ffi.string(lib.pc_last_error()).decode()
        op[0].off[0] = 0
        op[0].slot[0], op[0].nbytes = lib.PC_SLOT_SCRATCH, 64
        assert lib.pc_sched_create(comm, 1, op, 0, ffi.new("int[1]"), out[0], 32, 1, s) == lib.PC_ERR_ARG
        print("checked")
    """)
    assert p.returncode == 0 and "checked" in p.stdout, p.stdout + p.stderr


def test_timed_mask_words():
    """A timed collective's MASK slot: pc_coll_timed_words(P) more words (each rank's
    row of owner times, then each rank's count of decisions), checked at creation; a P
    whose words an int cannot count is -1, never an overflow."""
    p = run_py("""
        from mpi4py import MPI
        import numpy as np
        from partialcoll import _engine
        ffi, lib = _engine.ffi, _engine.lib
        _engine.ensure_started()
        assert lib.pc_coll_timed_words(1) == lib.PC_TIME_FIELDS + 1
        assert lib.pc_coll_timed_words(3) == lib.PC_TIME_FIELDS * 9 + 3
        assert lib.pc_coll_timed_words(30000) == -1
        ident = np.zeros(1, np.float32)
        spec = ffi.new("pc_collspec *", {"mode": lib.PC_MODE_FULL, "late": lib.PC_LATE_LATEST,
            "mask_words": lib.pc_coll_mask_words(1) + lib.PC_TIME_FIELDS, "timed": 1, "rebalance_every": 2,
            "dtype": lib.PC_DT_FLOAT32, "redop": lib.PC_OP_SUM, "count": 4,
            "identity": ffi.cast("void *", ident.ctypes.data)})
        out = ffi.new("pc_coll **")
        comm = _engine.comm_handle(MPI.COMM_SELF)
        assert lib.pc_coll_create(spec, comm, out) == lib.PC_ERR_ARG
        assert "pc_coll_timed_words" in ffi.string(lib.pc_last_error()).decode()
        spec.mask_words = lib.pc_coll_mask_words(1) + lib.pc_coll_timed_words(1)
        assert lib.pc_coll_create(spec, comm, out) == 0
        assert lib.pc_coll_free(out[0]) == 0
        print("checked")
    """)
    assert p.returncode == 0 and "checked" in p.stdout, p.stdout + p.stderr


def test_stall_warning_and_default_timeout():
    """pc.rc.timeout has a finite default (600 s) and pc.rc.stall_warning (60 s) a stall
    inspector: a wait still running after it logs, once, the peers not heard from
    (environment: PARTIALCOLL_TIMEOUT / PARTIALCOLL_STALL_WARNING, "none" for None)."""
    p = run_py("""
        import os
        import numpy as np
        from mpi4py import MPI
        import partialcoll as pc
        from partialcoll._rc import RC
        assert pc.rc.timeout == 600.0 and pc.rc.stall_warning == 60.0, pc.rc
        os.environ.update(PARTIALCOLL_TIMEOUT="none", PARTIALCOLL_STALL_WARNING="2.5")
        assert RC().timeout is None and RC().stall_warning == 2.5
        e = pc.PeerError("text", 2, "KeyboardInterrupt", "msg")
        assert (e.rank, e.ranks, e.exc_type, e.message) == (2, (2,), "KeyboardInterrupt", "msg")
        assert isinstance(e, pc.PartialcollError) and "PeerError" in pc.__all__
        pc.rc.stall_warning = 0.3
        s = pc.Schedule(MPI.COMM_SELF)
        s.recv(np.zeros(1), 0)                 # no send: never heard from
        s.commit()
        try:
            s.start().wait(timeout=1.2)
        except pc.Timeout:
            print("timed out")
        pc.finalize()
    """)
    warnings = [line for line in p.stderr.splitlines() if "stall warning after 0.3 s" in line]
    assert p.returncode == 0 and "timed out" in p.stdout, p.stdout + p.stderr
    assert len(warnings) == 1 and "no message from rank 0" in warnings[0], p.stderr


def test_users_hooks_still_run():
    """The failure reporting wraps the program's own sys.excepthook and threading.excepthook
    (set before its first collective): they still run, for a thread's exception and for the
    main thread's, after the report."""
    p = run_py("""
        import sys, threading
        import numpy as np
        from mpi4py import MPI
        import partialcoll as pc

        def mine(exc_type, exc, tb):
            print("MINE", exc_type.__name__, exc, flush=True)

        def mine_thread(args):
            print("MINE-THREAD", args.exc_type.__name__, args.exc_value, flush=True)

        sys.excepthook, threading.excepthook = mine, mine_thread
        coll = pc.PartialAllreduce(2, np.float64, MPI.SUM, MPI.COMM_WORLD)
        assert sys.excepthook is not mine and threading.excepthook is not mine_thread, "no report hook installed"
        t = threading.Thread(target=lambda: 1 / 0)
        t.start()
        t.join()
        raise RuntimeError("uncaught")
    """)
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "MINE-THREAD ZeroDivisionError division by zero" in p.stdout, p.stdout + p.stderr
    assert "MINE RuntimeError uncaught" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("own", [True, False], ids=["own-handler", "no-handler"])
def test_sigterm_handler_only_where_the_program_has_none(own):
    """A program's own SIGTERM handler stays (and runs: the process goes on); where it has
    none, the first collective installs one that reports, then dies of the signal."""
    p = run_py(f"""
        import os, signal
        import numpy as np
        from mpi4py import MPI
        import partialcoll as pc

        def mine(signum, frame):
            print("MINE", signum, flush=True)

        if {own}:
            signal.signal(signal.SIGTERM, mine)
        coll = pc.PartialAllreduce(2, np.float64, MPI.SUM, MPI.COMM_WORLD)
        handler = signal.getsignal(signal.SIGTERM)
        print("HANDLER", "mine" if handler is mine else "default" if handler is signal.SIG_DFL else "other", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("ALIVE", flush=True)
        coll.close()
    """)
    if own:
        assert p.returncode == 0 and "HANDLER mine" in p.stdout and "MINE 15" in p.stdout and "ALIVE" in p.stdout, \
            (p.returncode, p.stdout, p.stderr)
    else:
        assert p.returncode == -15 and "HANDLER other" in p.stdout and "ALIVE" not in p.stdout, \
            (p.returncode, p.stdout, p.stderr)
