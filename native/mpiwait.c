/* mpiwait.c -- waits for requests of MPI's own: the nonblocking collectives that Python
 * starts through mpi4py (the torch process group's calls other than its engine
 * allreduce, AsyncAverager, RNA's regrouping, sync_parameters), waited for under the
 * engine's idle policy instead of MPI's spinning waits or a Python loop of tests and
 * sleeps (which answered a peer a few us late only after a sleep: 60 - 100 us in a VM).
 *
 * Threads: application threads, without the GIL (cffi releases it); no engine lock is
 * held, and nothing of the engine's state is written. MPI_Test (mpi.c) completes the
 * request in the caller's handle, which is mpi4py's. */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <sched.h>
#include <time.h>

/* Wait for a request of MPI's own (a nonblocking collective that Python made through
 * mpi4py) as wait_until waits for a round, minus the engine: test it for spin_us, then
 * between yields of the core for yield_us more where each rank of the node has a CPU
 * (or while the policy polls, or for busy_us: a large transfer moves only while it is
 * tested), then between sleeps that double from sleep_min_us to sleep_max_us, and to a
 * tenth of the time waited once that passes deep_after_us (deep_sleep_us at most). The
 * phases count from the wait's start: waited_us is how long the caller waited for it
 * before this call (Python waits in slices). No engine lock is held; *done = 1 once
 * MPI_Test completed it (MPI then set the handle, which is mpi4py's, to
 * MPI_REQUEST_NULL), else 0 after timeout_s. */
int pc_mpi_request_wait(void *request, void *status, double timeout_s, double busy_us, double waited_us,
                        int *done)
{
    const pc_idle_policy *pol = &E.policy;
    double nap_min = pol->sleep_min_us > 0 ? pol->sleep_min_us : 10.0;
    double nap_max = pol->sleep_max_us > nap_min ? pol->sleep_max_us : nap_min;
    double yield_until = pol->spin_us + (idle_core_each() ? pol->yield_us : 0);
    if (busy_us > yield_until) yield_until = busy_us;
    double start = now_us() - waited_us, deadline = start + waited_us + timeout_s * 1e6, nap = nap_min;
    *done = 0;
    for (;;) {
        int got = mpi_test_request((MPI_Request *)request, (MPI_Status *)status);
        if (got < 0) return PC_ERR_MPI;
        if (got) { *done = 1; return PC_OK; }
        double now = now_us(), idle = now - start;
        if (now >= deadline) return PC_OK;
        if (idle < pol->spin_us) continue;
        if (idle < yield_until || (idle_poll() && idle < idle_spin_bound_us())) { sched_yield(); continue; }
        double cap = nap_max;
        if (idle > pol->deep_after_us && idle / 10 > cap) {
            cap = idle / 10 < pol->deep_sleep_us ? idle / 10 : pol->deep_sleep_us;
            if (cap < nap_max) cap = nap_max;
            if (nap < cap) nap = cap;        /* a long wait (or a later slice of one) naps at once */
        }
        if (nap > cap) nap = cap;
        double us = nap < deadline - now ? nap : deadline - now;
        long long ns = (long long)(us * 1e3);
        struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
        nanosleep(&ts, NULL);
        nap *= 2;
    }
}
