/* hop.c -- Hop's neighbour allreduce in the engine (partialcoll/neighbor.py, docs/hop.md):
 * backup workers, the local staleness bound, token queues, skipping.
 *
 * A collective is one unit (pc_hop: its lock guards everything below) that owns one-op
 * persistent schedules, its *channels*, all on one communicator (the application's
 * MPI_Comm_dup): for every in-neighbour j and slot r < R a receive RX[j][r], for every
 * out-neighbour i a send TX[i][r], and with tokens (max_gap) a token receive TRX[i][r]
 * from every out-neighbour and a token send TTX[j][r] to every in-neighbour. Iteration m
 * travels on slot m mod R, as the execution of version m: the tag carries m, so a receive
 * posted for iteration m matches the message of iteration m and no other. Tokens are
 * zero-byte messages whose version is the token's number (1, 2, ...) and whose sequence
 * number is 1 (data: 0), so the two never match each other.
 *
 * The progress thread runs every step (hop_done: the callback of a completed channel):
 *   RX of iteration m from j    check its header; keep it, or drop it if late; repost the
 *                               slot for iteration m + R; complete the iterations that are
 *                               now ready (the k-of-n wait of backup workers) by reducing
 *                               into the application's result buffer
 *   TRX from out-neighbour i    tokens[i] += 1; repost
 *   TTX, TX                     send the tokens owed, the fillers of close()
 * so the application is woken once per wait() (when its iteration is already complete:
 * not at all), never per message.
 *
 *   iteration k is ready when   at least need = n_in - backup in-neighbours j hold an
 *                               update of an iteration m in [k - s, k] (their newest)
 *   result(k) = x_k (op) u_j1 (op) ... (op) u_jn, in the order of the sources' ranks;
 *               weights MEAN: / (1 + n); STALENESS: x_k + sum w_j u_j, w_j = 1 / (1 + k - m_j),
 *               / (1 + sum w_j)
 *
 * Entering iteration k (pc_hop_post, pc_hop_skip; the application's thread) waits for a
 * token from every out-neighbour (k < g + tokens[i]), for slot k mod R's sends of
 * iteration k - R to complete and for iteration k - R to be complete here (its result
 * read x_{k-R} from that slot), then sends and grants a token to every in-neighbour. So
 * up to R requests may be outstanding.
 *
 * Calls go one way: hop.c -> sched.c (sched_create, sched_begin, sched_withdraw,
 * sched_destroy), kernels.c and progress.c's unit services; nothing calls hop.c but the
 * application (pc_hop_*) and the owner callbacks it registers on its own schedules.
 *
 * Threads: the application thread that posts, waits and closes (one at a time, as with
 * PartialAllreduce), and the progress thread (or an inline wait) running hop_done. Both
 * only under the unit lock; the waits' predicates take it for one look.
 */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RX = 0, TX = 1, TRX = 2, TTX = 3 };
enum { EMPTY = 0, POSTED = 1, FULL = 2 };
enum { F_SKIP = 1, F_FILLER = 2 };            /* header flags */
#define HDR 32                                 /* int64 iteration, data iteration, flags, sender */
#define NOLIMIT INT64_MAX

typedef struct hop_pending {     /* an iteration entered by a post, until its wait takes it */
    int64_t k;                   /* -1: free */
    void *out;                   /* the application's result buffer (written at completion) */
    int done, cancelled, nupd;
    int64_t *upd;                /* 3 n_in: (rank, iteration, arrival ns) of the updates in the result */
    int64_t entry_ns, done_ns;   /* when it was entered, when it completed (CLOCK_MONOTONIC) */
    int waited;                  /* a wait or test asked before it completed */
} hop_pending;

struct pc_hop {
    pc_owner owner;              /* first member: the unit; its lock guards every field */
    pc_hopspec spec;
    int rank, size, n_in, n_out, R, s, g, need;
    int *sources, *dests;
    size_t nbytes, msg;
    char *rx, *tx;               /* n_in x R and R messages of msg bytes (engine-owned) */
    pc_sched **ch[4];            /* RX: n_in x R, TX: n_out x R, TRX: n_out x R, TTX: n_in x R */
    int64_t *rx_iter, *rx_ns; int *rx_state, *rx_used;   /* per receive slot (n_in x R); rx_ns: arrival */
    int64_t *next_post, *post_limit, *newest;            /* per in-neighbour */
    int64_t *sent;                                       /* per out-neighbour: messages started */
    int64_t *tokens, *tk_next, *tk_limit;                /* per out-neighbour */
    int64_t *granted, *grant_to;                         /* per in-neighbour */
    int64_t owed;                /* tokens owed to every in-neighbour (before close) */
    int64_t *send_to;            /* close: fillers up to this iteration, per out-neighbour */
    int closing, draining, stopped;
    int64_t iter, done_iter;     /* last entered, last completed (or skipped) */
    hop_pending *pend;           /* R: iteration k in pend[k mod R] */
    int64_t stats[PC_HOP_STATS];
    int err, errpeer;
    char errmsg[384];
    pc_report rep;               /* peer errors: pc_hop_abort, hop_poll */
};

static pc_sched *chan(pc_hop *h, int kind, int who, int r) { return h->ch[kind][who * h->R + r]; }
static int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

static void hop_error(pc_hop *h, int code, int peer, const char *msg)
{
    if (h->err) return;
    STORE(h->err, code);
    h->errpeer = peer;
    snprintf(h->errmsg, sizeof h->errmsg, "%s", msg);
    notify_done();
}

static int hop_begin(pc_hop *h, pc_sched *s, int64_t version, int live)
{
    int rc = sched_begin(s, version);
    s->live = live;
    if (rc && !h->err) hop_error(h, rc, -1, pc_last_error());
    return rc;
}

