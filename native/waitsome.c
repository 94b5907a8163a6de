/* waitsome.c -- wait until `need` of n (schedule, execution) pairs have completed:
 * MPI_Waitsome's analogue over schedules.
 *
 * Why it exists: the engine's waits cover one schedule. A neighbour collective with
 * backup workers (partialcoll/neighbor.py, Hop) runs one small receive schedule per
 * in-neighbour and iteration slot, and an iteration completes once all but b of its n
 * in-neighbours' receives have: a k-of-n wait across schedules. Polling n schedules
 * from Python would either spin a core or add a sleep's latency to every iteration;
 * this sleeps on the engine's completion signal like every other wait.
 *
 * Threads: application threads only; no lock is held while it waits (the predicate
 * reads atomics). */
#include "pc_internal.h"

typedef struct {
    int n, need;
    pc_sched *const *s;
    const int64_t *ex;
} some_arg;

/* 1 once `need` executions have completed, or any schedule failed (atomics: no lock). */
static int some_reached(void *p)
{
    const some_arg *a = p;
    int got = 0;
    for (int i = 0; i < a->n; i++) {
        if (LOAD(a->s[i]->err)) return 1;
        if (LOAD(a->s[i]->executions) > a->ex[i] && ++got >= a->need) return 1;
    }
    return got >= a->need;
}

int pc_sched_wait_some(int n, pc_sched *const *s, const int64_t *executions, int need,
                       double timeout_s, int *done)
{
    if (n < 0 || need < 0 || need > n) return fail(PC_ERR_ARG, "wait_some: need %d of %d", need, n);
    for (int i = 0; i < n; i++)
        if (!s[i]) return fail(PC_ERR_ARG, "wait_some: schedule %d is NULL", i);
    some_arg a = {n, need, s, executions};
    int rc;
    if (timeout_s == 0) {            /* a test: one progress pass where nobody else progresses */
        if (!E.threaded && LOAD(E.started)) engine_pass();
        rc = some_reached(&a) ? PC_OK : PC_ERR_TIMEOUT;
    } else {
        rc = wait_until(some_reached, &a, timeout_s);
    }
    int failed = -1;
    for (int i = 0; i < n; i++) {
        done[i] = LOAD(s[i]->executions) > executions[i];
        if (LOAD(s[i]->err) && failed < 0) failed = i;
    }
    if (failed >= 0) {
        pc_sched *f = s[failed];
        unit_lock(f->unit);          /* errmsg is written under it */
        rc = f->err ? fail_at(f->err, f->errpeer, f->errmsg) : rc;
        unit_unlock(f->unit);
    } else if (rc == PC_ERR_TIMEOUT && timeout_s != 0) {
        rc = fail(PC_ERR_TIMEOUT, "%d of %d schedule executions did not complete", need, n);
    }
    return rc;
}
