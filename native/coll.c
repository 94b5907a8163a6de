/* coll.c -- partial collectives (pc_coll): rounds, accumulator, results, close;
 * and the counter-based choice of each round's candidates. */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <mpi.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ candidates */
static uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* q distinct ranks out of [0, size) for (seed, round): a partial Fisher-Yates shuffle
 * driven by a counter-based hash, so every rank computes the same set without messages. */
int pc_candidates(uint64_t seed, int64_t round, int size, int q, int *out)
{
    if (size <= 0 || q <= 0 || q > size) return fail(PC_ERR_ARG, "candidates: need 0 < q <= size");
    int *perm = malloc(sizeof(int) * (size_t)size);
    if (!perm) return fail(PC_ERR_NOMEM, "candidates: out of memory");
    for (int i = 0; i < size; i++) perm[i] = i;
    uint64_t key = splitmix64(seed ^ splitmix64((uint64_t)round));
    for (int i = 0; i < q; i++) {
        int j = i + (int)(splitmix64(key + (uint64_t)i) % (uint64_t)(size - i));
        int t = perm[i]; perm[i] = perm[j]; perm[j] = t;
        out[i] = perm[i];
    }
    free(perm);
    return PC_OK;
}

/* ------------------------------------------------------------------ partial collectives
 *
 * Round n runs on sched[kind(n)][n mod variants] with version n (variants > 1: the
 * tree's rotated aggregators; every rank knows n, so all pick the same variant, and
 * coll_arm is the one place that picks it, for the next round and for the first).
 * Buffers: acc (what post folds into),
 * work (what the round's allreduce reduces), result (what wait returns); moving data
 * between them is a pointer swap wherever possible, so a post costs one pass over x.
 *
 *   post(x):   acc = acc (op) x (accumulate RNA: acc = acc + j x, the j-th post since the
 *              last TAKE); posts++; maybe trigger the armed round
 *   TAKE:      acc = acc / k (MEAN) or / (k (k + 1) / 2) (RNA); work = acc; acc = empty; k = posts since the last TAKE: my active bit if
 *              k > 0 (fresh or leftover data is inside), my word of the posts count = k,
 *              my closing bit if closing
 *   DELIVER:   result = work (latest) or result = result (op) work (fold); completed = n + 1
 *   done:      arm round n + 1, unless every rank was closing in round n
 *
 * The bookkeeping mask (MASK slot, reduced with BOR next to the data) is W words of
 * active bits, W of closing bits (W = ceil(P/64)) and one word per rank for its posts:
 * each rank writes only its own bits and word, so BOR assembles them exactly.
 *
 * Buffers (docs/engine.md, "Ownership": the table). The engine owns acc, work and result
 * and holds at most one user buffer, `user`, lent by a post made while no other request
 * was outstanding (every earlier one taken: nobody else names a buffer, nobody will copy
 * a result into one). `input` says where posted data that no round has taken lives:
 *
 *   IN_NONE   nowhere (TAKE contributes the identity)
 *   IN_ACC    acc (internal)
 *   IN_LENT   user: an in-place post, post(x, out=x), not late, alone: acc is x itself
 *   IN_WORK   work_slot: a full-mode post into an armed round that has not started
 *             copied x straight into the round's buffer (out, then user, or work)
 *
 * and `user`, when set, is the input (IN_LENT), the round's buffer (work_slot == user:
 * TAKE of IN_LENT, or IN_WORK), or else the pending result (DELIVER of a round that ran
 * in it, latest). The moves: post (alone: IN_LENT or IN_WORK with user; else IN_ACC,
 * folding a lent input into acc, which gives user back), TAKE (IN_* -> IN_NONE, the
 * round runs in work or user), DELIVER (user's round -> user's result, latest; folded
 * into result and given back, fold), the request's take (user given back, copied into
 * result first where another request may still take that result), close (result
 * internal). So a round runs in the caller's buffer and the result is where its wait puts
 * it: no pass over the data on this rank for in-place and full-mode posts.
 * pc_coll_user_buffers names user, so that Python keeps it alive.
 *
 * Takes: each request's take is claimed once (coll_claim). The early take of
 * pc_coll_post_take (the post's round completed within the post) copies the result into
 * the post's out at once, but counts in takes only when the caller says its wait has
 * returned: until then the request is outstanding, so no post is alone and none writes a
 * user buffer; at close an early result never returned goes back into the pending result
 * (pc_coll_give_back), so close() still folds in every round no wait returned.
 *
 * Threads: everything here runs under the collective's unit lock (c->owner.unit.lock):
 * a post's copy or fold, TAKE, DELIVER and result copies block only this collective.
 * completed, finished and err are also read without it (atomic) by waits.
 */
/* close()'s take waits for "index" 2^62 (the final round, whichever it is) */
#define PC_CLOSE_INDEX (1LL << 61)

static inline int W_of(const pc_coll *c) { return (c->size + 63) / 64; }

int pc_coll_mask_words(int size) { return size < 1 ? 0 : 2 * ((size + 63) / 64) + size; }
int pc_coll_timed_words(int size)       /* -1: more than an int can count */
{
    int64_t w = size < 1 ? 0 : (int64_t)PC_TIME_FIELDS * size * size + size;
    return w + pc_coll_mask_words(size) > INT_MAX ? -1 : (int)w;
}

static void fill_identity(pc_coll *c, void *dst)
{
    const unsigned char *id = c->spec.identity;
    size_t k, z = 1;
    for (k = 0; k < c->itemsize; k++) z &= id[k] == 0;
    if (z) { memset(dst, 0, c->nbytes); return; }
    for (int64_t i = 0; i < c->spec.count; i++) memcpy((char *)dst + i * c->itemsize, id, c->itemsize);
}

static void swap_ptr(void **a, void **b) { void *t = *a; *a = *b; *b = t; }

enum { IN_NONE = 0, IN_ACC = 1, IN_LENT = 2, IN_WORK = 3 };

static inline int acc_holds(const pc_coll *c) { return c->input == IN_ACC || c->input == IN_LENT; }
static inline void *acc_of(pc_coll *c) { return c->input == IN_LENT ? c->user : c->acc; }
/* the user buffer holds the pending result (neither the input nor the round's buffer) */
static inline int result_in_user(const pc_coll *c)
{
    return c->user && c->input != IN_LENT && c->work_slot != c->user;
}

/* The pending result lives in the user's buffer (a round ran there): copy it into the
 * collective's own result buffer and give the user's back. The engine reads a user's
 * buffer only while its request has not been taken (Python keeps it alive) and never
 * writes into it after its round. */
static void result_internal(pc_coll *c)
{
    if (!result_in_user(c)) return;
    memcpy(c->result, c->user, c->nbytes);
    c->user = NULL;
}

/* A lent input goes back to the caller: its content moves into the internal acc. */
static void acc_internal(pc_coll *c)
{
    if (c->input != IN_LENT) return;
    memcpy(c->acc, c->user, c->nbytes);
    c->user = NULL;
    c->input = IN_ACC;
}

static int pc_coll_round_kind(pc_coll *c, int64_t n)
{
    if (c->spec.mode == PC_MODE_FULL) return 1;
    if (c->spec.max_staleness > 0 && (n + 1) % c->spec.max_staleness == 0) return 1;
    if (c->close_seen >= 0 && n > c->close_seen) return 1;   /* someone is closing: full rounds */
    return 0;
}

static int pc_coll_eligible(pc_coll *c, int64_t n, int rank)
{
    if (pc_coll_round_kind(c, n) == 1) return 1;
    int q;
    switch (c->spec.mode) {
    case PC_MODE_MAJORITY: q = 1; break;
    case PC_MODE_PROBE: q = c->spec.candidates; break;
    default: return 1;   /* solo: everyone; quorum: everyone notifies the leader */
    }
    int cand[q > 0 ? q : 1], hit = 0;
    if (pc_candidates(c->spec.seed, n, c->size, q, cand)) return 0;
    for (int i = 0; i < q; i++) hit |= cand[i] == rank;
    return hit;
}

/* Fire the armed round's trigger if this rank may start it now. *now: the event's clock,
 * as the kicks' (progress.c); where it is 0 and the kick reads the clock, that read. */
int coll_maybe_trigger(pc_coll *c, double *now)
{
    pc_sched *s = c->armed;
    if (!s || c->triggered || !s->running || s->draining || s->trigger_op < 0) return PC_OK;
    int64_t n = c->armed_round;
    if (!(c->closing || (c->posts > n && pc_coll_eligible(c, n, c->rank)))) return PC_OK;
    c->triggered = 1;
    int needs_trigger = s->needs_trigger;      /* s may complete (and the next round arm) below */
    int rc = sched_fire_trigger(s);
    /* A full round: the caller's wait() drives it, no wake-up (kick_lazy). A round this
     * post starts for others (solo, majority, probe, quorum): wake the progress thread at
     * once; measured at P = 2 under skew (docs/benchmarks.md), the lazy kick made the
     * initiator's round 60 - 100 us slower. */
    double t = needs_trigger ? kick_lazy(*now) : kick_eager(*now);
    if (*now == 0) *now = t;
    return rc;
}