/* ------------------------------------------------------------------ receive slots */
static void drop(pc_hop *h, int j, int r)
{
    int i = j * h->R + r;
    if (h->rx_state[i] == FULL && !h->rx_used[i] && !h->closing) {
        int64_t flags;
        memcpy(&flags, h->rx + (size_t)i * h->msg + 16, sizeof flags);
        if (!(flags & F_FILLER)) h->stats[PC_HOP_DROPPED]++;
    }
    h->rx_state[i] = EMPTY;
}

/* post the receives of in-neighbour j's next iterations into its empty slots */
static void post_rx(pc_hop *h, int j)
{
    while (!h->err && h->next_post[j] <= h->post_limit[j]) {
        int64_t m = h->next_post[j];
        int i = j * h->R + (int)(m % h->R);
        if (h->rx_state[i] != EMPTY) return;
        h->rx_iter[i] = m;
        h->rx_state[i] = POSTED;
        h->rx_used[i] = 0;
        if (hop_begin(h, h->ch[RX][i], m, 0)) return;
        STORE(h->next_post[j], h->next_post[j] + 1);
    }
}

/* Drop what can no longer be used from in-neighbour j (older than the lowest iteration
 * still to complete minus s; of the rest up to it, all but the newest), repost. */
static void recycle(pc_hop *h, int j)
{
    int64_t kcur = h->done_iter + 1, best = -1;
    int best_r = -1;
    for (int r = 0; r < h->R; r++) {
        int i = j * h->R + r;
        if (h->rx_state[i] != FULL) continue;
        int64_t m = h->rx_iter[i];
        if (h->closing || m < kcur - h->s) drop(h, j, r);
        else if (m <= kcur) {
            if (m > best) {
                if (best_r >= 0) drop(h, j, best_r);
                best = m;
                best_r = r;
            } else drop(h, j, r);
        }
    }
    post_rx(h, j);
}

static void recycle_all(pc_hop *h)
{
    int64_t held = 0;
    for (int j = 0; j < h->n_in; j++) recycle(h, j);
    for (int i = 0; i < h->n_in * h->R; i++) held += h->rx_state[i] == FULL;
    if (held > h->stats[PC_HOP_MAX_BUFFERED]) h->stats[PC_HOP_MAX_BUFFERED] = held;
}

/* ------------------------------------------------------------------ tokens */
static void post_tokens(pc_hop *h, int i)
{
    while (!h->err && h->tk_next[i] <= h->tk_limit[i]) {
        int64_t t = h->tk_next[i];
        pc_sched *s = chan(h, TRX, i, (int)((t - 1) % h->R));
        if (s->running) return;
        if (hop_begin(h, s, t, 0)) return;
        STORE(h->tk_next[i], h->tk_next[i] + 1);
    }
}

static void flush_tokens(pc_hop *h)
{
    if (!h->g) return;
    for (int j = 0; j < h->n_in && !h->err; j++) {
        int64_t target = h->grant_to ? h->grant_to[j] : h->owed;
        while (h->granted[j] < target) {
            pc_sched *s = chan(h, TTX, j, (int)(h->granted[j] % h->R));
            if (s->running || hop_begin(h, s, h->granted[j] + 1, 0)) break;
            STORE(h->granted[j], h->granted[j] + 1);
        }
    }
}

/* ------------------------------------------------------------------ completion */
/* the slot of in-neighbour j's newest update of an iteration in [k - s, k], or -1 */
static int ready_slot(pc_hop *h, int j, int64_t k)
{
    int64_t best = -1;
    int best_r = -1;
    for (int r = 0; r < h->R; r++) {
        int i = j * h->R + r;
        int64_t m = h->rx_iter[i];
        if (h->rx_state[i] == FULL && m >= k - h->s && m <= k && m > best) { best = m; best_r = r; }
    }
    return best_r;
}

/* the real view of a complex dtype: weights multiply both parts */
static void real_view(int dtype, int64_t count, int *dt, int64_t *n)
{
    *dt = dtype == PC_DT_COMPLEX64 ? PC_DT_FLOAT32 : dtype == PC_DT_COMPLEX128 ? PC_DT_FLOAT64 : dtype;
    *n = dtype == PC_DT_COMPLEX64 || dtype == PC_DT_COMPLEX128 ? 2 * count : count;
}

/* out = x_k combined with the updates in slots[0..n) (in-neighbour order) */
static int combine(pc_hop *h, int64_t k, void *out, const int *slots, int n, hop_pending *p)
{
    const char *own = h->tx + (size_t)(k % h->R) * h->msg + HDR;
    int rc = PC_OK, dt;
    int64_t cnt;
    real_view(h->spec.dtype, h->spec.count, &dt, &cnt);
    if (h->nbytes) memmove(out, own, h->nbytes);
    double wsum = 1.0;
    for (int u = 0; u < n && rc == PC_OK; u++) {
        int i = slots[u];
        const char *v = h->rx + (size_t)i * h->msg + HDR;
        int64_t m = h->rx_iter[i];
        if (h->spec.weights == PC_HOP_STALENESS) {
            double w = 1.0 / (double)(1 + k - m);
            wsum += w;
            rc = pc_axpy(dt, out, v, out, cnt, w);
        } else if (h->spec.weights == PC_HOP_MEAN && u == n - 1) {
            rc = pc_reduce_div(PC_OP_SUM, dt, out, v, out, cnt, (double)(1 + n));    /* the last sum, divided */
        } else {
            rc = pc_reduce_local(h->spec.redop, h->spec.dtype, out, v, out, h->spec.count);
        }
        h->rx_used[i] = 1;
        p->upd[3 * u] = h->sources[i / h->R];
        p->upd[3 * u + 1] = m;
        p->upd[3 * u + 2] = h->rx_ns[i];
    }
    if (rc == PC_OK && h->spec.weights == PC_HOP_STALENESS && n > 0)
        rc = pc_reduce_div(PC_OP_COPY, dt, out, out, out, cnt, wsum);
    p->nupd = n;
    return rc;
}

