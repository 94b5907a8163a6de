/* sched.c -- schedules: build the op table, run executions (fire ops whose
 * dependencies are met, complete them), test/wait/free. */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <mpi.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void *op_addr(const pc_op *op, int i) { return (char *)*op->base[i] + op->off[i]; }

void sched_fail(pc_sched *s, int op, int code, const char *what)
{
    if (s->err) return;
    int kind = op >= 0 ? s->ops[op].kind : -1;
    s->err = code;
    s->errpeer = kind == PC_SEND || kind == PC_RECV ? s->ops[op].peer : -1;
    char peer[32] = "";
    if (s->errpeer >= 0) snprintf(peer, sizeof peer, " %s rank %d", kind == PC_SEND ? "to" : "from", s->errpeer);
    snprintf(s->errmsg, sizeof s->errmsg, "schedule op %d (%s%s) failed at rank %d, execution %lld: %s",
             op, kind >= 0 ? (const char *[]){"send", "recv", "compute", "nop", "trigger", "take",
                                              "deliver"}[kind] : "-",
             peer, s->rank, (long long)s->version, what);
    if (s->coll && !s->coll->err) {
        s->coll->err = code;
        s->coll->errpeer = s->errpeer;
        memcpy(s->coll->errmsg, s->errmsg, sizeof s->errmsg);
    }
    sched_withdraw(s);      /* the buffers stay in use until what is posted has drained */
    notify_done();
}

/* Stop an execution: no op fires any more, receives are cancelled, sends complete;
 * the progress pass takes it off the running list once nothing is in flight. */
void sched_withdraw(pc_sched *s)
{
    if (!s->running || s->draining) return;
    s->draining = 1;
    mpi_cancel_recvs(s);
}

/* [progress] A draining execution: once nothing is in flight it stops running (its
 * version is used up: the next execution never reuses it) and, if doomed, is freed.
 * Returns 1 if s was freed. Called only where nothing else holds s. */
int sched_drain(pc_sched *s)
{
    if (mpi_drain(s) > 0) return 0;
    s->running = 0;
    s->draining = 0;
    running_remove(s);
    if (!s->coll) s->executions++;
    notify_done();
    if (s->doomed && !s->coll) { sched_destroy(s); return 1; }
    return 0;
}

void sched_destroy(pc_sched *s)
{
    free(s->ops); free(s->succ_store); free(s->stack); free(s->reqs); free(s->req_op);
    free(s->done_idx); free(s->finished); free(s->statuses); free(s->scratch); free(s->sent); free(s);
}

/* ------------------------------------------------------------------ execution */
static int op_fire(pc_sched *s, int i);

/* Mark op i complete and fire every successor whose need is met (iteratively). */
int op_complete(pc_sched *s, int first)
{
    int top = 0;
    s->stack[top++] = first;
    while (top > 0) {
        int i = s->stack[--top];
        pc_op *op = &s->ops[i];
        op->state = ST_DONE;
        if (op->kind != PC_TRIGGER) s->remaining--;
        for (int k = 0; k < op->nsucc; k++) {
            pc_op *n = &s->ops[op->succ[k]];
            if (++n->got == n->need && n->state == ST_IDLE) {
                int rc = op_fire(s, op->succ[k]);
                if (rc > 0) return rc;
                if (rc == -1) s->stack[top++] = op->succ[k];  /* completed at once */
            }
        }
    }
    return PC_OK;
}

/* Start op i. Returns -1 if it completed at once (local ops), 0 if in flight, >0 on error. */
static int op_fire(pc_sched *s, int i)
{
    pc_op *op = &s->ops[i];
    int rc;
    op->state = ST_FIRED;
    switch (op->kind) {
    case PC_SEND: case PC_RECV:
        return mpi_post(s, i);
    case PC_COMPUTE:
        rc = op->divisor != 0
             ? pc_reduce_div(op->redop, op->dtype, op_addr(op, 0), op_addr(op, 1), op_addr(op, 2), op->count, op->divisor)
             : pc_reduce_local(op->redop, op->dtype, op_addr(op, 0), op_addr(op, 1), op_addr(op, 2), op->count);
        if (rc) { sched_fail(s, i, rc, pc_last_error()); return rc; }
        return -1;
    case PC_TAKE:
        s->live = 1;           /* the round has read this rank's input: data moves now */
        rc = coll_take(s->coll);
        if (rc) { sched_fail(s, i, rc, pc_last_error()); return rc; }
        return -1;
    case PC_DELIVER:
        rc = coll_deliver(s->coll);
        if (rc) { sched_fail(s, i, rc, pc_last_error()); return rc; }
        return -1;
    case PC_TRIGGER:
        op->state = ST_IDLE;   /* only pc_coll fires triggers */
        return 0;
    default:
        return -1;             /* NOP */
    }
}

