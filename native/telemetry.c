/* telemetry.c -- who is slow: what a partial collective's rounds tell about each rank
 * (docs/who-is-slow.md). Recorded in the rounds themselves, with no message of its own:
 *
 *   post #n    (tele_post)   this rank's post n, on its own clock
 *   TAKE n     (tele_take)   round n reads this rank's input: its view of the round's start
 *   round n    (tele_round)  round n completed here; its mask (agreed by BOR in every
 *                            mode) says which ranks' data is inside
 *
 * From these, on this rank's clock only (CLOCK_MONOTONIC, clock.c; no time is ever
 * compared with another rank's):
 *   lateness(n) = post_us - take_us if post #n came after round n's TAKE, else 0
 *   wait(n)     = done_us - post_us for a full round whose post came before it completed
 * and from the masks, the same on every rank: the rounds each rank's data missed.
 * Memory is bounded: running totals, plus a ring of the last `cap` rounds (round n in
 * ring[n % cap]); an event for a round the ring no longer holds is counted in the totals
 * only. partialcoll/_stats.py gathers the rings on demand and attributes the full
 * rounds' waiting to the last arrivals.
 *
 * A timed collective (balance=, partialcoll/balance.py) also carries this rank's arrivals
 * in its row of the owners' times, which every round already gathers: at each TAKE, the
 * sum (ns) of + its waits in the full rounds and - the lateness of its late posts since its
 * last TAKE. Every rank then holds every rank's sums, and psld compares them: a rank that
 * waits less than the others, or posts later, is late to the rounds.
 *
 * Calls clock.c and progress.c (the unit lock; it reads E.last_event_us) only; coll.c calls it. Every function but
 * pc_coll_telemetry* runs under the collective's unit lock (post: the application thread;
 * TAKE and the round's end: whichever thread steps the unit). */
#include "pc_internal.h"
#include <stdlib.h>
#include <string.h>

static pc_tele_rec *tele_slot(pc_tele *t, int64_t n)
{
    pc_tele_rec *r = &t->ring[n % t->cap];
    if (r->round > n) return NULL;                 /* the ring holds a later round there */
    if (r->round < n) {
        memset(r, 0, sizeof *r);
        r->round = n;
    }
    return r;
}

/* Post #n is counted before it may start its round, and timed after (tele_post_time): its
 * clock is read once the round it started has sent its first messages (a read costs
 * 0.1 - 0.3 us in a VM, on an 8 B round's critical path before them). Until then its
 * time is pending (post_us < 0), and a TAKE the post itself makes takes that time. */
void tele_post(pc_tele *t, int64_t n)
{
    if (!t->cap) return;
    t->posts++;
    pc_tele_rec *r = tele_slot(t, n);
    if (!r) { t->lost++; return; }
    r->post_us = -1;
}

void tele_post_time(pc_tele *t, int64_t n, double now)
{
    if (!t->cap) return;
    pc_tele_rec *r = tele_slot(t, n);
    if (!r || r->post_us >= 0) return;             /* lost (tele_post counted it) */
    r->post_us = now;
    if (r->take_us < 0) {                          /* its own round's TAKE: not late */
        r->take_us = now;
    } else if (r->take_us > 0 && now > r->take_us) {   /* round n read this rank's input already */
        r->late_us = now - r->take_us;
        t->late++;
        t->late_us += r->late_us;
        t->arrival_ns -= (int64_t)(r->late_us * 1e3);
    }
}

void tele_take(pc_tele *t, int64_t n, int64_t *times)
{
    if (!t->cap) return;
    if (times) {                                   /* this rank's word of its row's arrivals */
        times[(size_t)PC_TIME_ARRIVAL * (size_t)t->size + (size_t)t->rank] += t->arrival_ns;
        t->arrival_ns = 0;
    }
    pc_tele_rec *r = tele_slot(t, n);
    /* Only a post still to come is measured against the TAKE: when it came first, its
     * lateness is 0 whatever the TAKE's time, so no clock is read (it costs ~0.3 us here);
     * the post that makes this TAKE has its time still pending (tele_post) */
    if (r) r->take_us = r->post_us > 0 ? r->post_us : r->post_us < 0 ? -1 : now_us();
}

