/* mpi.c -- the one place that talks to MPI: post, test, cancel messages; tag bits;
 * communicator queries; failed peers. Everything here runs with E.lock held, except
 * pc_comm_failed(). */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <mpi.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>


/* MPIX_Query_cuda_support() of the loaded libmpi (MPICH >= 4, Open MPI), looked up at
 * run time so that the engine loads with any MPI: 1 CUDA-aware, 0 not, -1 no such query. */
int pc_mpi_cuda_support(void)
{
    int (*query)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "MPIX_Query_cuda_support");
    return query ? (query() != 0) : -1;
}

/* MPIX_Comm_get_failed of the loaded libmpi (NULL where it has none): looked up in the
 * global scope, else in the library that defines MPI_Comm_rank. PARTIALCOLL_NO_FAILED_QUERY
 * (tests) hides it: the view of an MPI that cannot tell. */
typedef int (*get_failed_fn)(MPI_Comm, MPI_Group *);

static get_failed_fn lookup_get_failed(void)
{
    static int looked;
    static get_failed_fn fn;
    if (__atomic_load_n(&looked, __ATOMIC_ACQUIRE)) return fn;
    const char *hide = getenv("PARTIALCOLL_NO_FAILED_QUERY");
    void *sym = hide && *hide && *hide != '0' ? NULL : dlsym(RTLD_DEFAULT, "MPIX_Comm_get_failed");
    Dl_info where;
    if (!sym && !(hide && *hide && *hide != '0') && dladdr((void *)&MPI_Comm_rank, &where) && where.dli_fname) {
        void *h = dlopen(where.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (h) { sym = dlsym(h, "MPIX_Comm_get_failed"); dlclose(h); }
    }
    fn = (get_failed_fn)sym;
    __atomic_store_n(&looked, 1, __ATOMIC_RELEASE);
    return fn;
}

/* Runs without E.lock (MPI_THREAD_MULTIPLE): it must answer while the progress thread
 * may be stuck inside an MPI call towards the dead peer. */
int pc_comm_failed(void *comm_handle, int *ranks, int max, int *n)
{
    MPI_Comm comm = *(MPI_Comm *)comm_handle;
    get_failed_fn get_failed = lookup_get_failed();
    *n = -1;
    if (!get_failed) return PC_OK;
    MPI_Group failed = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    int k = 0;
    if (get_failed(comm, &failed) == MPI_SUCCESS && MPI_Group_size(failed, &k) == MPI_SUCCESS) {
        int m = k < max ? k : max;
        int idx[m > 0 ? m : 1];
        for (int i = 0; i < m; i++) idx[i] = i;
        if (m == 0 || (MPI_Comm_group(comm, &all) == MPI_SUCCESS &&
                       MPI_Group_translate_ranks(failed, m, idx, all, ranks) == MPI_SUCCESS)) {
            *n = m;
            for (int i = 1; i < m; i++)          /* ascending (few ranks: insertion sort) */
                for (int j = i; j > 0 && ranks[j - 1] > ranks[j]; j--) { int t = ranks[j]; ranks[j] = ranks[j - 1]; ranks[j - 1] = t; }
        }
    }
    if (failed != MPI_GROUP_NULL) MPI_Group_free(&failed);
    if (all != MPI_GROUP_NULL) MPI_Group_free(&all);
    return PC_OK;
}

/* The distinct peers of s's receives still in flight, ascending; how many (at most max). */
int mpi_silent_peers(const pc_sched *s, int *ranks, int max)
{
    int n = 0;
    if (!s || !s->running || s->draining) return 0;
    for (int r = 0; r < s->nreq; r++) {
        const pc_op *op = &s->ops[s->req_op[r]];
        if (op->kind != PC_RECV) continue;
        int j = n, dup = 0;
        for (int i = 0; i < n; i++) dup |= ranks[i] == op->peer;
        if (dup || n == max) continue;
        while (j > 0 && ranks[j - 1] > op->peer) { ranks[j] = ranks[j - 1]; j--; }
        ranks[j] = op->peer;
        n++;
    }
    return n;
}

static int mpi_tag(const pc_sched *s, const pc_op *op)
{
    int64_t v = s->version & ((1LL << s->vbits) - 1);
    return (int)((v << s->seqbits) | op->tag_seq);
}

static void mpi_message(int rc, char *msg)
{
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, MPI_MAX_ERROR_STRING, "MPI error %d", rc);
}