/* Complete every entered iteration that is ready, lowest first. */
static void complete_ready(pc_hop *h)
{
    int slots[h->n_in > 0 ? h->n_in : 1];
    while (!h->err && !h->closing && h->done_iter < h->iter) {
        int64_t k = h->done_iter + 1;
        hop_pending *p = &h->pend[k % h->R];
        int n = 0;
        for (int j = 0; j < h->n_in; j++) {
            int r = ready_slot(h, j, k);
            if (r >= 0) slots[n++] = j * h->R + r;
        }
        if (n < h->need || p->k != k) return;
        int rc = combine(h, k, p->out, slots, n, p);
        if (rc) { hop_error(h, rc, -1, pc_last_error()); return; }
        h->stats[PC_HOP_USED] += n;
        h->stats[PC_HOP_COMPLETED]++;
        if (!p->waited) h->stats[PC_HOP_EARLY]++;
        p->done_ns = (int64_t)(now_us() * 1e3);
        STORE(p->done, 1);
        STORE(h->done_iter, k);
        recycle_all(h);
        notify_done();
    }
}

/* ------------------------------------------------------------------ close: fillers */
/* Send "filler" messages, in iteration order, for the receives an out-neighbour posted
 * beyond what this rank sent; slot r is rewritten only once all its sends completed. */
static void send_fillers(pc_hop *h)
{
    if (!h->send_to) return;
    while (!h->err) {
        int64_t m = NOLIMIT;
        for (int i = 0; i < h->n_out; i++)
            if (h->sent[i] <= h->send_to[i] && h->sent[i] < m) m = h->sent[i];
        if (m == NOLIMIT) return;
        int r = (int)(m % h->R);
        for (int i = 0; i < h->n_out; i++) if (chan(h, TX, i, r)->running) return;
        int64_t hdr[4] = {m, -1, F_FILLER, h->rank};
        memcpy(h->tx + (size_t)r * h->msg, hdr, sizeof hdr);
        for (int i = 0; i < h->n_out; i++)
            if (h->sent[i] == m && h->send_to[i] >= m) {
                if (hop_begin(h, chan(h, TX, i, r), m, 1)) return;
                STORE(h->sent[i], h->sent[i] + 1);
            }
    }
}

/* ------------------------------------------------------------------ callbacks [pass] */
static void hop_done(pc_owner *o, pc_sched *s)
{
    pc_hop *h = (pc_hop *)o;
    if (h->stopped || h->err) return;
    int c = s->owner_index, kind = c & 3, who = (c >> 2) / h->R, r = (c >> 2) % h->R;
    if (kind == RX) {
        int i = who * h->R + r;
        int64_t hdr[4], m = h->rx_iter[i];
        memcpy(hdr, h->rx + (size_t)i * h->msg, sizeof hdr);
        if (hdr[0] != m || hdr[3] != h->sources[who]) {
            char msg[256];
            snprintf(msg, sizeof msg, "NeighborAllreduce: the receive for iteration %lld from rank %d got iteration "
                     "%lld from rank %lld (this is rank %d): channels out of step", (long long)m, h->sources[who],
                     (long long)hdr[0], (long long)hdr[3], h->rank);
            hop_error(h, PC_ERR_STATE, h->sources[who], msg);
            return;
        }
        h->rx_state[i] = FULL;
        h->rx_ns[i] = (int64_t)(now_us() * 1e3);   /* its arrival (who is slow: neighbor.py's stats) */
        if (hdr[2] & F_FILLER) drop(h, who, r);
        else {
            h->stats[PC_HOP_RECEIVED]++;
            if (hdr[2] & F_SKIP) h->stats[PC_HOP_SKIP_UPDATES]++;
            if (m > h->newest[who]) h->newest[who] = m;
        }
        complete_ready(h);
        recycle_all(h);
    } else if (kind == TRX) {
        STORE(h->tokens[who], h->tokens[who] + 1);
        post_tokens(h, who);
    }
    flush_tokens(h);
    send_fillers(h);
    notify_done();
}

static int hop_take(pc_owner *o) { (void)o; return fail(PC_ERR_STATE, "a neighbour allreduce has no TAKE"); }
static int hop_deliver(pc_owner *o) { (void)o; return fail(PC_ERR_STATE, "a neighbour allreduce has no DELIVER"); }

static void hop_failed(pc_owner *o, int code, int peer, const char *msg)
{
    hop_error((pc_hop *)o, code, peer, msg);
}

static void hop_destroy(pc_unit *u)
{
    pc_hop *h = (pc_hop *)u;
    for (int k = 0; k < 4; k++) {
        int n = (k == RX || k == TTX ? h->n_in : h->n_out) * h->R;
        for (int i = 0; h->ch[k] && i < n; i++) if (h->ch[k][i]) sched_destroy(h->ch[k][i]);
        free(h->ch[k]);
    }
    if (!u->leaked) { free(h->rx); free(h->tx); }     /* else MPI may still touch them */
    for (int p = 0; h->pend && p < h->R; p++) free(h->pend[p].upd);
    free(h->pend); free(h->sources); free(h->dests);
    free(h->rx_iter); free(h->rx_ns); free(h->rx_state); free(h->rx_used);
    free(h->next_post); free(h->post_limit); free(h->newest); free(h->sent);
    free(h->tokens); free(h->tk_next); free(h->tk_limit); free(h->granted); free(h->grant_to); free(h->send_to);
    report_free(&h->rep);
    pthread_mutex_destroy(&u->lock);
    free(h);
}

/* [pass] A peer's report (pc_hop_abort on that rank): every pending and later call fails
 * with PC_ERR_PEER, completed iterations included (Hop's iterations overlap: there is no
 * round the reporter is known to have finished for everyone). Also sends this rank's
 * report where it was made without MPI calls (dropped). Unit lock held. */