static void coll_retire(pc_coll *c, pc_sched *s);

static void coll_peer_failed(pc_coll *c);

/* At epoch boundary n: apply, in order, the decisions that every rank has received
 * (ready, agreed in round n - 1's masks) and that may run by now (decision e: from round
 * (e + 2) K on). Every rank applies the same ones here: no round mixes two assignments. */
static int coll_apply_ready(pc_coll *c, int64_t n)
{
    int64_t K = c->spec.rebalance_every;
    int done = 0, rc = PC_OK;
    while (done < c->npend && c->pend[done].epoch < c->ready && (c->pend[done].epoch + 2) * K <= n) {
        if (c->nswitched == c->capswitched) {
            int64_t cap = 2 * c->capswitched + 8;
            int64_t *p = realloc(c->switched, sizeof(int64_t) * (size_t)cap);
            if (!p) { rc = fail(PC_ERR_NOMEM, "out of memory for the owners' switches"); break; }
            c->switched = p;
            c->capswitched = cap;
        }
        coll_switch *w = &c->pend[done++];
        c->switched[c->nswitched++] = n;
        for (int k = 0; k < 2; k++) {
            if (!w->s[k]) continue;
            coll_retire(c, c->sched[k][0]);
            c->sched[k][0] = w->s[k];
        }
    }
    c->npend -= done;
    memmove(c->pend, c->pend + done, sizeof(coll_switch) * (size_t)c->npend);
    return rc;
}

static void coll_listen(pc_coll *c);

/* Arm round n. now: the event's clock, as the kicks' (progress.c). */
static int coll_arm(pc_coll *c, int64_t n, double now)
{
    if (c->peer_heard && n >= c->rep.peer.upto) {      /* a peer's report: this round cannot come */
        c->armed = NULL;
        coll_peer_failed(c);
        return PC_OK;
    }
    int64_t K = c->spec.rebalance_every;
    if (K > 0 && n >= PC_SNAPS * K && c->decided < n / K - (PC_SNAPS - 1)) {   /* decisions lag too far */
        c->parked = n;
        coll_listen(c);                  /* no schedule runs: still hear the peers */
        return PC_OK;
    }
    if (K > 0 && n % K == 0) {
        int rc = coll_apply_ready(c, n);
        if (rc) return rc;
    }
    int kind = pc_coll_round_kind(c, n), v = (int)(n % c->variants);
    pc_sched *s = c->sched[kind][v];
    if (!s) return fail(PC_ERR_STATE, "no schedule for round %lld (kind %d, variant %d)", (long long)n, kind, v);
    c->armed_round = n;
    c->armed = s;
    c->triggered = 0;
    c->taken = 0;
    int rc = sched_begin_at(s, n, now);
    if (rc) return rc;
    return coll_maybe_trigger(c, &now);
}

static int coll_take(pc_owner *o)
{
    pc_coll *c = (pc_coll *)o;
    int64_t k = c->posts - c->taken_posts;   /* the posts whose data this round takes */
    if (k > 1 && c->spec.accumulate != PC_ACC_SUM && acc_holds(c)) {
        /* the accumulator holds a sum (weighted for RNA) of k posts: make it their mean */
        void *acc = acc_of(c);
        double d = c->spec.accumulate == PC_ACC_MEAN ? (double)k : (double)k * (double)(k + 1) / 2.0;
        int rc = pc_reduce_div(PC_OP_COPY, c->spec.dtype, acc, acc, acc, c->spec.count, d);
        if (rc) return rc;
    }
    switch (c->input) {
    case IN_WORK:                      /* a direct post already placed the data */
        break;
    case IN_LENT:                      /* the round runs in the lent buffer */
        c->work_slot = c->user;
        break;
    case IN_ACC:
        swap_ptr(&c->acc, &c->work);
        c->work_slot = c->work;
        break;
    default:
        if (!c->spec.never_posts) fill_identity(c, c->work);   /* a dedicated server's read nothing */
    }
    c->input = IN_NONE;
    c->taken = 1;
    /* telemetry.c: this rank's view of the round's start (and its arrivals, into its row of times) */
    tele_take(&c->tele, c->armed_round, c->spec.timed ? c->meas : NULL);
    c->round_lo = c->taken_posts;      /* this rank's posts [round_lo, round_hi) are in the round */
    c->round_hi = c->taken_posts = c->posts;
    uint64_t *m = c->mask_slot;
    int W = W_of(c);
    memset(m, 0, sizeof(uint64_t) * (size_t)c->spec.mask_words);
    if (c->spec.timed) {               /* my row of the owners' times, measured since my last TAKE */
        int P = c->size;
        if (c->spec.rebalance_every > 0) {     /* and my run delay and CPU time since then: CPU starvation */
            int64_t cpu, now = idle_run_delay_ns(&cpu);  /* (my words of the row, as tele_take's arrivals) */
            int first = c->run_cpu <= 0;       /* no TAKE before: nothing measured since one */
            c->meas[(size_t)PC_TIME_RUN_DELAY * (size_t)P + (size_t)c->rank] =
                !first && now > c->run_delay ? now - c->run_delay : 0;
            c->meas[(size_t)PC_TIME_RUN_CPU * (size_t)P + (size_t)c->rank] =
                !first && cpu > c->run_cpu ? cpu - c->run_cpu : 0;
            c->run_delay = now;
            c->run_cpu = cpu;
        }
        memcpy(m + pc_coll_mask_words(P) + PC_TIME_FIELDS * (size_t)P * (size_t)c->rank, c->meas,
               sizeof(int64_t) * PC_TIME_FIELDS * (size_t)P);
        memset(c->meas, 0, sizeof(int64_t) * PC_TIME_FIELDS * (size_t)P);
        m[pc_coll_mask_words(P) + PC_TIME_FIELDS * (size_t)P * (size_t)P + (size_t)c->rank] = (uint64_t)c->decided;
    }
    if (k > 0) m[c->rank / 64] |= 1ULL << (c->rank % 64);
    if (c->closing) m[W + c->rank / 64] |= 1ULL << (c->rank % 64);
    m[2 * W + c->rank] = (uint64_t)k;
    return PC_OK;
}

static int coll_round_end(pc_coll *c, int64_t n, int all_closing)
{
    tele_round(&c->tele, n, c->mask_slot, W_of(c), pc_coll_round_kind(c, n));   /* telemetry.c */
    c->res_round = n;
    if (all_closing && c->closing) STORE(c->finished, 1);
    STORE(c->completed, n + 1);
    return PC_OK;
}

/* Fold a round's mask into the pending result's: active and closing bits OR, posts summed. */
static void mask_fold(pc_coll *c, const uint64_t *m)
{
    int W = W_of(c);
    for (int w = 0; w < 2 * W; w++) c->res_mask[w] |= m[w];
    for (int r = 0; r < c->size; r++) c->res_mask[2 * W + r] += m[2 * W + r];
}

/* ------------------------------------------------------------------ owners
 * Load-aware owners (algorithm "ps" with balance=, partialcoll/balance.py). A timed
 * schedule names (send, receive, owner) per block this rank sends away; when a round has
 * completed here, coll_measure adds each owner's span (first send to it -> last result
 * from it) and block count to meas. The next round's TAKE writes meas as this rank's row
 * of the MASK slot (PC_TIME_FIELDS P words per rank; BOR of disjoint rows is a gather), and its
 * DELIVER sums the rows into agreed: the same numbers on every rank, since every rank
 * delivers every round. Every K = rebalance_every rounds, agreed becomes epoch e's
 * snapshot; Python (every rank alike) computes decision e from it and hands the new
 * schedules to pc_coll_switch; they run from round (e + 2) K on, on every rank, so no
 * round mixes two assignments. A round that needs a decision not yet in is parked and
 * armed by pc_coll_switch. Replaced schedules are retired: freed once no progress pass
 * pins the collective (a pass may hold a pointer to a schedule it copied from the
 * running list), else when the collective is freed. Everything here: unit lock held. */
static void coll_measure(pc_coll *c, const pc_sched *s)
{
    int P = c->size;
    double sent[P], first[P], last[P];
    int64_t blocks[P];
    for (int o = 0; o < P; o++) { sent[o] = first[o] = 1e300; last[o] = 0; blocks[o] = 0; }
    for (int i = 0; i < s->ntimers; i++) {
        const int *t = s->timers + 3 * i;
        int o = t[2];
        double ts = s->ops[t[0]].t_us, tr = s->ops[t[1]].t_us;
        if (ts < sent[o]) sent[o] = ts;
        if (tr < first[o]) first[o] = tr;
        if (tr > last[o]) last[o] = tr;
        blocks[o]++;
    }
    for (int o = 0; o < P; o++) {     /* meas: spans, first results' latencies, blocks, samples */
        if (!blocks[o] || last[o] < sent[o]) continue;
        c->meas[o] += (int64_t)((last[o] - sent[o]) * 1e3);
        c->meas[P + o] += (int64_t)((first[o] - sent[o]) * 1e3);
        c->meas[2 * P + o] += blocks[o];
        c->meas[3 * P + o] += 1;
    }
}

