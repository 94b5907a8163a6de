/* sched.c -- schedules: build the op table, run executions (fire ops whose
 * dependencies are met, complete them), test/wait/free. Messages go through mpi.c;
 * a partial collective's TAKE and DELIVER ops call back into their owner (pc_owner).
 * Every function here runs under the schedule's unit lock unless it says otherwise. */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <mpi.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void *op_addr(const pc_op *op, int i) { return (char *)*op->base[i] + op->off[i]; }

static const char *const KIND_NAMES[] = {"send", "recv", "compute", "nop", "trigger", "take", "deliver"};

void sched_fail(pc_sched *s, int op, int code, const char *what)
{
    if (s->err) return;
    int kind = op >= 0 ? s->ops[op].kind : -1;
    s->errpeer = kind == PC_SEND || kind == PC_RECV ? s->ops[op].peer : -1;
    char peer[32] = "";
    if (s->errpeer >= 0) snprintf(peer, sizeof peer, " %s rank %d", kind == PC_SEND ? "to" : "from", s->errpeer);
    snprintf(s->errmsg, sizeof s->errmsg, "schedule op %d (%s%s) failed at rank %d, execution %lld: %s",
             op, kind >= 0 ? KIND_NAMES[kind] : "-", peer, s->msgs.rank, (long long)s->version, what);
    STORE(s->err, code);
    if (s->owner) s->owner->failed(s->owner, code, s->errpeer, s->errmsg);
    sched_withdraw(s);      /* the buffers stay in use until what is posted has drained */
    notify_done();
}

/* A message of busy_bytes or more is in flight in a live execution: it may be moving,
 * and a large transfer needs polling (SF_BUSY). */
static int sched_busy(const pc_sched *s) { return s->live && s->msgs.big > 0; }

void sched_publish(pc_sched *s)
{
    int f = 0;
    if (s->running && (s->draining || s->msgs.n > 0)) {
        f |= SF_INFLIGHT;
        /* a full round waiting for this rank's post cannot advance before it: no polling */
        if (s->draining || !s->needs_trigger || !s->owner
            || (s->trigger_op >= 0 && s->ops[s->trigger_op].state == ST_DONE))
            f |= SF_POLLABLE;
        if (sched_busy(s)) f |= SF_BUSY;
    }
    engine_set_flags(s, f);
}

/* Stop an execution: no op fires any more, receives are cancelled, sends complete;
 * a progress pass takes it off the running list once nothing is in flight. */
void sched_withdraw(pc_sched *s)
{
    if (!s->running || s->draining) return;
    s->draining = 1;
    mpi_cancel_recvs(&s->msgs, s->is_recv);
    sched_publish(s);
}

/* A draining execution: once nothing is in flight it stops running (its version is
 * used up: the next execution never reuses it). */
static int sched_drain(pc_sched *s)
{
    if (mpi_drain(&s->msgs) > 0) return 0;
    STORE(s->running, 0);
    s->draining = 0;
    running_remove(s);
    if (!s->owner) STORE(s->executions, s->executions + 1);
    sched_publish(s);
    notify_done();
    return 1;
}