static int hop_poll(pc_unit *u)
{
    pc_hop *h = (pc_hop *)u;
    if (h->rep.pending) {
        report_send(&h->rep, h->done_iter + 1, h->stopped);
        return 1;
    }
    if (!report_heard(&h->rep)) return 0;
    if (h->err || h->rep.made) return 1;
    char msg[sizeof h->errmsg];
    report_describe(&h->rep, h->rank, msg, sizeof msg);
    hop_error(h, PC_ERR_PEER, h->rep.peer.rank, msg);
    note_event();
    return 1;
}

/* abandoned: withdraw every running channel (unit lock held, on a progress pass) */
static void hop_abandon_unit(pc_unit *u)
{
    pc_hop *h = (pc_hop *)u;
    h->stopped = 1;
    report_deaf(&h->rep, 1);       /* Python frees the communicator at a later call */
    for (int k = 0; k < 4; k++) {
        int n = (k == RX || k == TTX ? h->n_in : h->n_out) * h->R;
        for (int i = 0; i < n; i++) if (h->ch[k][i] && h->ch[k][i]->running) sched_withdraw(h->ch[k][i]);
    }
}

/* ------------------------------------------------------------------ the application's calls */
static int64_t *zeros(int n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t)); }

int pc_hop_create(const pc_hopspec *spec, void *comm_handle, pc_hop **out)
{
    if (!LOAD(E.started)) return fail(PC_ERR_STATE, "the engine is not running");
    int n_in = spec->n_in, n_out = spec->n_out, R = spec->depth;
    if (n_in < 0 || n_out < 0 || R < 1 || spec->count < 0 || spec->backup < 0 || (n_in && spec->backup >= n_in)
        || spec->max_staleness < 0 || spec->max_gap < 0 || spec->dtype < 0 || spec->dtype >= PC_DT_COUNT
        || R < 1 + spec->max_staleness + (spec->max_gap ? spec->max_gap : 1))
        return fail(PC_ERR_ARG, "neighbour allreduce: bad specification");
    if (spec->weights == PC_HOP_WEIGHTS_NONE ? !pc_op_valid(spec->redop, spec->dtype)
                                             : spec->redop != PC_OP_SUM)
        return fail(PC_ERR_DTYPE_OP, "op %d is not defined for dtype %d here", spec->redop, spec->dtype);
    pc_hop *h = calloc(1, sizeof *h);
    if (!h) return fail(PC_ERR_NOMEM, "out of memory");
    unit_init(&h->owner.unit, hop_destroy, hop_abandon_unit);
    h->owner.unit.poll = hop_poll;
    h->owner.take = hop_take;
    h->owner.deliver = hop_deliver;
    h->owner.done = hop_done;
    h->owner.failed = hop_failed;
    h->spec = *spec;
    h->n_in = n_in; h->n_out = n_out; h->R = R;
    h->s = spec->max_staleness; h->g = spec->max_gap; h->need = n_in - spec->backup;
    h->nbytes = (size_t)spec->count * pc_dt_size[spec->dtype];
    h->msg = (HDR + h->nbytes + 63) / 64 * 64;
    h->iter = h->done_iter = -1;
    int rc = mpi_comm_info(*(MPI_Comm *)comm_handle, &h->rank, &h->size);
    if (rc) { hop_destroy(&h->owner.unit); return rc; }
    h->sources = calloc((size_t)n_in + 1, sizeof(int));
    h->dests = calloc((size_t)n_out + 1, sizeof(int));
    h->rx = calloc((size_t)n_in * R + 1, h->msg);
    h->tx = calloc((size_t)R, h->msg);
    h->rx_iter = zeros(n_in * R); h->rx_ns = zeros(n_in * R); h->rx_state = calloc((size_t)n_in * R + 1, sizeof(int));
    h->rx_used = calloc((size_t)n_in * R + 1, sizeof(int));
    h->next_post = zeros(n_in); h->post_limit = zeros(n_in); h->newest = zeros(n_in); h->granted = zeros(n_in);
    h->sent = zeros(n_out); h->tokens = zeros(n_out); h->tk_next = zeros(n_out); h->tk_limit = zeros(n_out);
    h->pend = calloc((size_t)R, sizeof(hop_pending));
    for (int k = 0; k < 4; k++) h->ch[k] = calloc((size_t)(k == RX || k == TTX ? n_in : n_out) * R + 1, sizeof(pc_sched *));
    int ok = h->sources && h->dests && h->rx && h->tx && h->rx_iter && h->rx_ns && h->rx_state && h->rx_used && h->next_post
             && h->post_limit && h->newest && h->granted && h->sent && h->tokens && h->tk_next && h->tk_limit
             && h->pend && h->ch[0] && h->ch[1] && h->ch[2] && h->ch[3];
    for (int p = 0; ok && p < R; p++) {
        h->pend[p].k = -1;
        ok = (h->pend[p].upd = zeros(3 * n_in)) != NULL;
    }
    if (!ok) { hop_destroy(&h->owner.unit); return fail(PC_ERR_NOMEM, "out of memory"); }
    for (int j = 0; j < n_in; j++) { h->sources[j] = spec->sources[j]; h->post_limit[j] = NOLIMIT; h->newest[j] = -1; }
    for (int i = 0; i < n_out; i++) { h->dests[i] = spec->destinations[i]; h->tk_next[i] = 1;
                                      h->tk_limit[i] = h->g ? NOLIMIT : 0; }
    /* the channels: one op each; data messages are sequence 0 of their pair, tokens 1 */
    static char token_byte;
    for (int k = 0; k < 4 && rc == PC_OK; k++) {
        if ((k == TRX || k == TTX) && !h->g) continue;
        int nwho = k == RX || k == TTX ? n_in : n_out;
        for (int who = 0; who < nwho && rc == PC_OK; who++)
            for (int r = 0; r < R && rc == PC_OK; r++) {
                pc_opspec op;
                memset(&op, 0, sizeof op);
                op.kind = k == RX || k == TRX ? PC_RECV : PC_SEND;
                op.peer = k == RX || k == TTX ? h->sources[who] : h->dests[who];
                op.nbytes = k == TRX || k == TTX ? 0 : (int64_t)h->msg;
                op.ptr[0] = k == RX ? h->rx + ((size_t)who * R + r) * h->msg
                          : k == TX ? h->tx + (size_t)r * h->msg : (void *)&token_byte;
                pc_sched **slot = &h->ch[k][who * R + r];
                rc = sched_create(comm_handle, 1, &op, 0, NULL, &h->owner, 0, 2, slot);
                if (rc == PC_OK) {
                    (*slot)->owner_index = ((who * R + r) << 2) | k;
                    (*slot)->ops[0].tag_seq = k == TRX || k == TTX;
                }
            }
    }
    if (rc == PC_OK && h->size > 1) rc = report_listen(&h->rep, *(MPI_Comm *)comm_handle, spec->ident);
    if (rc) { hop_destroy(&h->owner.unit); return rc; }
    unit_lock(&h->owner.unit);
    for (int j = 0; j < n_in; j++) post_rx(h, j);
    for (int i = 0; i < n_out && h->g; i++) post_tokens(h, i);
    rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
    unit_unlock(&h->owner.unit);
    *out = h;       /* even on failure: pc_hop_abandon frees it */
    return rc;
}