/* DELIVER: sum every rank's row of times into agreed, and take the least number of
 * decisions any rank had received at its TAKE (the words after the rows) as ready. */
static void coll_agree_times(pc_coll *c, const uint64_t *rows)
{
    int P = c->size;
    for (int r = 0; r < P; r++)
        for (int j = 0; j < PC_TIME_FIELDS * P; j++)
            c->agreed[j] += (int64_t)rows[PC_TIME_FIELDS * (size_t)P * (size_t)r + (size_t)j];
    const uint64_t *decided = rows + PC_TIME_FIELDS * (size_t)P * (size_t)P;
    int64_t least = (int64_t)decided[0];
    for (int r = 1; r < P; r++) if ((int64_t)decided[r] < least) least = (int64_t)decided[r];
    if (least > c->ready) c->ready = least;
}

/* The collective stopped (finished, failed, reported, abandoned): a balancer waiting in
 * pc_coll_stats for its next epoch wakes and ends (E.books; other waiters see E.done). */
static void coll_books_stop(pc_coll *c)
{
    if (c->spec.timed) notify_books();
}

/* Round n has completed here: if it ends an epoch, publish the epoch's snapshot. Only
 * now, not at DELIVER, so that the decision made from it comes after the next round was
 * armed (applying the previous decision's switch): one switch pending at a time. */
static void coll_epoch_end(pc_coll *c, int64_t n)
{
    int P = c->size;
    int64_t K = c->spec.rebalance_every;
    if (K <= 0 || (n + 1) % K) return;
    int64_t e = (n + 1) / K - 1;
    memcpy(c->snap[e % PC_SNAPS], c->agreed, sizeof(int64_t) * PC_TIME_FIELDS * (size_t)P);
    memset(c->agreed, 0, sizeof(int64_t) * PC_TIME_FIELDS * (size_t)P);
    STORE(c->epochs, e + 1);
    notify_books();                    /* pc_coll_stats waits for it */
}

/* Free the retired schedules if no pass holds the collective (E.lock: passes). */
static void coll_reap_retired(pc_coll *c)
{
    pthread_mutex_lock(&E.lock);
    int free_now = c->owner.unit.passes == 0;
    pthread_mutex_unlock(&E.lock);
    if (!free_now) return;
    for (int i = 0; i < c->nretired; i++) {
        sched_add_traffic(c->retired[i], c->retired_sent, c->size);
        sched_destroy(c->retired[i]);
    }
    c->nretired = 0;
}

static void coll_retire(pc_coll *c, pc_sched *s)
{
    if (!s) return;
    if (c->nretired == c->capretired) {
        int cap = 2 * c->capretired + 4;
        pc_sched **p = realloc(c->retired, sizeof(pc_sched *) * (size_t)cap);
        if (!p) return;                /* kept running nowhere: leaked rather than freed under a pass */
        c->retired = p;
        c->capretired = cap;
    }
    c->retired[c->nretired++] = s;
}

static int coll_deliver(pc_owner *o)
{
    pc_coll *c = (pc_coll *)o;
    int64_t n = c->armed_round;
    int W = W_of(c), all_closing = 1;
    uint64_t *m = c->mask_slot;
    /* The masks were reduced in this round (BOR) in every mode, full included: which
     * ranks were active and which closing is agreed, never taken from local state. */
    for (int r = 0; r < c->size; r++) all_closing &= (int)((m[W + r / 64] >> (r % 64)) & 1);
    if (c->close_seen < 0)
        for (int w = 0; w < W; w++) if (m[W + w]) c->close_seen = n;
    int64_t nap = 0, posts = 0;
    for (int w = 0; w < W; w++) nap += __builtin_popcountll(m[w]);
    for (int r = 0; r < c->size; r++) posts += (int64_t)m[2 * W + r];
    if (c->spec.timed) coll_agree_times(c, m + pc_coll_mask_words(c->size));
    void *src = c->work_slot;
    if ((c->fold || c->closing) && c->pending > 0) {
        result_internal(c);               /* never write into a completed request's buffer */
        int rc = pc_reduce_local(c->spec.redop, c->spec.dtype, c->result, src, c->result, c->spec.count);
        if (rc) return rc;
        if (src != c->work) {             /* the round ran in user: folded, given back */
            c->work_slot = c->work;
            c->user = NULL;
        }
        c->pending++;
        c->res_nap += nap;
        c->res_posts += posts;
        c->res_hi = c->round_hi;
        mask_fold(c, m);
        return coll_round_end(c, n, all_closing);
    }
    c->res_nap = nap;
    c->res_posts = posts;
    c->res_lo = c->round_lo;
    c->res_hi = c->round_hi;
    memcpy(c->res_mask, m, sizeof(uint64_t) * (size_t)pc_coll_mask_words(c->size));
    if (src != c->work) {         /* the round ran in user: the result stays there */
        c->work_slot = c->work;
    } else {                      /* an older result in user is not the latest any more */
        if (result_in_user(c)) c->user = NULL;
        swap_ptr(&c->work, &c->result);
        c->work_slot = c->work;
    }
    c->pending = 1;
    return coll_round_end(c, n, all_closing);
}

static void coll_deaf(pc_coll *c);

static void coll_round_done(pc_owner *o, pc_sched *s)
{
    (void)s;
    pc_coll *c = (pc_coll *)o;
    if (c->armed && c->armed->ntimers) coll_measure(c, c->armed);
    if (c->spec.timed) coll_epoch_end(c, c->armed_round);
    c->armed = NULL;
    if (LOAD(c->finished) || c->err || c->abandoned) {
        coll_books_stop(c);
        return;
    }
    /* the next round is armed in the step that completed this one: the pass noted that
     * completion just before (sched_progress), and where the round is small, no clock is
     * read again for the arming (a read costs 0.1 - 0.3 us in a VM; this is on an 8 B
     * round's critical path). A large round's reductions may have taken long since. */
    int rc = coll_arm(c, LOAD(c->completed), c->nbytes < (size_t)E.policy.busy_bytes ? -1 : 0);
    if (rc && !c->err) {
        c->errpeer = pc_last_error_peer();
        snprintf(c->errmsg, sizeof c->errmsg, "%s", pc_last_error());
        STORE(c->err, rc);
        coll_deaf(c);
        coll_books_stop(c);
    }
}

/* Stop listening for peer errors; an abandoned collective's communicator may be freed
 * already, so its receive is cancelled, never completed by a message. */
static void coll_deaf(pc_coll *c)
{
    report_deaf(&c->rep, c->abandoned);
}

static void coll_failed(pc_owner *o, int code, int peer, const char *msg)
{
    pc_coll *c = (pc_coll *)o;
    if (c->err) return;
    c->errpeer = peer;
    snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
    STORE(c->err, code);
    coll_deaf(c);     /* no round runs any more: nothing to be told */
    coll_books_stop(c);
}

/* A peer's report takes effect (unit lock held): the collective fails here with
 * PC_ERR_PEER, its armed round is withdrawn, and waiters wake. */
static void coll_peer_failed(pc_coll *c)
{
    c->peer_heard = 0;
    c->errpeer = c->rep.peer.rank;
    report_describe(&c->rep, c->rank, c->errmsg, sizeof c->errmsg);
    STORE(c->err, PC_ERR_PEER);
    if (c->armed && c->armed->running) sched_withdraw(c->armed);
    note_event();
    notify_done();
    coll_books_stop(c);
}

/* How long a round the reporter completed may take here before the report fails it
 * anyway (its messages should all be in by then: the reporter's part of it is done). */
#define PC_PEER_GRACE_US 2e6

/* [pass] A peer's report (pc_coll_abort on that rank). A round the reporter completed
 * (armed_round < upto: slower ranks are still in it) completes here too, and the report
 * fails the next round when it is armed (coll_arm); a round the reporter did not
 * complete fails now. Unit lock held. */
static void coll_send_report(pc_coll *c);

/* On E.polled while no schedule of c runs but it has messages of its own: a parked round
 * (it still hears its peers' reports), a report deferred (a pass sends it, and c is not
 * freed before). Unit lock held. */
static void coll_listen(pc_coll *c)
{
    int parked = c->parked >= 0 && !c->err && !c->abandoned && !LOAD(c->finished);
    unit_listen(&c->owner.unit, parked || c->rep.pending, c->rep.pending);
}