void sched_check_done(pc_sched *s)
{
    if (!s->running || s->err || s->remaining > 0) return;
    s->running = 0;
    running_remove(s);
    s->executions++;
    if (s->coll) coll_round_done(s->coll);
    notify_done();
}

/* Begin one execution with the given version: reset the ops, fire those without deps. */
int sched_begin(pc_sched *s, int64_t version)
{
    if (s->running) return fail(PC_ERR_STATE, s->draining ? "the previous execution failed and is still draining"
                                                        : "schedule is already running");
    s->version = version;
    s->remaining = s->nrequired;
    s->err = 0;
    s->nreq = 0;
    s->inflight_big = 0;
    s->live = s->coll == NULL;
    for (int i = 0; i < s->nops; i++) { s->ops[i].got = 0; s->ops[i].state = ST_IDLE; }
    s->running = 1;
    running_add(s);
    for (int i = 0; i < s->nops && !s->err; i++) {
        pc_op *op = &s->ops[i];
        if (op->need == 0 && op->state == ST_IDLE && op->kind != PC_TRIGGER) {
            int rc = op_fire(s, i);
            if (rc == -1) rc = op_complete(s, i);
            if (rc > 0) return rc;
        }
    }
    sched_check_done(s);
    kick_lazy();
    return s->err ? fail_at(s->err, s->errpeer, s->errmsg) : PC_OK;
}