/* the error of the collective, or closed */
static int hop_state(pc_hop *h)
{
    if (h->err) return fail_at(h->err, h->errpeer, h->errmsg);
    if (h->closing) return fail(PC_ERR_STATE, "this NeighborAllreduce is closing");
    return PC_OK;
}

typedef struct { pc_hop *h; int64_t k; } hop_arg;

/* Why iteration k cannot be entered yet (a message), or 0 if it can. Unit lock held. */
static int entry_blocked(pc_hop *h, int64_t k, char *why, size_t len)
{
    for (int i = 0; h->g && i < h->n_out; i++)
        if (k > h->g + h->tokens[i] - 1) {
            snprintf(why, len, "no token from rank %d for iteration %lld (this is rank %d, max_gap=%d)",
                     h->dests[i], (long long)k, h->rank, h->g);
            return 1;
        }
    for (int i = 0; i < h->n_out; i++)
        if (chan(h, TX, i, (int)(k % h->R))->running) {
            snprintf(why, len, "the sends of iteration %lld from rank %d were not received", (long long)(k - h->R),
                     h->rank);
            return 1;
        }
    if (h->done_iter < k - h->R) {
        snprintf(why, len, "iteration %lld at rank %d is not complete", (long long)(k - h->R), h->rank);
        return 1;
    }
    return 0;
}

/* The waits' predicates run under E.dmtx (progress.c), so they take no unit lock (the
 * order is unit lock -> E.dmtx): they read what the unit writes with atomic loads, and
 * the caller looks again under the lock. */
static int can_enter(void *p)
{
    hop_arg *a = p;
    pc_hop *h = a->h;
    if (LOAD(h->err)) return 1;
    for (int i = 0; h->g && i < h->n_out; i++) if (a->k > h->g + LOAD(h->tokens[i]) - 1) return 0;
    for (int i = 0; i < h->n_out; i++) if (LOAD(chan(h, TX, i, (int)(a->k % h->R))->running)) return 0;
    return LOAD(h->done_iter) >= a->k - h->R;
}

/* Enter iteration iter + 1: wait for its tokens and send slot; unit lock held on return
 * (PC_OK) or released (an error). */
static int enter(pc_hop *h, double timeout_s, int64_t *k, int64_t *entry)
{
    unit_lock(&h->owner.unit);
    int rc = hop_state(h);
    hop_arg a = {h, h->iter + 1};
    hop_pending *p = &h->pend[a.k % h->R];
    if (rc == PC_OK && p->k >= 0)
        rc = fail(PC_ERR_STATE, "iteration %lld is still pending at rank %d: at most %d requests may be outstanding; "
                  "wait() for it before the next post()", (long long)p->k, h->rank, h->R);
    char why[200];
    double deadline = timeout_s >= 0 ? now_us() + timeout_s * 1e6 : -1;
    while (rc == PC_OK && entry_blocked(h, a.k, why, sizeof why)) {
        unit_unlock(&h->owner.unit);
        kick();
        double left = deadline < 0 ? -1 : (deadline - now_us()) * 1e-6;
        rc = left < 0 && deadline >= 0 ? PC_ERR_TIMEOUT : wait_until(can_enter, &a, left);
        unit_lock(&h->owner.unit);
        if (rc == PC_ERR_TIMEOUT) {
            entry_blocked(h, a.k, why, sizeof why);
            rc = fail(PC_ERR_TIMEOUT, "NeighborAllreduce: %s", why);
        } else if (rc == PC_OK) rc = hop_state(h);
    }
    if (rc) { unit_unlock(&h->owner.unit); return rc; }
    *k = a.k;
    h->iter = a.k;
    entry[0] = a.k;                      /* logged before its tokens are granted (Theorem 2's checks) */
    entry[1] = (int64_t)(now_us() * 1e3);
    int64_t t = INT64_MAX;
    for (int i = 0; h->g && i < h->n_out; i++) if (h->tokens[i] < t) t = h->tokens[i];
    entry[2] = h->g && h->n_out ? h->g + t - 1 - a.k : -1;
    return PC_OK;
}

/* start iteration k's sends from slot k mod R, grant its tokens (unit lock held) */
static void send_and_grant(pc_hop *h, int64_t k)
{
    int r = (int)(k % h->R);
    for (int i = 0; i < h->n_out; i++) {
        if (hop_begin(h, chan(h, TX, i, r), k, 1)) return;
        STORE(h->sent[i], h->sent[i] + 1);
    }
    if (h->g) { h->owed = k + 1; flush_tokens(h); }
}