static int coll_poll_once(pc_coll *c);

static int coll_poll(pc_unit *u)
{
    pc_coll *c = (pc_coll *)u;
    int progressed = coll_poll_once(c);
    coll_listen(c);
    return progressed;
}

/* A pass tests the alarm receive (a peer's report) at most every PC_ALARM_US while a round
 * of the collective runs: each test is an MPI progress call, as costly as the round's own
 * (at P = 2, 8 B: a fifth of a waiting thread's instructions were the alarm's MPI_Test,
 * every pass), and a report needs no microseconds. A parked or idle collective tests it
 * at every pass. Unit lock held. (On the coarse clock, once a tick of 1 - 4 ms, rounds
 * of quorum(2) at P = 4 under Fig. 9's skew took 11 % longer: these tests' MPI progress
 * counts there.) */
#define PC_ALARM_US 100.0

static int coll_alarm_due(pc_coll *c)
{
    if (!c->armed || !c->armed->running) return 1;
    double now = now_us();
    if (now - c->alarm_us < PC_ALARM_US) return 0;
    c->alarm_us = now;
    return 1;
}

static int coll_poll_once(pc_coll *c)
{
    if (c->rep.pending) {                /* recorded where no MPI call may be made (abandon) */
        coll_send_report(c);
        return 1;
    }
    if (c->peer_heard && !c->err && now_us() - c->peer_heard_us > PC_PEER_GRACE_US) {
        coll_peer_failed(c);
        return 1;
    }
    if (!c->rep.alarm.nsend && !coll_alarm_due(c)) return 0;
    if (!report_heard(&c->rep)) return 0;
    if (c->err || c->rep.made || LOAD(c->finished)) return 1;
    if (c->armed && c->armed->running && c->armed_round < c->rep.peer.upto) {
        c->peer_heard = 1;               /* this round completes; coll_arm fails the next */
        c->peer_heard_us = now_us();
        return 1;
    }
    coll_peer_failed(c);
    return 1;
}

static void coll_destroy(pc_coll *c)
{
    int leaked = c->owner.unit.leaked;     /* MPI may still touch its buffers: kept */
    for (int k = 0; k < 2; k++) {
        for (int v = 0; c->sched[k] && v < c->variants; v++) if (c->sched[k][v]) sched_destroy(c->sched[k][v]);
        free(c->sched[k]);
        for (int i = 0; i < c->npend; i++) if (c->pend[i].s[k]) sched_destroy(c->pend[i].s[k]);
    }
    for (int i = 0; i < c->nretired; i++) sched_destroy(c->retired[i]);
    for (int i = 0; i < PC_SNAPS; i++) free(c->snap[i]);
    free(c->retired); free(c->meas); free(c->agreed); free(c->retired_sent); free(c->switched);
    if (!leaked) {
        for (int b = 0; b < 3; b++) free(c->buf[b]);
        free(c->mask_slot);
    }
    free(c->res_mask); free((void *)c->spec.identity);
    report_free(&c->rep);
    tele_free(&c->tele);
    pthread_mutex_destroy(&c->owner.unit.lock);
    free(c);
}

static void coll_unit_destroy(pc_unit *u) { coll_destroy((pc_coll *)u); }

/* Dropped without close(): the armed round is withdrawn unless it has read this rank's
 * input (then it finishes, so peers are not left with half a message). */
static void coll_unit_abandon(pc_unit *u)
{
    pc_coll *c = (pc_coll *)u;
    pc_sched *s = c->armed;
    if (s && s->running && !s->live) sched_withdraw(s);
    coll_deaf(c);
}

int pc_coll_create(const pc_collspec *spec, void *comm_handle, pc_coll **out)
{
    if (!pc_op_valid(spec->redop, spec->dtype) || spec->redop == PC_OP_COPY)
        return fail(PC_ERR_DTYPE_OP, "reduction op %d is not defined for dtype %d", spec->redop, spec->dtype);
    if (spec->count < 0) return fail(PC_ERR_ARG, "count must be >= 0");
    if (spec->dtype < 0 || spec->dtype >= PC_DT_COUNT || spec->count > (INT64_MAX / 4) / pc_dt_size[spec->dtype])
        return fail(PC_ERR_NOMEM, "a partial allreduce of %lld elements is too large", (long long)spec->count);
    if (spec->mode < PC_MODE_SOLO || spec->mode > PC_MODE_FULL || spec->late < PC_LATE_LATEST
        || spec->late > PC_LATE_FOLD || spec->variants < 0 || spec->max_staleness < 0 || !spec->identity
        || spec->accumulate < PC_ACC_SUM || spec->accumulate > PC_ACC_RNA || (spec->never_posts & ~1)
        || (spec->accumulate != PC_ACC_SUM && !(spec->redop == PC_OP_SUM && pc_div_valid(PC_OP_SUM, spec->dtype))))
        return fail(PC_ERR_ARG, "bad collective spec (mode %d, late %d, variants %d)", spec->mode, spec->late,
                    spec->variants);
    int rank, size;
    if (mpi_comm_info(*(MPI_Comm *)comm_handle, &rank, &size)) return PC_ERR_MPI;
    if (spec->timed && pc_coll_timed_words(size) < 0)
        return fail(PC_ERR_ARG, "timed owners keep PC_TIME_FIELDS P^2 words per round: too many at P = %d", size);
    int want = pc_coll_mask_words(size) + (spec->timed ? pc_coll_timed_words(size) : 0);
    if (spec->mask_words != want)
        return fail(PC_ERR_ARG, "mask_words is %d, but P = %d needs %d (pc_coll_mask_words%s)", spec->mask_words,
                    size, want, spec->timed ? " + pc_coll_timed_words" : "");
    if (spec->rebalance_every < 0 || (spec->rebalance_every > 0 && !spec->timed) || (spec->variants > 1 && spec->timed))
        return fail(PC_ERR_ARG, "rebalance_every needs timed schedules, and timed ones one variant");
    if ((spec->mode == PC_MODE_PROBE && (spec->candidates < 1 || spec->candidates > size))
        || (spec->mode == PC_MODE_QUORUM && (spec->quorum < 1 || spec->quorum > size)))
        return fail(PC_ERR_ARG, "probe's q or quorum's k out of [1, %d]", size);
    pc_coll *c = calloc(1, sizeof *c);
    if (!c) return fail(PC_ERR_NOMEM, "out of memory");
    unit_init(&c->owner.unit, coll_unit_destroy, coll_unit_abandon);
    c->owner.unit.poll = coll_poll;
    c->rep.alarm.comm = *(MPI_Comm *)comm_handle;
    c->rank = rank;
    c->size = size;
    c->spec = *spec;
    c->spec.identity = NULL;              /* ours is copied below; the caller's is never freed */
    c->itemsize = pc_dt_size[spec->dtype];
    c->nbytes = (size_t)spec->count * c->itemsize;
    void *id = malloc(c->itemsize);
    size_t mbytes = sizeof(uint64_t) * (size_t)spec->mask_words;
    c->variants = c->spec.variants = spec->variants > 0 ? spec->variants : 1;
    c->mask_slot = calloc(1, mbytes);
    c->res_mask = calloc(1, mbytes);
    for (int k = 0; k < 2; k++) c->sched[k] = calloc((size_t)c->variants, sizeof(pc_sched *));
    for (int b = 0; b < 3; b++) c->buf[b] = malloc(c->nbytes ? c->nbytes : 1);
    size_t tb = sizeof(int64_t) * PC_TIME_FIELDS * (size_t)size;
    c->meas = calloc(1, tb); c->agreed = calloc(1, tb);
    int snaps = 1;
    for (int i = 0; i < PC_SNAPS; i++) snaps &= (c->snap[i] = calloc(1, tb)) != NULL;
    c->retired_sent = calloc((size_t)size, sizeof(int64_t));
    c->parked = -1;
    if (!c->meas || !c->agreed || !snaps || !c->retired_sent || tele_init(&c->tele, rank, size)) {
        free(id);
        coll_destroy(c);
        return fail(PC_ERR_NOMEM, "out of memory");
    }
    if (!id || !c->mask_slot || !c->res_mask || !c->sched[0] || !c->sched[1] || !c->buf[0] || !c->buf[1] || !c->buf[2]) {
        free(id);
        coll_destroy(c);
        return fail(PC_ERR_NOMEM, "out of memory for a partial allreduce of %zu bytes", c->nbytes);
    }
    memcpy(id, spec->identity, c->itemsize);
    c->spec.identity = id;
    c->acc = c->buf[0]; c->work = c->buf[1]; c->result = c->buf[2];
    c->work_slot = c->work;
    c->owner.slot[PC_SLOT_WORK] = &c->work_slot;
    c->owner.slot_bytes[PC_SLOT_WORK] = (int64_t)c->nbytes;
    c->owner.slot[PC_SLOT_MASK] = &c->mask_slot;
    c->owner.slot_bytes[PC_SLOT_MASK] = (int64_t)mbytes;
    c->owner.take = coll_take;
    c->owner.deliver = coll_deliver;
    c->owner.done = coll_round_done;
    c->owner.failed = coll_failed;
    c->fold = spec->late == PC_LATE_FOLD;
    c->armed_round = -1;
    c->close_seen = -1;
    fill_identity(c, c->result);
    *out = c;
    return PC_OK;
}

