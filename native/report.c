/* report.c -- a collective's peer errors (docs/faults.md), shared by coll.c and hop.c:
 * this rank's own report to every peer, and the receive that hears a peer's (mpi.c's
 * pc_alarm). What a report heard means for rounds or iterations is the collective's
 * business; this unit only makes, sends and reads the messages.
 *
 * Threads: everything runs under the owning unit's lock, but report_flush(), which
 * takes it for each look.
 */
#include "pc_internal.h"
#include <stdio.h>
#include <string.h>
#include <time.h>

int report_listen(pc_report *r, MPI_Comm comm, uint64_t ident)
{
    return mpi_alarm_listen(&r->alarm, comm, ident);
}

int report_make(pc_report *r, int rank, const char *type, const char *message)
{
    if (r->made) return 0;
    memset(&r->mine, 0, sizeof r->mine);
    r->mine.rank = rank;
    snprintf(r->mine.type, sizeof r->mine.type, "%s", type ? type : "");
    snprintf(r->mine.message, sizeof r->mine.message, "%s", message ? message : "");
    r->made = 1;
    return 1;
}

void report_deaf(pc_report *r, int cancel)
{
    if (cancel) mpi_alarm_cancel(&r->alarm);
    else mpi_alarm_deaf(&r->alarm);
}

/* Made where no MPI call may be (a collective dropped on the garbage collector's thread):
 * the next pass sends it; E.deferred counts such reports for the reporter (kick_report). */
void report_defer(pc_report *r)
{
    if (!r->pending) {
        r->pending = 1;
        __atomic_add_fetch(&E.deferred, 1, __ATOMIC_SEQ_CST);
    }
}

static void report_undefer(pc_report *r)
{
    if (r->pending) {
        r->pending = 0;
        __atomic_sub_fetch(&E.deferred, 1, __ATOMIC_SEQ_CST);
    }
}

/* reports this process sent (one per collective: to every peer), for pc_report_counts */
static int64_t reports_sent;

int pc_report_counts(int64_t *sent, int64_t *dropped)
{
    *sent = __atomic_load_n(&reports_sent, __ATOMIC_RELAXED);
    *dropped = mpi_alarm_dropped();
    return PC_OK;
}

void report_send(pc_report *r, int64_t upto, int cancel)
{
    __atomic_add_fetch(&reports_sent, 1, __ATOMIC_RELAXED);
    report_undefer(r);
    report_deaf(r, cancel);             /* this rank is done with the collective */
    r->mine.upto = upto;
    mpi_alarm_send(&r->alarm, &r->mine);
}

int report_heard(pc_report *r)
{
    if (r->alarm.nsend) mpi_alarm_sent(&r->alarm);
    if (!mpi_alarm_heard(&r->alarm)) return 0;
    memcpy(&r->peer, r->alarm.in, sizeof r->peer);
    r->peer.type[sizeof r->peer.type - 1] = r->peer.message[sizeof r->peer.message - 1] = 0;
    return 1;
}

/* the collective's error message for the report heard (this is rank `rank`) */
void report_describe(const pc_report *r, int rank, char *buf, size_t len)
{
    snprintf(buf, len, "rank %d failed with %s: %s (this is rank %d)", r->peer.rank, r->peer.type,
             r->peer.message, rank);
}

/* the sends: eager everywhere (512 bytes), but a network may need MPI progress */
void report_flush(pc_unit *u, pc_report *r, double timeout_s)
{
    double until = now_us() + (timeout_s > 0 ? timeout_s * 1e6 : 0);
    for (;;) {
        unit_lock(u);
        int sent = mpi_alarm_sent(&r->alarm);
        unit_unlock(u);
        if (sent || now_us() >= until) return;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

/* who failed and how, where the collective failed with PC_ERR_PEER (*err, atomic):
 * pc_coll_peer_error, pc_hop_peer_error. No report: answered without the lock; else the
 * lock within a second (a thread stuck inside an MPI call on the unit, a dead peer, must
 * not hang the wait that asks: it raises its Timeout instead) */
int report_peer_error(pc_unit *u, const pc_report *r, const int *err, int *rank, char *type, int tlen,
                      char *message, int mlen)
{
    if (LOAD(*err) != PC_ERR_PEER) return fail(PC_ERR_STATE, "no peer reported an error");
    if (unit_lock_within(u, 1.0)) return PC_ERR_TIMEOUT;
    int rc = *err == PC_ERR_PEER ? PC_OK : fail(PC_ERR_STATE, "no peer reported an error");
    if (rc == PC_OK) {
        *rank = r->peer.rank;
        snprintf(type, (size_t)tlen, "%s", r->peer.type);
        snprintf(message, (size_t)mlen, "%s", r->peer.message);
    }
    unit_unlock(u);
    return rc;
}

void report_free(pc_report *r)
{
    report_undefer(r);
    mpi_alarm_free(&r->alarm);
}