static int hop_post(pc_hop *h, const void *x, void *out, double timeout_s, int64_t *entry)
{
    int64_t k;
    int rc = enter(h, timeout_s, &k, entry);
    if (rc) return rc;
    char *slot = h->tx + (size_t)(k % h->R) * h->msg;
    int64_t hdr[4] = {k, k, 0, h->rank};
    memcpy(slot, hdr, sizeof hdr);
    if (h->nbytes) memcpy(slot + HDR, x, h->nbytes);
    hop_pending *p = &h->pend[k % h->R];
    p->out = out; p->done = p->cancelled = p->waited = 0; p->nupd = 0;
    p->entry_ns = entry[1];
    STORE(p->k, k);
    send_and_grant(h, k);
    recycle_all(h);
    complete_ready(h);
    rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
    unit_unlock(&h->owner.unit);
    return rc;
}

static int hop_skip(pc_hop *h, int64_t iterations, double timeout_s, int64_t *skipped, int64_t *entries)
{
    *skipped = 0;
    unit_lock(&h->owner.unit);
    int rc = hop_state(h);
    if (rc == PC_OK && h->iter < 0)
        rc = fail(PC_ERR_STATE, "skip() needs a first post(): there is no update to stand for skipped iterations");
    else if (rc == PC_OK && h->done_iter < h->iter)
        rc = fail(PC_ERR_STATE, "wait() for iteration %lld before skip() (rank %d)", (long long)(h->done_iter + 1),
                  h->rank);
    int64_t j = iterations;
    if (rc == PC_OK && h->g && h->n_out) {
        int64_t t = INT64_MAX;
        for (int i = 0; i < h->n_out; i++) if (h->tokens[i] < t) t = h->tokens[i];
        if (h->g + t - 1 - h->iter < j) j = h->g + t - 1 - h->iter;
    }
    int64_t data_iter = h->iter;
    unit_unlock(&h->owner.unit);
    for (int64_t n = 0; rc == PC_OK && n < j; n++) {
        int64_t k;
        if ((rc = enter(h, timeout_s, &k, entries + 3 * n))) break;
        int r = (int)(k % h->R), prev = (int)((k - 1) % h->R);
        char *slot = h->tx + (size_t)r * h->msg;
        if (r != prev) memcpy(slot + HDR, h->tx + (size_t)prev * h->msg + HDR, h->nbytes);
        int64_t hdr[4] = {k, data_iter, F_SKIP, h->rank};
        memcpy(slot, hdr, sizeof hdr);
        STORE(h->done_iter, k);
        send_and_grant(h, k);
        h->stats[PC_HOP_SKIPPED]++;
        (*skipped)++;
        recycle_all(h);
        rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
        unit_unlock(&h->owner.unit);
    }
    return rc;
}

static int iteration_done(void *p)
{
    hop_arg *a = p;
    hop_pending *q = &a->h->pend[a->k % a->h->R];
    return LOAD(a->h->err) || LOAD(q->k) != a->k || LOAD(q->done) || LOAD(q->cancelled);
}

/* Take iteration k's result (written into its out buffer): updates (rank, iteration,
 * arrival ns) x info[0]; info[1]: when it completed (ns, CLOCK_MONOTONIC); info[2]: 1 if
 * it completed before this rank asked for it; info[3]: when it was entered (ns).
 * timeout_s 0: test once (PC_ERR_TIMEOUT: not yet). */
static int hop_wait(pc_hop *h, int64_t k, double timeout_s, int64_t *updates, int64_t *info)
{
    hop_arg a = {h, k};
    unit_lock(&h->owner.unit);
    hop_pending *p = &h->pend[k % h->R];
    int rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
    if (rc == PC_OK && p->k != k) rc = fail(PC_ERR_STATE, "iteration %lld was taken already (rank %d)", (long long)k, h->rank);
    info[2] = p->done;
    if (rc == PC_OK && !p->done && !p->cancelled) {
        p->waited = 1;
        unit_unlock(&h->owner.unit);
        if (timeout_s == 0) {                /* a test: one progress pass where no thread makes them */
            if (!E.threaded) engine_pass();
            rc = iteration_done(&a) ? PC_OK : PC_ERR_TIMEOUT;
        } else rc = wait_until(iteration_done, &a, timeout_s);
        unit_lock(&h->owner.unit);
        if (rc == PC_ERR_TIMEOUT) {
            char missing[200] = "";
            int n = 0, len = 0;
            for (int j = 0; j < h->n_in; j++) {
                if (ready_slot(h, j, k) >= 0) n++;
                else if (len < (int)sizeof missing - 16) len += snprintf(missing + len, sizeof missing - (size_t)len,
                                                                         "%s%d", len ? ", " : "", h->sources[j]);
            }
            if (p->k == k && !p->done && !p->cancelled)
                rc = fail(PC_ERR_TIMEOUT, "NeighborAllreduce: iteration %lld at rank %d has %d of the %d in-neighbour "
                          "updates it needs; missing: [%s]", (long long)k, h->rank, n, h->need, missing);
            else rc = PC_OK;
        }
        if (rc == PC_OK && h->err) rc = fail_at(h->err, h->errpeer, h->errmsg);
    }
    if (rc == PC_OK && p->cancelled) rc = fail(PC_ERR_STATE, "iteration %lld was dropped by close() (rank %d)",
                                               (long long)k, h->rank);
    if (rc == PC_OK) {
        memcpy(updates, p->upd, sizeof(int64_t) * 3 * (size_t)p->nupd);
        info[0] = p->nupd;
        info[1] = p->done_ns;
        info[3] = p->entry_ns;
        STORE(p->k, -1);
    }
    unit_unlock(&h->owner.unit);
    return rc;
}