int mpi_post(pc_sched *s, int i)
{
    pc_op *op = &s->ops[i];
    if (op->kind == PC_SEND && !s->sent && !(s->sent = calloc((size_t)s->size, sizeof *s->sent))) {
        sched_fail(s, i, PC_ERR_NOMEM, "out of memory for the traffic counters");
        return PC_ERR_NOMEM;
    }
    MPI_Request *r = &s->reqs[s->nreq];
    int rc = op->kind == PC_SEND
        ? MPI_Isend(op_addr(op, 0), (int)op->nbytes, MPI_BYTE, op->peer, mpi_tag(s, op), s->comm, r)
        : MPI_Irecv(op_addr(op, 0), (int)op->nbytes, MPI_BYTE, op->peer, mpi_tag(s, op), s->comm, r);
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        mpi_message(rc, msg);
        sched_fail(s, i, PC_ERR_MPI, msg);
        return PC_ERR_MPI;
    }
    s->req_op[s->nreq++] = i;
    if (op->nbytes >= E.policy.busy_bytes) s->inflight_big++;
    if (op->kind == PC_SEND) s->sent[op->peer] += op->nbytes;
    return PC_OK;
}

/* Drop the completed (now MPI_REQUEST_NULL) requests from the schedule's list. */
static void compact(pc_sched *s)
{
    int w = 0;
    for (int r = 0; r < s->nreq; r++) {
        if (s->reqs[r] != MPI_REQUEST_NULL) { s->reqs[w] = s->reqs[r]; s->req_op[w] = s->req_op[r]; w++; }
    }
    s->nreq = w;
}

/* Test the schedule's requests; complete the ops whose messages are done. The request
 * list is compacted before any error is reported, so what stays listed is in flight. */
int mpi_test(pc_sched *s, int *ndone)
{
    int outcount = 0, bad = -1;
    char msg[MPI_MAX_ERROR_STRING + 160];
    *ndone = 0;
    if (s->nreq == 0) return PC_OK;
    /* Open MPI's MPI_Testsome looks for completed requests first and only then runs its
     * progress engine: what that progress completes is seen by the next call, which for a
     * progress thread about to sleep is a sleep later (one sleep per message hop; Fig. 9
     * initiator latency 2.7x MPICH's). So when nothing was complete, test once more. */
    int rc = MPI_SUCCESS;
    for (int pass = 0; pass < 2 && rc == MPI_SUCCESS && outcount == 0; pass++)
        rc = MPI_Testsome(s->nreq, s->reqs, &outcount, s->done_idx, s->statuses);
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {     /* no request to blame: the first */
        mpi_message(rc, msg);
        sched_fail(s, s->req_op[0], PC_ERR_MPI, msg);
        return PC_ERR_MPI;
    }
    if (outcount == MPI_UNDEFINED || outcount == 0) return PC_OK;
    /* MPI_ERR_IN_STATUS: the requests that completed with an error say so in their status;
     * the error is that request's (its op's peer is named), not the first one listed */
    int failed = -1, err = MPI_SUCCESS;
    for (int k = 0; k < outcount; k++) {
        int op = s->req_op[s->done_idx[k]];
        if (rc == MPI_ERR_IN_STATUS && failed < 0 && s->statuses[k].MPI_ERROR != MPI_SUCCESS
            && s->statuses[k].MPI_ERROR != MPI_ERR_PENDING) {
            failed = op;
            err = s->statuses[k].MPI_ERROR;
        }
        if (s->ops[op].kind == PC_RECV && bad < 0 && failed < 0) {
            int got = 0;
            if (MPI_Get_count(&s->statuses[k], MPI_BYTE, &got) != MPI_SUCCESS || got != s->ops[op].nbytes) {
                snprintf(msg, sizeof msg, "expected %lld bytes from rank %d, received %d",
                         (long long)s->ops[op].nbytes, s->ops[op].peer, got);
                bad = op;
            }
        }
        if (s->ops[op].nbytes >= E.policy.busy_bytes) s->inflight_big--;
        s->done_idx[k] = op;   /* reuse as the list of completed ops */
    }
    compact(s);
    if (rc == MPI_ERR_IN_STATUS) {
        mpi_message(failed >= 0 ? err : rc, msg);
        sched_fail(s, failed >= 0 ? failed : (s->nreq > 0 ? s->req_op[0] : s->done_idx[0]), PC_ERR_MPI, msg);
        return PC_ERR_MPI;
    }
    if (bad >= 0) {
        sched_fail(s, bad, PC_ERR_TRUNCATE, msg);
        return PC_ERR_TRUNCATE;
    }
    *ndone = outcount;
    return PC_OK;
}