int pc_coll_set_sched(pc_coll *c, int kind, int variant, pc_sched *s)
{
    if (kind < 0 || kind > 1 || variant < 0 || variant >= c->variants || !s || s->owner != &c->owner)
        return fail(PC_ERR_ARG, "bad schedule for this collective (kind %d, variant %d of %d)", kind, variant,
                    c->variants);
    if (c->sched[kind][variant]) return fail(PC_ERR_STATE, "kind %d, variant %d has a schedule already", kind, variant);
    c->sched[kind][variant] = s;
    return PC_OK;
}

int pc_coll_begin(pc_coll *c)
{
    unit_lock(&c->owner.unit);
    int rc = !LOAD(E.started) ? fail(PC_ERR_STATE, "the engine is not running") : coll_arm(c, 0, 0);
    if (rc == PC_OK && c->size > 1) rc = report_listen(&c->rep, c->rep.alarm.comm, c->spec.ident);
    unit_unlock(&c->owner.unit);
    return rc;
}

static int coll_error(pc_coll *c) { return fail_at(c->err, c->errpeer, c->errmsg); }

/* Every post begins here: refuse after an error or close, number the post. */
static int coll_post_begin(pc_coll *c, int64_t *index, int *late)
{
    if (c->err) return coll_error(c);
    if (c->closing) return fail(PC_ERR_STATE, "post after close");
    *index = c->posts;
    /* late: round #index has already read this rank's input (or completed) */
    *late = c->completed > c->posts || (c->armed_round == c->posts && c->taken);
    return PC_OK;
}

/* ... and ends here, once x is in place: count it, and start the round if eligible. */
static int coll_post_end(pc_coll *c)
{
    int64_t n = c->posts;
    tele_post(&c->tele, n);            /* telemetry.c: before the post may start its round */
    c->claimed[(n % PC_CLAIMS) / 64] &= ~(1ULL << (n % 64));   /* its request: not taken */
    c->posts++;
    note_post();
    /* the clock is read once per post, after its round's first messages are out: by the
     * kick where the post starts its round (that event's time), else for the telemetry */
    double now = 0;
    int rc = coll_maybe_trigger(c, &now);
    if (c->tele.cap) tele_post_time(&c->tele, n, now > 0 ? now : now_us());
    return rc == PC_OK && c->err ? coll_error(c) : rc;
}

/* A post (unit lock held); *alone_out: whether it was alone. */
static int coll_post_locked(pc_coll *c, const void *x, void *out, int64_t *index, int *late, int *alone_out)
{
    int rc = coll_post_begin(c, index, late);
    if (rc) return rc;
    /* a user's buffer is used in place only where no other request is outstanding (every
     * earlier one taken, and an early take's returned: takes): no other request names it,
     * nor will copy a result into it */
    int alone = c->takes == c->posts;
    *alone_out = alone;
    int direct = alone && c->spec.mode == PC_MODE_FULL && c->armed_round == c->posts && c->armed && !c->triggered
                 && c->input == IN_NONE && !(c->fold && c->pending > 0);
    if (direct) {                        /* full mode: x goes straight into the round's buffer */
        void *dst = out ? out : c->work;
        if (dst != x) memcpy(dst, x, c->nbytes);
        c->work_slot = dst;
        if (out) c->user = out;
        c->input = IN_WORK;
    } else {
        void *lend = out == x && !*late && alone ? out : NULL;   /* in place: x itself becomes acc */
        if (acc_holds(c)) {
            void *acc = acc_of(c);
            /* RNA: the j-th post since the last TAKE weighs j (the first one is copied) */
            rc = c->spec.accumulate == PC_ACC_RNA
                 ? pc_axpy(c->spec.dtype, acc, x, lend ? lend : c->acc, c->spec.count,
                           (double)(c->posts - c->taken_posts + 1))
                 : pc_reduce_local(c->spec.redop, c->spec.dtype, acc, x, lend ? lend : c->acc, c->spec.count);
            if (rc) return rc;
        } else if (!lend) {
            memcpy(c->acc, x, c->nbytes);
        }
        if (lend) c->user = lend;        /* alone: user was free */
        else if (c->input == IN_LENT) c->user = NULL;   /* folded into acc: given back */
        c->input = lend ? IN_LENT : IN_ACC;
    }
    return coll_post_end(c);
}

static int coll_post(pc_coll *c, const void *x, void *out, int64_t *index, int *late)
{
    int alone;
    unit_lock(&c->owner.unit);
    int rc = coll_post_locked(c, x, out, index, late, &alone);
    unit_unlock(&c->owner.unit);
    return rc;
}

/* Staged posts (device buffers, partialcoll/_device.py). The caller keeps a copy of
 * what its earlier posts put into acc and folds x into it where x lives (on the GPU),
 * so that a post costs one device-side op and one copy to the host:
 *   pc_coll_acc_full:     does acc hold posts that no round has taken yet?
 *   pc_coll_post_replace: if it still does, acc = x (x is acc (op) the new post) and
 *                         the post counts; if a TAKE emptied acc meanwhile, nothing
 *                         happens (*replaced = 0) and the caller posts the new data alone.
 * Only posts fill acc, and only TAKE empties it, so "still full" means "unchanged". */
static int coll_acc_full(pc_coll *c, int *full)
{
    unit_lock(&c->owner.unit);
    *full = acc_holds(c);
    int rc = c->err ? coll_error(c) : PC_OK;
    unit_unlock(&c->owner.unit);
    return rc;
}

static int coll_user_buffers(pc_coll *c, void *bufs[3])
{
    unit_lock(&c->owner.unit);
    bufs[0] = c->user;                 /* the only one */
    bufs[1] = bufs[2] = NULL;
    unit_unlock(&c->owner.unit);
    return PC_OK;
}

static int coll_post_replace(pc_coll *c, const void *x, int64_t *index, int *late, int *replaced)
{
    unit_lock(&c->owner.unit);
    int rc = coll_post_begin(c, index, late);
    *replaced = 0;
    if (rc == PC_OK && acc_holds(c)) {
        if (c->input == IN_LENT) c->user = NULL;
        memcpy(c->acc, x, c->nbytes);
        c->input = IN_ACC;
        *replaced = 1;
        rc = coll_post_end(c);
    }
    unit_unlock(&c->owner.unit);
    return rc;
}

typedef struct { pc_coll *c; int64_t index; } coll_wait_arg;

/* Read without the unit lock: completed, finished and err are atomic. */
static int coll_reached(void *p)
{
    coll_wait_arg *a = p;
    return LOAD(a->c->err) || LOAD(a->c->finished) || LOAD(a->c->completed) > a->index;
}

/* A round that completed here before a peer's report failed the collective keeps its
 * result: its wait and test succeed (unit lock held, or err read once). */
static int coll_round_kept(pc_coll *c, int64_t index)
{
    return c->err == PC_ERR_PEER && LOAD(c->completed) > index;
}

static int coll_checked_error(pc_coll *c)
{
    unit_lock(&c->owner.unit);
    int rc = c->err ? coll_error(c) : PC_OK;
    unit_unlock(&c->owner.unit);
    return rc;
}

static int coll_test(pc_coll *c, int64_t index, int *done)
{
    coll_wait_arg a = {c, index};
    /* one pass here too, as MPI_Test progresses: the post did not wake a napping thread */
    if (!coll_reached(&a)) engine_pass();
    *done = coll_reached(&a);
    return LOAD(c->err) && !coll_round_kept(c, index) ? coll_checked_error(c) : PC_OK;
}

static int coll_silent(pc_coll *c, int *ranks, int max, int64_t *round, int *n)
{
    *round = -1;
    *n = 0;
    if (unit_lock_within(&c->owner.unit, 1.0)) return PC_OK;     /* busy inside MPI: nobody named */
    *round = c->armed_round;
    *n = sched_silent_peers(c->armed, ranks, max);
    unit_unlock(&c->owner.unit);
    return PC_OK;
}

/* A request's claim on its result (unit lock held): the first take of request `index`
 * gets it, any other take of it (a C caller taking twice; Python elects one taker per
 * request, its other waits return that taker's Result) is refused, so that takes counts
 * each request once. The claims of the last PC_CLAIMS posts are kept; an older request's
 * take is not checked. */