/* on_failure="shrink": iteration k's result, where it completed before the failure that
 * stops every other call (no progress completes an iteration once h->err is set) */
static int hop_salvage(pc_hop *h, int64_t k, int64_t *updates, int64_t *info, int *done)
{
    unit_lock(&h->owner.unit);
    hop_pending *p = &h->pend[k % h->R];
    *done = k >= 0 && p->k == k && p->done && !p->cancelled;
    if (*done) {
        memcpy(updates, p->upd, sizeof(int64_t) * 3 * (size_t)p->nupd);
        info[0] = p->nupd;
        info[1] = p->done_ns;
        info[2] = 1;
        info[3] = p->entry_ns;
        STORE(p->k, -1);
    }
    unit_unlock(&h->owner.unit);
    return PC_OK;
}

/* stats: PC_HOP_STATS counters; tokens received per out-neighbour, granted per
 * in-neighbour, newest update per in-neighbour; pos: last entered, last completed */
static int hop_get_state(pc_hop *h, int64_t *stats, int64_t *tokens, int64_t *granted, int64_t *newest, int64_t *pos)
{
    unit_lock(&h->owner.unit);
    memcpy(stats, h->stats, sizeof h->stats);
    stats[PC_HOP_BUFFERS] = (int64_t)h->n_in * h->R;
    memcpy(tokens, h->tokens, sizeof(int64_t) * (size_t)h->n_out);
    memcpy(granted, h->granted, sizeof(int64_t) * (size_t)h->n_in);
    memcpy(newest, h->newest, sizeof(int64_t) * (size_t)h->n_in);
    pos[0] = h->iter;
    pos[1] = h->done_iter;
    int rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
    unit_unlock(&h->owner.unit);
    return rc;
}

/* close(), 1: stop using what arrives, drop the pending iterations; *last: the last
 * iteration entered */
static int hop_close_begin(pc_hop *h, int64_t *last)
{
    unit_lock(&h->owner.unit);
    h->closing = 1;
    for (int p = 0; p < h->R; p++) if (h->pend[p].k >= 0 && !h->pend[p].done) STORE(h->pend[p].cancelled, 1);
    *last = h->iter;
    recycle_all(h);
    int rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
    unit_unlock(&h->owner.unit);
    notify_done();
    return rc;
}

/* close(), 2: given every rank's last iteration (P), post no receive beyond what a
 * neighbour sent or what is posted now; posted (2P, -1 preset): the last iteration this
 * rank posted a receive for, per source rank, then the last token, per destination rank */
static int hop_freeze(pc_hop *h, const int64_t *last, int64_t *posted)
{
    unit_lock(&h->owner.unit);
    for (int j = 0; j < h->n_in; j++) {
        posted[h->sources[j]] = h->next_post[j] - 1;
        h->post_limit[j] = imax(last[h->sources[j]], h->next_post[j] - 1);
    }
    for (int i = 0; h->g && i < h->n_out; i++) {
        posted[h->size + h->dests[i]] = h->tk_next[i] - 1;
        h->tk_limit[i] = imax(last[h->dests[i]] + 1, h->tk_next[i] - 1);
    }
    int rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
    unit_unlock(&h->owner.unit);
    return rc;
}

static int drained(void *p)
{
    pc_hop *h = p;
    if (LOAD(h->err)) return 1;
    int ok = LOAD(h->owner.unit.nrunning) == 0;
    for (int j = 0; ok && j < h->n_in; j++)
        ok = LOAD(h->next_post[j]) > h->post_limit[j] && (!h->g || LOAD(h->granted[j]) >= h->grant_to[j]);
    for (int i = 0; ok && i < h->n_out; i++)
        ok = LOAD(h->sent[i]) > h->send_to[i] && (!h->g || LOAD(h->tk_next[i]) > h->tk_limit[i]);
    return ok;
}

/* close(), 3: every rank's posted vectors (P x 2P): send fillers up to what each
 * out-neighbour posted, grant the tokens each in-neighbour posted receives for, receive
 * everything in flight; wait until every channel is idle */
static int hop_drain(pc_hop *h, const int64_t *every, double timeout_s)
{
    unit_lock(&h->owner.unit);
    int P = h->size;
    h->send_to = zeros(h->n_out);
    h->grant_to = zeros(h->n_in);
    int rc = h->send_to && h->grant_to ? PC_OK : fail(PC_ERR_NOMEM, "out of memory");
    for (int i = 0; rc == PC_OK && i < h->n_out; i++)
        h->send_to[i] = imax(h->iter, every[(size_t)h->dests[i] * 2 * P + h->rank]);
    for (int j = 0; rc == PC_OK && j < h->n_in; j++)
        h->grant_to[j] = h->g ? imax(h->iter + 1, every[(size_t)h->sources[j] * 2 * P + P + h->rank]) : 0;
    if (rc == PC_OK) {
        h->draining = 1;
        recycle_all(h);
        for (int i = 0; h->g && i < h->n_out; i++) post_tokens(h, i);
        flush_tokens(h);
        send_fillers(h);
    }
    unit_unlock(&h->owner.unit);
    if (rc) return rc;
    kick();
    rc = wait_until(drained, h, timeout_s);
    if (rc == PC_ERR_TIMEOUT) return fail(PC_ERR_TIMEOUT, "NeighborAllreduce.close(): channels did not drain "
                                          "(rank %d)", h->rank);
    if (rc) return rc;
    unit_lock(&h->owner.unit);
    rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
    if (rc == PC_OK) report_deaf(&h->rep, 0);    /* every rank is in close(): nobody reports now */
    unit_unlock(&h->owner.unit);
    return rc;
}

static int never(void *p) { (void)p; return 0; }