void sched_destroy(pc_sched *s)
{
    engine_set_flags(s, 0);                  /* no longer counted as running (engine_flags) */
    free(s->timers);
    free(s->ops); free(s->succ_store); free(s->stack); free(s->is_recv); free(s->op_bytes);
    mpi_free_msgs(&s->msgs);
    if (!s->msgs.lost) free(s->scratch);     /* else MPI may still write into it: kept */
    if (s->unit == &s->own) pthread_mutex_destroy(&s->own.lock);
    free(s);
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
        if (op->kind == PC_RECV && s->ntimers) op->t_us = now_us();
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
        if (s->ntimers) op->t_us = now_us();
        rc = mpi_post(&s->msgs, i, op->kind == PC_SEND, op_addr(op, 0), op->nbytes, op->peer,
                      mpi_tag(&s->msgs, s->version, op->tag_seq), E.policy.busy_bytes);
        if (rc) sched_fail(s, i, rc, pc_last_error());
        return rc;
    case PC_COMPUTE:
        rc = op->divisor != 0
             ? pc_reduce_div(op->redop, op->dtype, op_addr(op, 0), op_addr(op, 1), op_addr(op, 2), op->count, op->divisor)
             : pc_reduce_local(op->redop, op->dtype, op_addr(op, 0), op_addr(op, 1), op_addr(op, 2), op->count);
        if (rc) { sched_fail(s, i, rc, pc_last_error()); return rc; }
        return -1;
    case PC_TAKE:
        s->live = 1;           /* the round has read this rank's input: data moves now */
        rc = s->owner->take(s->owner);
        if (rc) { sched_fail(s, i, rc, pc_last_error()); return rc; }
        return -1;
    case PC_DELIVER:
        rc = s->owner->deliver(s->owner);
        if (rc) { sched_fail(s, i, rc, pc_last_error()); return rc; }
        return -1;
    case PC_TRIGGER:
        op->state = ST_IDLE;   /* only the owner fires triggers (sched_fire_trigger) */
        return 0;
    default:
        return -1;             /* NOP */
    }
}

void sched_check_done(pc_sched *s)
{
    if (!s->running || s->err || s->remaining > 0) return;
    STORE(s->running, 0);
    running_remove(s);
    STORE(s->executions, s->executions + 1);
    sched_publish(s);
    if (s->owner) s->owner->done(s->owner, s);
    notify_done();
}

int sched_fire_trigger(pc_sched *s)
{
    s->ops[s->trigger_op].state = ST_FIRED;
    int rc = op_complete(s, s->trigger_op);
    sched_check_done(s);
    sched_publish(s);
    return rc;
}

/* [pass] One step: test the messages in flight, complete their ops; finish a withdrawal. */
int sched_progress(pc_sched *s)
{
    if (!s->running) return 0;
    if (s->draining) return sched_drain(s);
    int ndone = 0, failed = -1, big = sched_busy(s);
    int rc = mpi_test(&s->msgs, s->op_bytes, s->is_recv, &ndone, &failed, E.policy.busy_bytes);
    if (rc) {
        sched_fail(s, failed, rc, pc_last_error());
        return 1;
    }
    if (ndone == 0) return 0;
    double gap = note_event();
    if (big) idle_note_busy_gap(gap);      /* how long a large message took to show progress */
    /* copy first: completing ops may post (and test) new requests */
    int done[ndone];
    memcpy(done, s->msgs.done, sizeof(int) * (size_t)ndone);
    for (int k = 0; k < ndone && !s->err; k++) op_complete(s, done[k]);
    sched_check_done(s);
    sched_publish(s);
    return 1;
}

/* Begin one execution with the given version: reset the ops, fire those without deps.
 * now: the event's clock, as kick_lazy's. */
int sched_begin_at(pc_sched *s, int64_t version, double now)
{
    if (s->running) return fail(PC_ERR_STATE, s->draining ? "the previous execution failed and is still draining"
                                                        : "schedule is already running");
    if (s->msgs.cancelled)
        return fail(PC_ERR_STATE, "an execution of this schedule was withdrawn with receives cancelled: a peer's "
                    "message for it may still arrive and would match a later execution; build a new schedule "
                    "(it runs on its own communicator)");
    s->version = version;
    s->remaining = s->nrequired;
    STORE(s->err, 0);
    s->msgs.big = 0;
    s->live = s->owner == NULL;
    for (int i = 0; i < s->nops; i++) { s->ops[i].got = 0; s->ops[i].state = ST_IDLE; }
    STORE(s->running, 1);
    running_add(s);
    for (int i = 0; i < s->nops && !s->err; i++) {
        pc_op *op = &s->ops[i];
        if (op->need == 0 && op->state == ST_IDLE && op->kind != PC_TRIGGER) {
            int rc = op_fire(s, i);
            if (rc == -1) rc = op_complete(s, i);
            if (rc > 0) break;
        }
    }
    sched_check_done(s);
    sched_publish(s);
    kick_lazy(now);
    return s->err ? fail_at(s->err, s->errpeer, s->errmsg) : PC_OK;
}