static int coll_claim(pc_coll *c, int64_t index)
{
    if (index < 0 || index >= c->posts)
        return fail(PC_ERR_ARG, "no request %lld here (%lld posts)", (long long)index, (long long)c->posts);
    if (index < c->posts - PC_CLAIMS) return PC_OK;
    uint64_t *w = &c->claimed[(index % PC_CLAIMS) / 64], bit = 1ULL << (index % 64);
    if (*w & bit)
        return fail(PC_ERR_STATE, "the result of request %lld (round %lld) was taken already: one take per "
                    "request", (long long)index, (long long)index);
    *w |= bit;
    return PC_OK;
}

/* Copy out the result (unit lock held): the latest round (latest), or the fold of the
 * rounds not yet taken (fold, and always after close). */
static void coll_take_result_locked(pc_coll *c, int64_t index, void *out, uint64_t *mask, pc_result *info)
{
    if (c->input == IN_LENT && c->user == out) acc_internal(c);   /* out is the caller's now */
    void *src = result_in_user(c) ? c->user : c->result;
    int folding = c->fold || c->closing;
    int none = folding && c->pending == 0;
    if (none) fill_identity(c, out);
    else if (out != src) memcpy(out, src, c->nbytes);
    info->round = c->res_round;
    info->rounds = folding ? c->pending : (LOAD(c->completed) > 0);
    info->nap = none ? 0 : c->res_nap;
    info->posts = none ? 0 : c->res_posts;
    info->post_lo = none ? 0 : c->res_lo;
    info->post_hi = none ? 0 : c->res_hi;
    /* latest: the same result is what the next wait gets if no round completes before it
     * (a request not waited for yet, or a late post), so when it lives in a user's buffer,
     * which is the user's again from now on, keep a copy -- unless no such wait can come:
     * every post is taken and the next one waits for a later round (a post+wait loop). */
    if (result_in_user(c) && !folding && (c->takes + 1 < c->posts || c->posts <= c->res_round))
        result_internal(c);
    if (index < PC_CLOSE_INDEX) c->takes++;    /* a request's (each is taken once: Python's wait) */
    if (result_in_user(c)) c->user = NULL;   /* the result is in out now: user is theirs again */
    info->finished = LOAD(c->finished);
    size_t mw = (size_t)pc_coll_mask_words(c->size);
    if (none) memset(mask, 0, sizeof(uint64_t) * mw);
    else memcpy(mask, c->res_mask, sizeof(uint64_t) * mw);
    if (folding) memset(c->res_mask, 0, sizeof(uint64_t) * mw);   /* the next fold starts empty */
    c->pending = 0;
}

/* Wait for round `index` (no lock held: the predicate reads atomics), then take the
 * result under the unit lock. */
static int coll_wait_take(pc_coll *c, int64_t index, double timeout_s, void *out, uint64_t *mask, pc_result *info)
{
    coll_wait_arg a = {c, index};
    int rc = coll_reached(&a) ? PC_OK : wait_until(coll_reached, &a, timeout_s);
    if (rc == PC_ERR_TIMEOUT)
        return fail(PC_ERR_TIMEOUT, "round %lld did not complete at rank %d "
                    "(%lld rounds completed here; the round waits for its initiator or for peers)",
                    (long long)(index >= PC_CLOSE_INDEX ? LOAD(c->completed) : index), c->rank,
                    (long long)LOAD(c->completed));
    if (rc) return rc;
    /* the lock within the timeout and a grace: a wait never hangs on a thread stuck in MPI.
     * The round has completed: not getting the lock is no slice that ran out (a Timeout
     * the caller would wait again for), it is that stuck call: an MPI error */
    if (unit_lock_within(&c->owner.unit, timeout_s < 0 ? -1 : timeout_s + 5.0)) {
        char why[256];
        snprintf(why, sizeof why, "%s", pc_last_error());
        return fail(PC_ERR_MPI, "round %lld completed at rank %d, but %s", (long long)index, c->rank, why);
    }
    if (c->err && !coll_round_kept(c, index)) rc = coll_error(c);
    else if (index >= PC_CLOSE_INDEX || (rc = coll_claim(c, index)) == PC_OK)
        coll_take_result_locked(c, index, out, mask, info);
    unit_unlock(&c->owner.unit);
    return rc;
}

/* The small-message path of post(x, out=y).wait() (partialcoll/_partial.py), with no
 * out-parameters to allocate per call:
 *   pc_coll_post1: pc_coll_post; returns (index << 1) | late, or -code
 *   pc_coll_wait1: pc_coll_wait_take into res[0..6] = round, rounds, nap, post_lo,
 *                  post_hi, finished, posts, then the mask words */
int64_t pc_coll_post1(pc_coll *c, const void *x, void *out)
{
    int64_t index = 0;
    int late = 0;
    int rc = pc_coll_post(c, x, out, &index, &late);
    return rc ? -(int64_t)rc : (index << 1) | late;
}

static void res_of(int64_t *res, const pc_result *info)
{
    res[0] = info->round; res[1] = info->rounds; res[2] = info->nap;
    res[3] = info->post_lo; res[4] = info->post_hi; res[5] = info->finished; res[6] = info->posts;
}

int pc_coll_wait1(pc_coll *c, int64_t index, double timeout_s, void *out, int64_t *res)
{
    pc_result info;
    int rc = pc_coll_wait_take(c, index, timeout_s, out, (uint64_t *)(res + 7), &info);
    if (rc == PC_OK) res_of(res, &info);
    return rc;
}

/* A result's shape, from the words wait1 writes (round, rounds, nap, post_lo, post_hi,
 * finished, posts, mask words): its rounds, nap, posts and, where one mask word holds them
 * (P <= 64), its active and closing bits. */
static void res_shape(const int64_t *res, int64_t shape[5])
{
    shape[0] = res[1]; shape[1] = res[2]; shape[2] = res[6]; shape[3] = res[7]; shape[4] = res[8];
}

/* The result is request index's own round, with its post inside. */
static int res_own_round(const int64_t *res, int64_t index)
{
    return res[0] == index && res[3] <= index && index < res[4];
}

/* pc_coll_wait1, and whether the result is shaped as the one res held before (the
 * caller's last take into the same words): its round is index, this request's post is
 * inside it, and its rounds, nap, posts and active and closing bits are the same (P <= 64).
 * Returns -1 for that (the caller may then make its Result from that one's fields without
 * reading res), PC_OK otherwise, or the error. */
int pc_coll_wait1_same(pc_coll *c, int64_t index, double timeout_s, void *out, int64_t *res)
{
    int64_t before[5], after[5];
    res_shape(res, before);
    int rc = pc_coll_wait1(c, index, timeout_s, out, res);
    if (rc != PC_OK || W_of(c) != 1) return rc;
    res_shape(res, after);
    return res_own_round(res, index) && memcmp(before, after, sizeof after) == 0 ? -1 : PC_OK;
}

/* An early take's result is shaped as the last one's (its own round, this rank's post
 * inside it, the same rounds, counts and active and closing bits; P <= 64): the caller
 * then makes its Result from the last one's fields without reading res. */
static int coll_same_shape(pc_coll *c, int64_t index, const int64_t *res)
{
    int64_t shape[5];
    res_shape(res, shape);
    int same = c->shaped && W_of(c) == 1 && res_own_round(res, index) && memcmp(shape, c->shape, sizeof shape) == 0;
    memcpy(c->shape, shape, sizeof shape);
    c->shaped = W_of(c) == 1;
    return same;
}

/* post(x, out=y).wait() in one engine call where the round allows it (the early take):
 * post; then, if this request is alone (every earlier one taken and returned) and names
 * an out, give its round one progress step here (the peers' messages may be in: the last
 * rank to post completes the round at once) and, if the round has completed, take the
 * result as pc_coll_wait1 would: into out and res, claimed as this request's take. Its
 * wait has not returned yet, so it still holds out: it is counted in takes only once the
 * caller says so (returned, at its next post; or pc_coll_returned), and until then no post
 * is alone (none writes a user buffer). A request never returned by close() gives its
 * result back (pc_coll_give_back): close() folds it in, nothing posted is dropped. */
static int64_t coll_post_take(pc_coll *c, const void *x, void *out, int64_t *res, int returned)
{
    int64_t index = 0;
    int late = 0, alone = 0, taken = 0, same = 0;
    unit_lock(&c->owner.unit);
    c->takes += returned != 0;           /* the last post's early take: its wait returned */
    int rc = coll_post_locked(c, x, out, &index, &late, &alone);
    if (rc == PC_OK && alone && out) {
        pc_sched *s = c->armed;
        if (LOAD(c->completed) <= index && s && s->running && !s->draining && c->armed_round == index && c->taken)
            sched_progress(s);
        if (LOAD(c->completed) > index && !c->err && coll_claim(c, index) == PC_OK) {
            pc_result info;
            coll_take_result_locked(c, index, out, (uint64_t *)(res + 7), &info);
            c->takes--;                  /* counted once its wait has returned */
            res_of(res, &info);
            taken = 1;
            same = coll_same_shape(c, index, res);
        }
    }
    unit_unlock(&c->owner.unit);
    return rc ? -(int64_t)rc : (index << 3) | (same << 2) | (taken << 1) | late;
}