/* serve the engine for `seconds` (progress inline, or sleep while the thread does) */
static int hop_serve(pc_hop *h, double seconds)
{
    int rc = wait_until(never, NULL, seconds);
    if (rc != PC_ERR_TIMEOUT) return rc;
    unit_lock(&h->owner.unit);
    rc = h->err ? fail_at(h->err, h->errpeer, h->errmsg) : PC_OK;
    unit_unlock(&h->owner.unit);
    return rc;
}

/* after pc_hop_drain: free now; dropped without it: withdraw what runs and free once
 * drained (*deferred = 1: MPI may still write its buffers until then) */
int pc_hop_free(pc_hop *h, int *deferred)
{
    *deferred = 0;
    if (!h) return PC_OK;
    pc_unit *u = &h->owner.unit;
    unit_pin(u);
    unit_lock(u);
    h->stopped = 1;
    if (!h->err)      /* wakes a thread still waiting in it (dropped under that wait) */
        hop_error(h, PC_ERR_STATE, -1, "this NeighborAllreduce was dropped on this rank (closed, or left by an "
                  "exception, or garbage-collected)");
    *deferred = u->nrunning > 0;
    if (*deferred) u->withdraw = 1;
    unit_doom(u);
    unit_unlock(u);
    unit_unpin(u);    /* the last one out frees it: this thread, a waiter's unpin, or a pass */
    if (*deferred) kick();
    return PC_OK;
}

/* This rank's report (as pc_coll_abort): the collective stops here (PC_ERR_STATE), the
 * peers' calls fail with PC_ERR_PEER. timeout_s < 0: no MPI call here (a garbage
 * collector's thread), the next progress pass sends it; else it is sent now and its
 * messages get up to timeout_s to leave. Nothing is sent after a peer's report. */
static int hop_abort(pc_hop *h, const char *type, const char *message, double timeout_s)
{
    if (!h) return PC_OK;
    unit_lock(&h->owner.unit);
    int send = h->err != PC_ERR_PEER && !h->stopped && h->size > 1 && report_make(&h->rep, h->rank, type, message);
    if (send) {
        if (!h->err) {
            char msg[sizeof h->errmsg];
            snprintf(msg, sizeof msg, "this rank (%d) reported %s to its peers, the NeighborAllreduce cannot be "
                     "used any more: %s", h->rank, h->rep.mine.type, h->rep.mine.message);
            hop_error(h, PC_ERR_STATE, -1, msg);
        }
        if (timeout_s < 0) report_defer(&h->rep);
        else report_send(&h->rep, h->done_iter + 1, 0);
    }
    unit_unlock(&h->owner.unit);
    if (send && timeout_s < 0) kick_report();
    else if (send) report_flush(&h->owner.unit, &h->rep, timeout_s);
    return PC_OK;
}

static int hop_peer_error(pc_hop *h, int *rank, char *type, int tlen, char *message, int mlen)
{
    return report_peer_error(&h->owner.unit, &h->rep, &h->err, rank, type, tlen, message, mlen);
}

/* ------------------------------------------------------------------ entries: pinned
 * Every call holds a pin on the collective for its whole length (pc_internal.h, "pins"):
 * pc_hop_free only marks it, and the last thread out of a call frees it, so a thread
 * waiting in pc_hop_wait while another drops the collective wakes with PC_ERR_STATE and
 * never touches freed memory. pc_hop_hold / pc_hop_release: a reference Python keeps
 * for its threads between reading the handle and their call (neighbor.py, _free). */
#define HOP_PINNED(h, call) do { pc_unit *u_ = &(h)->owner.unit; unit_pin(u_); int rc_ = (call); unit_unpin(u_); \
                             return rc_; } while (0)
int pc_hop_post(pc_hop *h, const void *x, void *out, double timeout_s, int64_t *entry)
{
    HOP_PINNED(h, hop_post(h, x, out, timeout_s, entry));
}

int pc_hop_skip(pc_hop *h, int64_t iterations, double timeout_s, int64_t *skipped, int64_t *entries)
{
    HOP_PINNED(h, hop_skip(h, iterations, timeout_s, skipped, entries));
}

int pc_hop_wait(pc_hop *h, int64_t k, double timeout_s, int64_t *updates, int64_t *info)
{
    HOP_PINNED(h, hop_wait(h, k, timeout_s, updates, info));
}

int pc_hop_state(pc_hop *h, int64_t *stats, int64_t *tokens, int64_t *granted, int64_t *newest, int64_t *pos)
{
    HOP_PINNED(h, hop_get_state(h, stats, tokens, granted, newest, pos));
}

int pc_hop_close_begin(pc_hop *h, int64_t *last)
{
    HOP_PINNED(h, hop_close_begin(h, last));
}

int pc_hop_freeze(pc_hop *h, const int64_t *last, int64_t *posted)
{
    HOP_PINNED(h, hop_freeze(h, last, posted));
}

int pc_hop_drain(pc_hop *h, const int64_t *every, double timeout_s)
{
    HOP_PINNED(h, hop_drain(h, every, timeout_s));
}

int pc_hop_serve(pc_hop *h, double seconds)
{
    HOP_PINNED(h, hop_serve(h, seconds));
}

int pc_hop_abort(pc_hop *h, const char *type, const char *message, double timeout_s)
{
    if (!h) return PC_OK;
    HOP_PINNED(h, hop_abort(h, type, message, timeout_s));
}

int pc_hop_peer_error(pc_hop *h, int *rank, char *type, int tlen, char *message, int mlen)
{
    HOP_PINNED(h, hop_peer_error(h, rank, type, tlen, message, mlen));
}

int pc_hop_salvage(pc_hop *h, int64_t k, int64_t *updates, int64_t *info, int *done)
{
    HOP_PINNED(h, hop_salvage(h, k, updates, info, done));
}

int pc_hop_hold(pc_hop *h) { unit_pin(&h->owner.unit); return PC_OK; }
int pc_hop_release(pc_hop *h) { unit_unpin(&h->owner.unit); return PC_OK; }