int sched_begin(pc_sched *s, int64_t version) { return sched_begin_at(s, version, 0); }


/* ------------------------------------------------------------------ schedules */
static void sched_unit_destroy(pc_unit *u)
{
    sched_destroy((pc_sched *)((char *)u - offsetof(pc_sched, own)));
}

static void sched_unit_abandon(pc_unit *u)
{
    sched_withdraw((pc_sched *)((char *)u - offsetof(pc_sched, own)));
}

/* The bytes op i's buffer b covers, for the range check of slot buffers. */
static int64_t op_span(const pc_opspec *p, int b)
{
    if (p->kind == PC_SEND || p->kind == PC_RECV) return b == 0 ? p->nbytes : 0;
    if (p->kind == PC_COMPUTE && p->dtype >= 0 && p->dtype < PC_DT_COUNT && p->count >= 0)
        return (b == 1 && p->redop == PC_OP_COPY) ? 0 : p->count * (int64_t)pc_dt_size[p->dtype];
    return 0;
}

int pc_sched_create(void *comm_handle, int nops, const pc_opspec *spec, int nedges, const int *edges,
                    pc_coll *coll, int64_t scratch_bytes, int pairs, pc_sched **out)
{
    return sched_create(comm_handle, nops, spec, nedges, edges, coll ? &coll->owner : NULL, scratch_bytes, pairs, out);
}

/* A schedule, of its owner's unit where owner is given (its TAKE and DELIVER call back
 * into the owner), else standalone. */
static void sched_stop(pc_sched *s, const char *why) { sched_fail(s, -1, PC_ERR_STATE, why); }
static void sched_forget(pc_sched *s) { mpi_forget(&s->msgs); }
static const pc_stepper SCHED_STEPPER = {sched_progress, sched_stop, sched_forget};