/* Withdraw an execution: cancel its receives (MPI_Cancel is defined for receives in
 * every MPI; cancelling sends is deprecated and a no-op in Open MPI, so sends are left
 * to complete). mpi_drain() then completes what is left. */
void mpi_cancel_recvs(pc_sched *s)
{
    for (int r = 0; r < s->nreq; r++)
        if (s->ops[s->req_op[r]].kind == PC_RECV) MPI_Cancel(&s->reqs[r]);
}

/* Test a withdrawn execution's requests without completing ops; returns how many are
 * still in flight. */
int mpi_drain(pc_sched *s)
{
    int outcount = 0;
    if (s->nreq == 0) return 0;
    if (MPI_Testsome(s->nreq, s->reqs, &outcount, s->done_idx, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
        for (int r = 0; r < s->nreq; r++) MPI_Request_free(&s->reqs[r]);   /* the MPI gave up on them */
        s->nreq = 0;
        return 0;
    }
    compact(s);
    return s->nreq;
}

/* Forget requests that will not complete (engine stop): MPI keeps them, we no longer test them. */
void mpi_forget(pc_sched *s)
{
    for (int r = 0; r < s->nreq; r++) MPI_Request_free(&s->reqs[r]);
    s->nreq = 0;
}

int mpi_comm_info(MPI_Comm comm, int *rank, int *size)
{
    int rc = MPI_Comm_rank(comm, rank);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(comm, size);
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        mpi_message(rc, msg);
        return fail(PC_ERR_MPI, "bad communicator: %s", msg);
    }
    return PC_OK;
}

int pc_tag_bits(void *comm_handle, int *seqbits, int *vbits)
{
    MPI_Comm comm = *(MPI_Comm *)comm_handle;
    int *ub = NULL, flag = 0;
    if (MPI_Comm_get_attr(comm, MPI_TAG_UB, &ub, &flag) != MPI_SUCCESS) flag = 0;
    long long tag_ub = flag && ub ? *ub : 32767;     /* the least the standard guarantees */
    const char *forced = getenv("PARTIALCOLL_TAG_UB");  /* tests: the view of a smaller MPI */
    if (forced && atoll(forced) >= 255 && atoll(forced) < tag_ub) tag_ub = atoll(forced);
    int bits = 0;
    while (bits < 31 && (1LL << (bits + 1)) - 1 <= tag_ub) bits++;
    *seqbits = bits >= 24 ? 16 : bits - 4;   /* at least 4 bits of version */
    *vbits = bits - *seqbits;
    return PC_OK;
}

/* Bytes sent per peer (coll.traffic(), Schedule traffic): the counters of mpi_post. */
int pc_traffic(pc_coll *c, pc_sched *s, int64_t *sent, int n)
{
    if (!sent || n < 0 || (!c && !s)) return fail(PC_ERR_ARG, "pc_traffic: no collective or schedule");
    app_lock();
    int nv = c ? c->variants : 0;
    for (int k = -1; k < 2 * nv; k++) {       /* s, then every round schedule of c */
        pc_sched *t = k < 0 ? s : c->sched[k / nv][k % nv];
        if (t && t->sent)
            for (int i = 0; i < n && i < t->size; i++) sent[i] += t->sent[i];
    }
    app_unlock();
    return PC_OK;
}