void tele_round(pc_tele *t, int64_t n, const uint64_t *mask, int W, int full)
{
    if (!t->cap) return;
    for (int w = 0; w < W; w++) if (mask[W + w]) return;   /* a closing round: not a step */
    t->rounds++;
    t->full += full;
    for (int r = 0; r < t->size; r++) t->missed[r] += !((mask[r / 64] >> (r % 64)) & 1);
    pc_tele_rec *r = tele_slot(t, n);
    if (!r) { t->lost++; return; }
    /* Only a full round's wait needs the time of its end (a partial round's is not read),
     * and no clock is read for it: a round completes on a message, and the pass that saw
     * the message complete noted the time just before (note_event(), E.last_event_us, us).
     * A round without messages (P = 1) finds an older time there: no wait is recorded. */
    double now = full && r->post_us > 0 ? (double)LOAD(E.last_event_us) : 0;
    r->done_us = now;
    r->flags = 1 | (full ? 2 : 0) | ((mask[t->rank / 64] >> (t->rank % 64)) & 1 ? 4 : 0);
    if (full && r->post_us > 0 && r->post_us <= now) {
        r->wait_us = now - r->post_us;
        t->wait_us += r->wait_us;
        t->arrival_ns += (int64_t)(r->wait_us * 1e3);
    }
}

int tele_init(pc_tele *t, int rank, int size)
{
    memset(t, 0, sizeof *t);
    t->rank = rank;
    t->size = size;
    t->missed = calloc((size_t)(size > 0 ? size : 1), sizeof(int64_t));
    return t->missed ? PC_OK : fail(PC_ERR_NOMEM, "out of memory for the telemetry");
}

void tele_free(pc_tele *t)
{
    free(t->ring);
    free(t->missed);
    t->ring = NULL;
    t->missed = NULL;
    t->cap = 0;
}

/* ------------------------------------------------------------------ the API */
int pc_coll_telemetry_on(pc_coll *c, int cap)
{
    if (cap < 0) return fail(PC_ERR_ARG, "the telemetry ring needs cap >= 0 rounds, not %d", cap);
    pc_tele_rec *ring = cap ? calloc((size_t)cap, sizeof *ring) : NULL;
    if (cap && !ring) return fail(PC_ERR_NOMEM, "out of memory for %d rounds of telemetry", cap);
    for (int i = 0; i < cap; i++) ring[i].round = -1;
    unit_pin(&c->owner.unit);
    unit_lock(&c->owner.unit);
    pc_tele_rec *old = c->tele.ring;
    c->tele.ring = ring;
    c->tele.cap = cap;
    unit_unlock(&c->owner.unit);
    unit_unpin(&c->owner.unit);
    free(old);
    return PC_OK;
}

/* totals: rounds, full rounds, posts, late posts, lateness (us, summed), wait (us, summed),
 * events lost (their round left the ring), cap; missed: P; ring: *n records of
 * PC_TELE_FIELDS doubles (round, post_us, take_us, done_us, late_us, wait_us, flags: 1 the
 * round completed here, 2 a full round, 4 this rank's data inside), oldest first: the
 * newest max rounds */
int pc_coll_telemetry(pc_coll *c, double *totals, int64_t *missed, double *ring, int max, int *n)
{
    unit_pin(&c->owner.unit);
    unit_lock(&c->owner.unit);
    pc_tele *t = &c->tele;
    totals[0] = (double)t->rounds; totals[1] = (double)t->full; totals[2] = (double)t->posts;
    totals[3] = (double)t->late; totals[4] = t->late_us; totals[5] = t->wait_us;
    totals[6] = (double)t->lost; totals[7] = (double)t->cap;
    memcpy(missed, t->missed, sizeof(int64_t) * (size_t)t->size);
    int k = 0;
    int64_t hi = -1;
    for (int i = 0; i < t->cap; i++) if (t->ring[i].round > hi) hi = t->ring[i].round;
    int64_t from = hi - (t->cap < max ? t->cap : max) + 1;      /* the newest max rounds */
    for (int64_t m = from; t->cap && m <= hi && k < max; m++) {
        if (m < 0) continue;
        const pc_tele_rec *r = &t->ring[m % t->cap];
        if (r->round != m) continue;
        double *o = ring + (size_t)k++ * PC_TELE_FIELDS;
        o[0] = (double)r->round; o[1] = r->post_us; o[2] = r->take_us; o[3] = r->done_us;
        o[4] = r->late_us; o[5] = r->wait_us; o[6] = r->flags;
    }
    *n = k;
    unit_unlock(&c->owner.unit);
    unit_unpin(&c->owner.unit);
    return PC_OK;
}
