"""The schedule engine under mpiexec (issue 2): every P with the progress thread, three
(odd and even) with progress inline."""
import pytest

P = [1, 2, 3, 4, 5, 8]


# the lifetime checks (lifetime_checks.py) run in the engine's job at these (P, progress):
# objects dropped without close()/free(), mid-round, with 1 MiB vectors; objects freed
# while passes run, each free meeting one (the freeing thread holds the lock 0.3 ms
# longer: PARTIALCOLL_DOOM_PAUSE_US, which the engine's other checks do not mind)
LIFETIME = {(1, "thread"), (2, "thread"), (3, "thread"), (5, "thread"), (2, "inline"), (3, "inline")}


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,progress", [(p, "thread") for p in P] + [(p, "inline") for p in (2, 3, 5)])
def test_engine_checks(mpirun, nprocs, progress):
    """engine_checks.py, and 25 random schedules (schedule_fuzz_checks.py: eager and
    rendezvous messages, computes, all/any/k gates; every buffer as running their steps
    in order, after each of three executions of the persistent schedule); and at LIFETIME's
    (P, progress) the lifetime checks, in the same job."""
    modules, env = ["engine_checks.py", "schedule_fuzz_checks.py"], {"PARTIALCOLL_PROGRESS": progress}
    if (nprocs, progress) in LIFETIME:
        modules.append("lifetime_checks.py")
        env["PARTIALCOLL_DOOM_PAUSE_US"] = "300"
    mpirun(modules, nprocs, "25", env=env, timeout=360)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [3, 8])
def test_random_schedules_spin(mpirun, nprocs):
    """The random schedules with the progress thread polling (a node with cores to spare)."""
    mpirun("schedule_fuzz_checks.py", nprocs, "25", env={"PARTIALCOLL_IDLE": "spin"}, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,tag_ub", [(2, "255"), (3, "255"), (4, "255"), (3, "2047")])
def test_small_tag_ub(mpirun, nprocs, tag_ub):
    """Version wrap-around, the per-pair message limit, and no stale match after a
    withdrawn execution, under small tag spaces (255 wraps the versions at every P; 2047,
    eight times the executions, at one)."""
    mpirun("tag_checks.py", nprocs, timeout=180, env={"PARTIALCOLL_TAG_UB": tag_ub})


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,idle", [(1, "auto"), (2, "spin"), (3, "auto"), (5, "spin"), (8, "auto")])
def test_threads(mpirun, nprocs, idle):
    """A post never waits behind another thread's wait on another collective; threads on
    their own collectives (tests/mpi/threads_checks.py): every P under one idle policy,
    each policy at several P."""
    mpirun("threads_checks.py", nprocs, timeout=180, env={"PARTIALCOLL_IDLE": idle})


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3])
def test_chunked_messages(mpirun, nprocs):
    """Messages in chunks (as past INT_MAX bytes), forced small: PARTIALCOLL_MAX_MESSAGE;
    every op x dtype (at P = 2; each op and each dtype at 3) and algorithm with messages
    of several chunks, and divisor= (the small counts, never cut, are test_allreduce.py's)."""
    mpirun("allreduce_checks.py", nprocs, "--chunked", env={"PARTIALCOLL_MAX_MESSAGE": "65521"}, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.parametrize("progress", ["thread", "inline"])
def test_failed_execution(mpirun, progress):
    """A failed execution uses up its version and drains before the schedule is freed."""
    mpirun("failure_checks.py", 2, timeout=120, env={"PARTIALCOLL_PROGRESS": progress})


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_armed_ranks_leave_cores_to_computing_ranks(mpirun, nprocs):
    """The idle policy "auto" never spins cores that a computing rank needs (under --hosts
    each emulated host looks to MPI like a node with cores to spare), nor yields one
    through busy_cap_us for a late peer."""
    mpirun("idle_checks.py", nprocs, timeout=120)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_late_peer_is_not_waited_for_yielding(mpirun, nprocs):
    """A large message keeps the engine yielding only as long as large transfers take to
    show progress, not busy_cap_us after every post of a rank whose peers are late: under
    idle "spin" here (the default policy runs it in the test above, with the other check
    of idle_checks.py)."""
    mpirun("idle_checks.py", nprocs, select=["test_a_late_peer_is_not_waited_for_yielding"], timeout=120, env={"PARTIALCOLL_IDLE": "spin"})