/* ------------------------------------------------------------------ schedules */
int pc_sched_create(void *comm_handle, int nops, const pc_opspec *spec, int nedges, const int *edges,
                    pc_coll *coll, int64_t scratch_bytes, pc_sched **out)
{
    if (nops < 0 || nedges < 0 || scratch_bytes < 0) return fail(PC_ERR_ARG, "negative op, edge or scratch count");
    pc_sched *s = calloc(1, sizeof *s);
    if (!s) return fail(PC_ERR_NOMEM, "out of memory");
    s->comm = *(MPI_Comm *)comm_handle;
    if (mpi_comm_info(s->comm, &s->rank, &s->size)) { free(s); return PC_ERR_MPI; }
    pc_tag_bits(comm_handle, &s->seqbits, &s->vbits);
    s->nops = nops;
    s->coll = coll;
    s->trigger_op = -1;
    s->ops = calloc((size_t)nops + 1, sizeof(pc_op));
    s->succ_store = calloc((size_t)nedges + 1, sizeof(int));
    s->stack = calloc((size_t)nops + 1, sizeof(int));
    s->reqs = calloc((size_t)nops + 1, sizeof(MPI_Request));
    s->req_op = calloc((size_t)nops + 1, sizeof(int));
    s->done_idx = calloc((size_t)nops + 1, sizeof(int));
    s->finished = calloc((size_t)nops + 1, sizeof(int));
    s->statuses = calloc((size_t)nops + 1, sizeof(MPI_Status));
    s->scratch = calloc((size_t)scratch_bytes + 1, 1);
    int *sendseq = calloc((size_t)s->size, sizeof(int)), *recvseq = calloc((size_t)s->size, sizeof(int));
    int rc = PC_OK;
    if (!s->ops || !s->succ_store || !s->stack || !s->reqs || !s->req_op || !s->done_idx || !s->finished
        || !s->statuses || !s->scratch
        || !sendseq || !recvseq) {
        rc = fail(PC_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < nops && rc == PC_OK; i++) {
        const pc_opspec *p = &spec[i];
        pc_op *op = &s->ops[i];
        op->kind = p->kind; op->peer = p->peer; op->dtype = p->dtype; op->redop = p->redop;
        op->need = p->need; op->count = p->count; op->nbytes = p->nbytes;
        op->divisor = p->kind == PC_COMPUTE && p->divisor != 1 ? p->divisor : 0;
        for (int b = 0; b < 3; b++) {
            op->own[b] = p->ptr[b];
            op->off[b] = p->off[b];
            op->base[b] = &op->own[b];
            if (p->slot[b] == PC_SLOT_SCRATCH) {
                if (p->off[b] < 0 || p->off[b] > scratch_bytes) { rc = fail(PC_ERR_ARG, "op %d: scratch offset out of range", i); break; }
                op->base[b] = &s->scratch;
            } else if (p->slot[b] != PC_SLOT_NONE) {
                if (!coll) { rc = fail(PC_ERR_ARG, "op %d uses a collective's buffer slot without a collective", i); break; }
                op->base[b] = p->slot[b] == PC_SLOT_WORK ? &coll->work_slot : &coll->mask_slot;
            }
        }
        if (p->kind < PC_SEND || p->kind > PC_DELIVER)
            rc = fail(PC_ERR_ARG, "op %d: unknown kind %d", i, p->kind);
        else if ((p->kind == PC_SEND || p->kind == PC_RECV) && (p->peer < 0 || p->peer >= s->size))
            rc = fail(PC_ERR_ARG, "op %d: peer %d out of range for a communicator of size %d (this is rank %d)",
                      i, p->peer, s->size, s->rank);
        else if ((p->kind == PC_SEND || p->kind == PC_RECV) && (p->nbytes < 0 || p->nbytes > INT_MAX))
            rc = fail(PC_ERR_ARG, "op %d: message of %lld bytes (at most %d)", i, (long long)p->nbytes, INT_MAX);
        else if (p->kind == PC_COMPUTE && !pc_op_valid(p->redop, p->dtype))
            rc = fail(PC_ERR_DTYPE_OP, "op %d: reduction op %d is not defined for dtype %d", i, p->redop, p->dtype);
        else if (op->divisor != 0 && (!pc_div_valid(p->redop, p->dtype) || !isfinite(op->divisor)))
            rc = fail(PC_ERR_DTYPE_OP, "op %d: a divisor (%g) needs SUM or COPY of a real floating dtype, not op %d "
                      "on dtype %d", i, op->divisor, p->redop, p->dtype);
        else if ((p->kind == PC_TRIGGER || p->kind == PC_TAKE || p->kind == PC_DELIVER) && !coll)
            rc = fail(PC_ERR_ARG, "op %d: trigger/take/deliver ops need a partial collective", i);
        else if (p->kind == PC_TRIGGER && s->trigger_op >= 0)
            rc = fail(PC_ERR_ARG, "op %d: a schedule has at most one trigger", i);
        if (rc) break;               /* a rejected op's fields (its peer) are not used */
        if (p->kind == PC_TRIGGER) s->trigger_op = i;
        else s->nrequired++;
        if (p->kind == PC_SEND) op->tag_seq = sendseq[p->peer]++;
        if (p->kind == PC_RECV) op->tag_seq = recvseq[p->peer]++;
        if ((p->kind == PC_SEND || p->kind == PC_RECV) && op->tag_seq >= (1 << s->seqbits))
            rc = fail(PC_ERR_ARG, "op %d: more than %d messages between ranks %d and %d in one schedule "
                      "(MPI_TAG_UB of this MPI leaves %d bits for them)", i, 1 << s->seqbits, s->rank, p->peer,
                      s->seqbits);
    }
    if (rc) goto out;
    /* successor lists (CSR) from the edges (pred -> succ) */
    int *cnt = s->stack;
    memset(cnt, 0, sizeof(int) * (size_t)(nops + 1));
    for (int e = 0; e < nedges; e++) {
        int a = edges[2 * e], b = edges[2 * e + 1];
        if (a < 0 || a >= nops || b < 0 || b >= nops || a == b) { rc = fail(PC_ERR_ARG, "bad edge %d -> %d", a, b); goto out; }
        cnt[a]++;
    }
    int acc = 0;
    for (int i = 0; i < nops; i++) { s->ops[i].succ = s->succ_store + acc; acc += cnt[i]; s->ops[i].nsucc = 0; }
    for (int e = 0; e < nedges; e++) {
        pc_op *a = &s->ops[edges[2 * e]];
        a->succ[a->nsucc++] = edges[2 * e + 1];
    }
    memset(cnt, 0, sizeof(int) * (size_t)(nops + 1));
    for (int e = 0; e < nedges; e++) cnt[edges[2 * e + 1]]++;
    /* A round whose TAKE follows its TRIGGER alone (a full round) cannot advance before a
     * local post or close, both of which kick the engine: it needs no polling until then. */
    for (int e = 0; e < nedges; e++) {
        int a = edges[2 * e], b = edges[2 * e + 1];
        if (s->ops[b].kind == PC_TAKE && cnt[b] == 1 && s->ops[a].kind == PC_TRIGGER) s->needs_trigger = 1;
    }
    for (int i = 0; i < nops; i++) {
        int npred = cnt[i];
        pc_op *op = &s->ops[i];
        if (op->kind == PC_TRIGGER) { op->need = INT_MAX; continue; }
        if (op->need < 0 || op->need > npred || (npred > 0 && op->need == 0)) {
            rc = fail(PC_ERR_ARG, "op %d: need %d of %d dependencies", i, op->need, npred);
            goto out;
        }
    }
out:
    free(sendseq); free(recvseq);
    if (rc) { pc_sched_free(s); return rc; }
    *out = s;
    return PC_OK;
}

/* Start the next execution; *execution is its index (read under the lock, so a request
 * is never bound to the previous execution). */
int pc_sched_start(pc_sched *s, int64_t *execution)
{
    app_lock();
    int rc;
    if (s->draining && !s->coll) sched_drain(s);     /* a failed execution may be done draining */
    *execution = s->executions;
    if (!E.started) rc = fail(PC_ERR_STATE, "the engine is not running (partialcoll.finalize was called)");
    else if (s->coll) rc = fail(PC_ERR_STATE, "this schedule belongs to a partial collective");
    else rc = sched_begin(s, s->executions);
    app_unlock();
    return rc;
}

typedef struct { pc_sched *s; int64_t execution; } sched_wait_arg;

static int sched_reached(void *p)
{
    sched_wait_arg *a = p;
    return a->s->err || a->s->executions > a->execution;
}

int pc_sched_test(pc_sched *s, int64_t execution, int *done)
{
    app_lock();
    sched_wait_arg a = {s, execution};
    if (!sched_reached(&a)) engine_progress_locked();    /* as MPI_Test: see pc_coll_test */
    *done = sched_reached(&a);
    int rc = s->err ? fail_at(s->err, s->errpeer, s->errmsg) : PC_OK;
    app_unlock();
    return rc;
}

int pc_sched_wait(pc_sched *s, int64_t execution, double timeout_s)
{
    int rc0 = app_lock_within(timeout_s < 0 ? -1 : timeout_s + LOCK_GRACE_S);
    if (rc0) return rc0;
    sched_wait_arg a = {s, execution};
    int rc = wait_until(sched_reached, &a, timeout_s);
    if (rc == PC_OK && s->err) rc = fail_at(s->err, s->errpeer, s->errmsg);
    else if (rc == PC_ERR_TIMEOUT)
        rc = fail(PC_ERR_TIMEOUT, "schedule execution %lld did not complete (rank %d; %d messages in flight)",
                  (long long)execution, s->rank, s->nreq);
    app_unlock();
    return rc;
}

int pc_sched_silent(pc_sched *s, int *ranks, int max, int *n)
{
    *n = 0;
    if (app_lock_within(LOCK_GRACE_S)) return PC_OK;     /* busy inside MPI: nobody named */
    *n = mpi_silent_peers(s, ranks, max);
    app_unlock();
    return PC_OK;
}

int64_t pc_sched_executions(pc_sched *s)
{
    app_lock();
    int64_t n = s->executions;
    app_unlock();
    return n;
}

int pc_sched_free(pc_sched *s)
{
    if (!s) return PC_OK;
    app_lock();
    if (s->draining && !s->coll) sched_drain(s);     /* a failed execution may be done draining */
    int rc = s->coll ? fail(PC_ERR_STATE, "this schedule belongs to a partial collective (pc_coll_free frees it)")
           : s->running ? fail(PC_ERR_STATE, s->draining ? "cannot free a schedule while its failed execution drains"
                                                         : "cannot free a running schedule")
           : PC_OK;
    if (rc == PC_OK) sched_destroy(s);
    app_unlock();
    return rc;
}

/* A schedule dropped by its owner: free it now if it is idle, otherwise withdraw its
 * execution and free it once nothing it posted is in flight (never before). */
int pc_sched_abandon(pc_sched *s, int *deferred)
{
    *deferred = 0;
    if (!s) return PC_OK;
    app_lock();
    int rc = PC_OK;
    if (s->coll) rc = fail(PC_ERR_STATE, "this schedule belongs to a partial collective");
    else if (!s->running) sched_destroy(s);
    else { s->doomed = 1; *deferred = 1; sched_withdraw(s); kick(); }
    app_unlock();
    return rc;
}