static int coll_returned(pc_coll *c)
{
    unit_lock(&c->owner.unit);
    c->takes++;
    unit_unlock(&c->owner.unit);
    return PC_OK;
}

/* close() began: an early-taken result whose wait never returned goes back into the
 * pending result (res: its words as pc_coll_wait1 writes them; data: its data), so the
 * final result folds it in. */
static int coll_give_back(pc_coll *c, const void *data, const int64_t *res)
{
    unit_lock(&c->owner.unit);
    int rc = PC_OK;
    size_t mw = (size_t)pc_coll_mask_words(c->size);
    if (!c->closing) rc = fail(PC_ERR_STATE, "a result goes back only once close() began");
    else if (res[1] > 0) {
        result_internal(c);
        if (c->pending == 0) {           /* the result buffer holds nothing pending: it is this */
            memcpy(c->result, data, c->nbytes);
            c->res_nap = c->res_posts = 0;
            c->res_lo = res[3];
            c->res_hi = res[4];
            c->res_round = res[0];
            memset(c->res_mask, 0, sizeof(uint64_t) * mw);
        } else {
            rc = pc_reduce_local(c->spec.redop, c->spec.dtype, c->result, data, c->result, c->spec.count);
        }
        if (rc == PC_OK) {
            c->pending += res[1];
            c->res_nap += res[2];
            c->res_posts += res[6];
            if (res[0] > c->res_round) c->res_round = res[0];
            mask_fold(c, (const uint64_t *)(res + 7));
        }
    }
    unit_unlock(&c->owner.unit);
    return rc;
}

/* Start closing: from now on this rank triggers every round it is armed for, and a
 * round in which every rank is closing is the final one. */
static int coll_close(pc_coll *c)
{
    unit_lock(&c->owner.unit);
    int rc = PC_OK;
    if (!c->closing) {
        c->closing = 1;
        result_internal(c);
        if (!c->fold && c->pending == 0)      /* from now on fold: close never drops a round */
            fill_identity(c, c->result);
        double now = 0;
        rc = coll_maybe_trigger(c, &now);
    }
    unit_unlock(&c->owner.unit);
    return rc;
}

static int coll_idle(void *c) { return LOAD(((pc_coll *)c)->owner.unit.nrunning) == 0; }

int pc_coll_free(pc_coll *c)
{
    if (!c) return PC_OK;
    unit_pin(&c->owner.unit);
    /* The final round has delivered here, but its last sends may still be in flight (a
     * slow link; with inline progress nothing moves them between engine calls): the
     * peers are in the same round and receive them, so let them finish. */
    if (LOAD(c->finished) && !coll_idle(c)) wait_until(coll_idle, c, 30.0);
    unit_lock(&c->owner.unit);
    int rc = !coll_idle(c) && !c->owner.unit.leaked
             ? fail(PC_ERR_STATE, "cannot free a partial collective with a round in flight") : PC_OK;
    if (rc == PC_OK) {
        coll_deaf(c);
        unit_doom(&c->owner.unit);
    }
    unit_unlock(&c->owner.unit);
    unit_unpin(&c->owner.unit);          /* the last one out frees it */
    return rc;
}

/* Dropped without close() (garbage-collected, or a with-block left by an exception on
 * this rank; possibly on a garbage collector's thread, so no MPI call here): no new
 * round is armed; the next progress pass withdraws a round that has not read this
 * rank's input yet (its receives cancelled); a round already moving data finishes, so
 * peers are not left with half a message. The collective is freed once none of its
 * schedules runs and no pass holds it: the engine never points at freed memory. Peers
 * still using the collective hear of it where Python reported it first (pc_coll_abort
 * with a negative timeout: the pass sends it), else they time out. */
int pc_coll_abandon(pc_coll *c, int *deferred)
{
    *deferred = 0;
    if (!c) return PC_OK;
    unit_pin(&c->owner.unit);
    unit_lock(&c->owner.unit);
    if (!c->abandoned) {
        STORE(c->abandoned, 1);
        c->owner.unit.withdraw = 1;
        *deferred = !coll_idle(c);
        if (!c->err) {                   /* a thread inside wait() or test() wakes, and raises */
            c->errpeer = -1;
            snprintf(c->errmsg, sizeof c->errmsg, "this partial collective was dropped on this rank (rank %d) "
                     "while a request of it was outstanding", c->rank);
            STORE(c->err, PC_ERR_STATE);
            notify_done();
        }
        unit_doom(&c->owner.unit);
        coll_books_stop(c);
        coll_listen(c);                  /* parked: off E.polled, but for a report still to send */
    }
    unit_unlock(&c->owner.unit);
    unit_unpin(&c->owner.unit);          /* the last one out frees it: here, a pass, or a waiter */
    if (*deferred) kick();
    return PC_OK;
}

/* Record this rank's report (unit lock held): the collective stops here; 1 if it is to
 * be sent (not after a peer's report, the final round, or a report already made). */
static int coll_report(pc_coll *c, const char *type, const char *message)
{
    if (c->err == PC_ERR_PEER || LOAD(c->finished) || c->size < 2) return 0;
    if (!report_make(&c->rep, c->rank, type, message)) return 0;
    if (!c->err) {
        c->errpeer = -1;
        snprintf(c->errmsg, sizeof c->errmsg, "this rank (%d) reported %s to its peers, the collective "
                 "cannot be used any more: %s", c->rank, c->rep.mine.type, c->rep.mine.message);
        STORE(c->err, PC_ERR_STATE);
    }
    notify_done();
    coll_books_stop(c);
    return 1;
}

/* Send the recorded report to every peer (unit lock held; MPI calls). */
static void coll_send_report(pc_coll *c)
{
    report_send(&c->rep, LOAD(c->completed), c->abandoned);   /* the armed round is withdrawn below */
    if (c->armed && c->armed->running) sched_withdraw(c->armed);
}

static int coll_abort(pc_coll *c, const char *type, const char *message, double timeout_s)
{
    if (!c) return PC_OK;
    unit_lock(&c->owner.unit);
    if (coll_report(c, type, message)) {
        if (timeout_s < 0) {             /* no MPI call here: the next progress pass sends it */
            report_defer(&c->rep);
            coll_listen(c);              /* sent by a pass even where no schedule runs */
            unit_unlock(&c->owner.unit);
            kick_report();
            return PC_OK;
        }
        coll_send_report(c);
    }
    unit_unlock(&c->owner.unit);
    report_flush(&c->owner.unit, &c->rep, timeout_s);
    return PC_OK;
}

static int coll_peer_error(pc_coll *c, int *rank, char *type, int tlen, char *message, int mlen)
{
    return report_peer_error(&c->owner.unit, &c->rep, &c->err, rank, type, tlen, message, mlen);
}

/* traffic: the bytes of the sends each schedule posted to peer i since creation */
int pc_traffic(pc_coll *c, pc_sched *s, int64_t *sent, int n)
{
    if (!sent || n < 0 || (!c && !s)) return fail(PC_ERR_ARG, "pc_traffic: no collective or schedule");
    pc_unit *u = c ? &c->owner.unit : s->unit;
    unit_lock(u);
    if (s) sched_add_traffic(s, sent, n);
    for (int i = 0; c && i < n && i < c->size; i++) sent[i] += c->retired_sent[i];
    for (int i = 0; c && i < c->nretired; i++) sched_add_traffic(c->retired[i], sent, n);
    for (int k = 0; c && k < 2 * c->variants; k++) sched_add_traffic(c->sched[k / c->variants][k % c->variants], sent, n);
    unit_unlock(u);
    return PC_OK;
}

/* ------------------------------------------------------------------ owners: the API */
typedef struct { pc_coll *c; int64_t epoch; } coll_epoch_arg;

static int coll_epoch_out(void *p)
{
    coll_epoch_arg *a = p;
    return LOAD(a->c->epochs) > a->epoch || LOAD(a->c->finished) || LOAD(a->c->err) || LOAD(a->c->abandoned)
           || LOAD(a->c->stats_stopped);
}