int sched_create(void *comm_handle, int nops, const pc_opspec *spec, int nedges, const int *edges,
                 pc_owner *owner, int64_t scratch_bytes, int pairs, pc_sched **out)
{
    engine_set_stepper(&SCHED_STEPPER);      /* how the progress loop runs schedules */
    if (nops < 0 || nedges < 0 || scratch_bytes < 0) return fail(PC_ERR_ARG, "negative op, edge or scratch count");
    pc_sched *s = calloc(1, sizeof *s);
    if (!s) return fail(PC_ERR_NOMEM, "out of memory");
    MPI_Comm comm = *(MPI_Comm *)comm_handle;
    int rank, size, rc = mpi_comm_info(comm, &rank, &size);
    if (rc) { free(s); return rc; }
    s->owner = owner;
    s->unit = owner ? &owner->unit : &s->own;
    if (!owner) unit_init(&s->own, sched_unit_destroy, sched_unit_abandon);
    s->nops = nops;
    s->trigger_op = -1;
    s->scratch_bytes = scratch_bytes;
    s->ops = calloc((size_t)nops + 1, sizeof(pc_op));
    s->succ_store = calloc((size_t)nedges + 1, sizeof(int));
    s->stack = calloc((size_t)nops + 1, sizeof(int));
    s->is_recv = calloc((size_t)nops + 1, sizeof(int));
    s->op_bytes = calloc((size_t)nops + 1, sizeof(int64_t));
    s->scratch = calloc((size_t)scratch_bytes + 1, 1);
    int *sendseq = calloc((size_t)size, sizeof(int)), *recvseq = calloc((size_t)size, sizeof(int));
    int64_t nreq = 0, chunk = mpi_max_chunk();
    int maxseq = 0;
    if (!s->ops || !s->succ_store || !s->stack || !s->is_recv || !s->op_bytes || !s->scratch || !sendseq || !recvseq) {
        rc = fail(PC_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < nops && rc == PC_OK; i++) {
        const pc_opspec *p = &spec[i];
        pc_op *op = &s->ops[i];
        op->kind = p->kind; op->peer = p->peer; op->dtype = p->dtype; op->redop = p->redop;
        op->need = p->need; op->count = p->count; op->nbytes = p->nbytes;
        op->divisor = p->kind == PC_COMPUTE && p->divisor != 1 ? p->divisor : 0;
        if (p->kind < PC_SEND || p->kind > PC_DELIVER) { rc = fail(PC_ERR_ARG, "op %d: unknown kind %d", i, p->kind); break; }
        if ((p->kind == PC_SEND || p->kind == PC_RECV) && (p->peer < 0 || p->peer >= size)) {
            rc = fail(PC_ERR_ARG, "op %d: peer %d out of range for a communicator of size %d (this is rank %d)",
                      i, p->peer, size, rank);
            break;
        }
        if ((p->kind == PC_SEND || p->kind == PC_RECV) && p->nbytes < 0) {
            rc = fail(PC_ERR_ARG, "op %d: message of %lld bytes", i, (long long)p->nbytes);
            break;
        }
        if (p->kind == PC_COMPUTE && (!pc_op_valid(p->redop, p->dtype) || p->count < 0)) {
            rc = fail(PC_ERR_DTYPE_OP, "op %d: reduction op %d is not defined for dtype %d", i, p->redop, p->dtype);
            break;
        }
        for (int b = 0; b < 3; b++) {
            int64_t span = op_span(p, b);
            op->own[b] = p->ptr[b];
            op->off[b] = p->off[b];
            op->base[b] = &op->own[b];
            if (p->slot[b] == PC_SLOT_NONE) continue;
            int64_t room;
            if (p->slot[b] == PC_SLOT_SCRATCH) {
                op->base[b] = &s->scratch;
                room = scratch_bytes;
            } else if (p->slot[b] > PC_SLOT_NONE && p->slot[b] < PC_SLOT_SCRATCH && owner) {
                op->base[b] = owner->slot[p->slot[b]];
                room = owner->slot_bytes[p->slot[b]];
            } else {
                rc = fail(PC_ERR_ARG, "op %d uses buffer slot %d %s", i, p->slot[b],
                          owner ? "that does not exist" : "without a collective");
                break;
            }
            if (p->off[b] < 0 || p->off[b] > room || span > room - p->off[b]) {
                rc = fail(PC_ERR_ARG, "op %d: bytes [%lld, %lld) of buffer slot %d, which has %lld", i,
                          (long long)p->off[b], (long long)(p->off[b] + span), p->slot[b], (long long)room);
                break;
            }
        }
        if (rc) break;
        if (op->divisor != 0 && (!pc_div_valid(p->redop, p->dtype) || !isfinite(op->divisor)))
            rc = fail(PC_ERR_DTYPE_OP, "op %d: a divisor (%g) needs SUM or COPY of a real floating dtype, not op %d "
                      "on dtype %d", i, op->divisor, p->redop, p->dtype);
        else if ((p->kind == PC_TRIGGER || p->kind == PC_TAKE || p->kind == PC_DELIVER) && !owner)
            rc = fail(PC_ERR_ARG, "op %d: trigger/take/deliver ops need an owner (a partial collective)", i);
        else if (p->kind == PC_TRIGGER && s->trigger_op >= 0)
            rc = fail(PC_ERR_ARG, "op %d: a schedule has at most one trigger", i);
        if (rc) break;               /* a rejected op's fields (its peer) are not used */
        if (p->kind == PC_TRIGGER) s->trigger_op = i;
        else s->nrequired++;
        if (p->kind == PC_SEND || p->kind == PC_RECV) {
            op->tag_seq = p->kind == PC_SEND ? sendseq[p->peer]++ : recvseq[p->peer]++;
            if (op->tag_seq + 1 > maxseq) maxseq = op->tag_seq + 1;
            s->is_recv[i] = p->kind == PC_RECV;
            s->op_bytes[i] = p->nbytes;
            nreq += p->nbytes > chunk ? (p->nbytes + chunk - 1) / chunk : 1;
        }
    }
    if (rc) goto out;
    /* tags: as many sequence bits as the most messages between one pair need, agreed by
     * every rank (pairs), so that every schedule on the communicator has one tag layout */
    if (maxseq > pairs) {
        rc = fail(PC_ERR_ARG, "%d messages between rank %d and a peer, but the schedules on this communicator "
                  "were agreed to have at most %d (pairs)", maxseq, rank, pairs);
        goto out;
    }
    if ((rc = mpi_init_msgs(&s->msgs, comm, nops, nreq))) goto out;
    if ((rc = mpi_tag_bits(comm, pairs, &s->msgs.seqbits, &s->msgs.vbits))) {
        rc = fail(PC_ERR_ARG, "%s: too many messages between ranks %d and a peer", pc_last_error(), rank);
        goto out;
    }
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
    /* the receives on the longest dependency chain (Kahn's order; ops on a cycle never
     * run and are left out) */
    int *deg = malloc(sizeof(int) * (size_t)(nops + 1)), *queue = malloc(sizeof(int) * (size_t)(nops + 1));
    int *depth = calloc((size_t)(nops + 1), sizeof(int));
    if (!deg || !queue || !depth) rc = fail(PC_ERR_NOMEM, "out of memory");
    else {
        int head = 0, tail = 0;
        memcpy(deg, cnt, sizeof(int) * (size_t)nops);
        for (int i = 0; i < nops; i++) if (deg[i] == 0) queue[tail++] = i;
        while (head < tail) {
            int i = queue[head++];
            int d = depth[i] + (s->ops[i].kind == PC_RECV);
            if (d > s->hops) s->hops = d;
            for (int k = 0; k < s->ops[i].nsucc; k++) {
                int j = s->ops[i].succ[k];
                if (depth[j] < d) depth[j] = d;
                if (--deg[j] == 0) queue[tail++] = j;
            }
        }
    }
    free(deg); free(queue); free(depth);
out:
    free(sendseq); free(recvseq);
    if (rc) { sched_destroy(s); return rc; }
    *out = s;
    return PC_OK;
}

/* Start the next execution; *execution is its index (read under the lock, so a request
 * is never bound to the previous execution). */
int pc_sched_start(pc_sched *s, int64_t *execution)
{
    unit_lock(s->unit);
    int rc;
    if (s->draining && !s->owner) sched_drain(s);     /* a failed execution may be done draining */
    *execution = s->executions;
    if (!LOAD(E.started)) rc = fail(PC_ERR_STATE, "the engine is not running (partialcoll.finalize was called)");
    else if (s->owner) rc = fail(PC_ERR_STATE, "this schedule belongs to a partial collective");
    else rc = sched_begin(s, s->executions);
    unit_unlock(s->unit);
    return rc;
}

typedef struct { pc_sched *s; int64_t execution; } sched_wait_arg;

static int sched_reached(void *p)
{
    sched_wait_arg *a = p;
    return LOAD(a->s->err) || LOAD(a->s->executions) > a->execution;
}

/* The error of a finished wait, read under the unit lock (errmsg is written under it). */
static int sched_error(pc_sched *s)
{
    unit_lock(s->unit);
    int rc = s->err ? fail_at(s->err, s->errpeer, s->errmsg) : PC_OK;
    unit_unlock(s->unit);
    return rc;
}

int pc_sched_test(pc_sched *s, int64_t execution, int *done)
{
    sched_wait_arg a = {s, execution};
    if (!sched_reached(&a)) engine_pass();    /* as MPI_Test progresses */
    *done = sched_reached(&a);
    return LOAD(s->err) ? sched_error(s) : PC_OK;
}

int pc_sched_wait(pc_sched *s, int64_t execution, double timeout_s)
{
    sched_wait_arg a = {s, execution};
    int rc = wait_until(sched_reached, &a, timeout_s);
    if (rc == PC_OK && LOAD(s->err)) rc = sched_error(s);
    else if (rc == PC_ERR_TIMEOUT)
        rc = fail(PC_ERR_TIMEOUT, "schedule execution %lld did not complete (rank %d)", (long long)execution,
                  s->msgs.rank);
    return rc;
}

/* The distinct peers of s's receives still in flight, ascending; how many (at most max). */
int sched_silent_peers(const pc_sched *s, int *ranks, int max)
{
    int n = 0;
    if (!s || !s->running || s->draining) return 0;
    for (int r = 0; r < s->msgs.n; r++) {
        const pc_op *op = &s->ops[s->msgs.req_op[r]];
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

int pc_sched_silent(pc_sched *s, int *ranks, int max, int *n)
{
    *n = 0;
    if (unit_lock_within(s->unit, 1.0)) return PC_OK;     /* busy inside MPI: nobody named */
    *n = sched_silent_peers(s, ranks, max);
    unit_unlock(s->unit);
    return PC_OK;
}

int64_t pc_sched_executions(pc_sched *s) { return LOAD(s->executions); }

/* Add the bytes s sent to each peer since creation to sent[i], i < n. */
void sched_add_traffic(const pc_sched *s, int64_t *sent, int n)
{
    if (s && s->msgs.sent)
        for (int i = 0; i < n && i < s->msgs.size; i++) sent[i] += s->msgs.sent[i];
}

int pc_sched_free(pc_sched *s)
{
    if (!s) return PC_OK;
    if (s->owner) return fail(PC_ERR_STATE, "this schedule belongs to a partial collective (pc_coll_free frees it)");
    unit_lock(s->unit);
    if (s->draining) sched_drain(s);     /* a failed execution may be done draining */
    int rc = s->running ? fail(PC_ERR_STATE, s->draining ? "cannot free a schedule while its failed execution drains"
                                                         : "cannot free a running schedule")
           : PC_OK;
    if (rc == PC_OK) unit_doom(s->unit);
    unit_unlock(s->unit);
    if (rc == PC_OK) reap_units();
    return rc;
}

/* A collective's round schedule that its builder (the balancer thread) did not hand
 * over (pc_coll_switch): it had to stop. Never started and on no list, nothing else
 * points at it: freed here, without its collective's lock (which may be gone). */
int pc_sched_discard(pc_sched *s)
{
    if (!s) return PC_OK;
    if (!s->owner) return fail(PC_ERR_STATE, "pc_sched_discard is for a collective's round schedules (pc_sched_free)");
    if (s->running || s->on_list) return fail(PC_ERR_STATE, "cannot discard a schedule that has run");
    sched_destroy(s);
    return PC_OK;
}

/* A schedule dropped by its owner (possibly from a garbage collector's thread: no MPI
 * call here): freed once nothing it posted is in flight; a running execution is
 * withdrawn by the next progress pass. */
int pc_sched_abandon(pc_sched *s, int *deferred)
{
    *deferred = 0;
    if (!s) return PC_OK;
    if (s->owner) return fail(PC_ERR_STATE, "this schedule belongs to a partial collective");
    unit_lock(s->unit);
    *deferred = s->running;
    if (s->running) s->unit->withdraw = 1;
    unit_doom(s->unit);
    unit_unlock(s->unit);
    reap_units();
    if (*deferred) kick();
    return PC_OK;
}

int pc_sched_set_timers(pc_sched *s, int n, const int *triples)
{
    if (n < 0 || s->timers) return fail(PC_ERR_ARG, "timers: set once, n >= 0");
    for (int i = 0; i < n; i++) {
        int a = triples[3 * i], b = triples[3 * i + 1], o = triples[3 * i + 2];
        if (a < 0 || a >= s->nops || b < 0 || b >= s->nops || s->ops[a].kind != PC_SEND || s->ops[b].kind != PC_RECV
            || o < 0 || o >= s->msgs.size)
            return fail(PC_ERR_ARG, "timer %d: (%d, %d, owner %d) is not (send, receive, rank)", i, a, b, o);
    }
    s->timers = malloc(sizeof(int) * 3 * (size_t)(n ? n : 1));
    if (!s->timers) return fail(PC_ERR_NOMEM, "out of memory");
    memcpy(s->timers, triples, sizeof(int) * 3 * (size_t)n);
    s->ntimers = n;
    return PC_OK;
}