static int coll_stats(pc_coll *c, int64_t epoch, double timeout_s, int64_t *sums, int *got)
{
    *got = 0;
    if (epoch >= 0) {
        coll_epoch_arg a = {c, epoch};
        int rc = coll_epoch_out(&a) ? PC_OK : wait_passive(coll_epoch_out, &a, timeout_s);
        if (rc) {                      /* the balancer's slice ended: free what was retired meanwhile */
            unit_lock(&c->owner.unit);
            coll_reap_retired(c);
            unit_unlock(&c->owner.unit);
            return rc;
        }
    }
    size_t tb = sizeof(int64_t) * PC_TIME_FIELDS * (size_t)c->size;
    unit_lock(&c->owner.unit);
    /* and at every epoch: the balancer wakes once an epoch, not on a timer (a thread that
     * woke every 50 ms cost the progress threads 1.5 - 2.5 ms of CPU a round where ranks
     * share cores, decisions or not: docs/results.md) */
    if (epoch >= 0) coll_reap_retired(c);
    int rc = c->err ? coll_error(c) : PC_OK;
    int64_t e = c->epochs;
    if (rc == PC_OK && epoch >= 0 && e > epoch) {
        if (epoch < e - PC_SNAPS) rc = fail(PC_ERR_STATE, "epoch %lld's times are gone (%lld out)", (long long)epoch,
                                            (long long)e);
        else { memcpy(sums, c->snap[epoch % PC_SNAPS], tb); *got = 1; }
    } else if (rc == PC_OK && epoch < 0) {
        memcpy(sums, e > 0 ? c->snap[(e - 1) % PC_SNAPS] : c->agreed, tb);
        *got = 1;
    }
    unit_unlock(&c->owner.unit);
    return rc;
}

static int coll_stop_stats(pc_coll *c)
{
    STORE(c->stats_stopped, 1);
    notify_books();                    /* its wait_passive re-reads the predicate */
    return PC_OK;
}

static int coll_switched(pc_coll *c, int64_t k, int64_t *round)
{
    if (k < 0) return fail(PC_ERR_ARG, "pc_coll_switched: switch %lld", (long long)k);
    unit_lock(&c->owner.unit);
    *round = k < c->nswitched ? c->switched[k] : -1;
    unit_unlock(&c->owner.unit);
    return PC_OK;
}

static int coll_switch_to(pc_coll *c, int64_t epoch, pc_sched *s0, pc_sched *s1)
{
    pc_sched *s[2] = {s0, s1};
    for (int k = 0; k < 2; k++)
        if (s[k] && s[k]->owner != &c->owner) return fail(PC_ERR_ARG, "pc_coll_switch: a schedule of another collective");
    unit_lock(&c->owner.unit);
    int rc = PC_OK;
    if (LOAD(c->finished) || c->err || c->abandoned)
        rc = PC_OK;                    /* no round will run again: nothing to switch */
    else if (epoch != c->decided || epoch >= LOAD(c->epochs) || c->spec.rebalance_every <= 0
             || c->npend == PC_SNAPS + 2)
        rc = fail(PC_ERR_STATE, "decision %lld out of order (%lld made, %lld epochs out, %d pending)",
                  (long long)epoch, (long long)c->decided, (long long)LOAD(c->epochs), c->npend);
    if (rc == PC_OK && !(LOAD(c->finished) || c->err || c->abandoned)) {
        c->decided = epoch + 1;
        if (s0 || s1) c->pend[c->npend++] = (coll_switch){epoch, {s0, s1}};
        if (c->parked >= 0 && !c->err && !c->abandoned && !LOAD(c->finished)) {
            int64_t n = c->parked;
            c->parked = -1;
            rc = coll_arm(c, n, 0);
            coll_listen(c);
            if (rc && !c->err) {
                c->errpeer = pc_last_error_peer();
                snprintf(c->errmsg, sizeof c->errmsg, "%s", pc_last_error());
                STORE(c->err, rc);
            }
            kick();
        }
    } else {                           /* owned from here on: freed with the collective */
        coll_retire(c, s0);
        coll_retire(c, s1);
    }
    coll_reap_retired(c);
    unit_unlock(&c->owner.unit);
    return rc;
}

/* [shrink] What this rank holds of a collective that a failure stopped, whatever its
 * error (partialcoll/_shrink.py reads it before it drops the collective): st[0] rounds
 * completed here, st[1] posts, st[2] posts whose data is inside the completed rounds (the
 * rest: taken by the round in flight, or still in acc), st[3] rounds in the pending result
 * (fold: not taken yet; latest: 1 once a round completed), st[4] posts taken by rounds (the
 * round in flight's too). Where a round completed, the
 * pending result is copied to out, mask and info as a take would, changing nothing. */
static int coll_salvage(pc_coll *c, int64_t *st, void *out, uint64_t *mask, pc_result *info)
{
    if (unit_lock_within(&c->owner.unit, 1.0))
        return fail(PC_ERR_MPI, "rank %d: the collective is held inside an MPI call (%s)", c->rank, pc_last_error());
    int64_t done = LOAD(c->completed);
    int in_flight = c->taken && c->armed_round >= done;
    st[0] = done;
    st[1] = c->posts;
    st[2] = in_flight ? c->round_lo : c->taken_posts;
    st[3] = c->fold ? c->pending : (done > 0);
    st[4] = c->taken_posts;
    memset(info, 0, sizeof *info);
    if (done > 0) {
        void *src = result_in_user(c) ? c->user : c->result;
        if (out != src) memcpy(out, src, c->nbytes);
        info->round = c->res_round;
        info->rounds = st[3];
        info->nap = c->res_nap;
        info->posts = c->res_posts;
        info->post_lo = c->res_lo;
        info->post_hi = c->res_hi;
        memcpy(mask, c->res_mask, sizeof(uint64_t) * (size_t)pc_coll_mask_words(c->size));
    }
    unit_unlock(&c->owner.unit);
    return PC_OK;
}

/* ------------------------------------------------------------------ the API: every entry pins
 * Each call holds a pin on the collective while it runs (pc_internal.h, "pins"): a
 * thread that abandons or frees it meanwhile only marks it, and the last one out frees. */
#define PINNED_T(type, api, inner, params, args) \
    type api params                           \
    {                                         \
        unit_pin(&c->owner.unit);             \
        type rc = inner args;                 \
        unit_unpin(&c->owner.unit);           \
        return rc;                            \
    }
#define PINNED(api, inner, params, args) PINNED_T(int, api, inner, params, args)

PINNED(pc_coll_acc_full, coll_acc_full, (pc_coll *c, int *full), (c, full))
PINNED(pc_coll_user_buffers, coll_user_buffers, (pc_coll *c, void *bufs[3]), (c, bufs))
PINNED(pc_coll_post_replace, coll_post_replace, (pc_coll *c, const void *x, int64_t *index, int *late, int *replaced), (c, x, index, late, replaced))
PINNED(pc_coll_test, coll_test, (pc_coll *c, int64_t index, int *done), (c, index, done))
PINNED(pc_coll_silent, coll_silent, (pc_coll *c, int *ranks, int max, int64_t *round, int *n), (c, ranks, max, round, n))
PINNED(pc_coll_wait_take, coll_wait_take, (pc_coll *c, int64_t index, double timeout_s, void *out, uint64_t *mask, pc_result *info), (c, index, timeout_s, out, mask, info))
PINNED_T(int64_t, pc_coll_post_take, coll_post_take, (pc_coll *c, const void *x, void *out, int64_t *res, int returned), (c, x, out, res, returned))
PINNED(pc_coll_returned, coll_returned, (pc_coll *c), (c))
PINNED(pc_coll_give_back, coll_give_back, (pc_coll *c, const void *data, const int64_t *res), (c, data, res))
PINNED(pc_coll_post, coll_post, (pc_coll *c, const void *x, void *out, int64_t *index, int *late), (c, x, out, index, late))
PINNED(pc_coll_close, coll_close, (pc_coll *c), (c))
PINNED(pc_coll_abort, coll_abort, (pc_coll *c, const char *type, const char *message, double timeout_s), (c, type, message, timeout_s))
PINNED(pc_coll_peer_error, coll_peer_error, (pc_coll *c, int *rank, char *type, int tlen, char *message, int mlen), (c, rank, type, tlen, message, mlen))
PINNED(pc_coll_stats, coll_stats, (pc_coll *c, int64_t epoch, double timeout_s, int64_t *sums, int *got), (c, epoch, timeout_s, sums, got))
PINNED(pc_coll_stop_stats, coll_stop_stats, (pc_coll *c), (c))
PINNED(pc_coll_switched, coll_switched, (pc_coll *c, int64_t k, int64_t *round), (c, k, round))
PINNED(pc_coll_salvage, coll_salvage, (pc_coll *c, int64_t *st, void *out, uint64_t *mask, pc_result *info), (c, st, out, mask, info))
PINNED(pc_coll_switch, coll_switch_to, (pc_coll *c, int64_t epoch, pc_sched *s0, pc_sched *s1), (c, epoch, s0, s1))

int pc_coll_hold(pc_coll *c)
{
    unit_pin(&c->owner.unit);
    return PC_OK;
}

int pc_coll_release(pc_coll *c)
{
    unit_unpin(&c->owner.unit);        /* may free c */
    return PC_OK;
}
