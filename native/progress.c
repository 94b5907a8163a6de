/* progress.c -- the engine: its state E, the units' bookkeeping, progress passes, the
 * progress thread, and the waits of application threads.
 *
 * A progress pass (engine_pass) takes E.lock only to copy the running list (pinning
 * each unit so that it cannot be freed under the pass), then visits each schedule under
 * its unit's lock, taken with trylock: a unit that another thread holds (a post copying
 * 100 MiB, a waiter taking its result) is skipped and visited by the next pass, so no
 * pass ever waits for a lock. Waits hold no lock: their predicates read atomics, and
 * they sleep on E.done, which every completion signals. */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <mpi.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static pc_stepper stepper;        /* (written once, before any schedule runs) */

void engine_set_stepper(const pc_stepper *st) { if (stepper.step != st->step) stepper = *st; }

/* E.lock and E.wmtx guard a few words each and are taken by the application's posts and
 * waits while the progress thread polls: they spin briefly before sleeping (glibc's
 * adaptive mutex), where a plain mutex sent a thread that found one held into a futex
 * sleep and wake-up of several us, for a critical section of well under one. */
#ifdef PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP
#define SHORT_MUTEX PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP
#else
#define SHORT_MUTEX PTHREAD_MUTEX_INITIALIZER
#endif
pc_engine_state E = {.lock = SHORT_MUTEX, .wmtx = SHORT_MUTEX,
                     .dmtx = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER,
                     .done = PTHREAD_COND_INITIALIZER};


/* The time of the last event (a message completed, a post, a round armed), in us:
 * the idle policy counts from it. Returns the period since the previous event (0: none). */
static double note_at(double at)
{
    int64_t now = (int64_t)at, last = __atomic_exchange_n(&E.last_event_us, now, __ATOMIC_RELAXED);
    double gap = last > 0 && now > last ? (double)(now - last) : 0;
    if (gap > 0) idle_note_gap(gap);
    return gap;
}

/* A local post: the period between this process's posts, averaged (a loop's iteration),
 * from the clock at every 8th post (a clock read per post was 2 - 3 % of an 8 B round
 * at P = 2). The deep sleep waits for several periods (deep_after_us()): a rank that
 * computes between its posts is not idle, its peers' rounds cross it every iteration.
 * Two threads posting at once may lose one sample of the average. */
void note_post(void)
{
    if ((__atomic_add_fetch(&E.nposts, 1, __ATOMIC_RELAXED) & 7) != 0) return;
    int64_t now = (int64_t)now_us(), last = __atomic_exchange_n(&E.last_post_us, now, __ATOMIC_RELAXED);
    if (last <= 0 || now <= last) return;
    int64_t avg = LOAD(E.post_period_us), gap = (now - last) / 8;
    STORE(E.post_period_us, avg > 0 ? avg + (gap - avg) / 8 : gap);
}

double note_event(void) { return note_at(now_us()); }

/* ------------------------------------------------------------------ units */
void unit_init(pc_unit *u, void (*destroy)(pc_unit *), void (*abandon)(pc_unit *))
{
    memset(u, 0, sizeof *u);
    pthread_mutex_init(&u->lock, NULL);
    u->destroy = destroy;
    u->abandon = abandon;
}

/* Application threads take a unit's lock through these: while one waits for it, passes
 * skip the unit (they never wait themselves), so a post never queues behind polling. */
void unit_lock(pc_unit *u)
{
    __atomic_add_fetch(&u->waiters, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&u->lock);
    __atomic_sub_fetch(&u->waiters, 1, __ATOMIC_SEQ_CST);
}

void unit_unlock(pc_unit *u) { pthread_mutex_unlock(&u->lock); }

/* unit_lock, giving up after `seconds` (< 0: never): PC_OK with the lock held, or
 * PC_ERR_TIMEOUT. A unit's lock is held for one step at a time, unless a thread is stuck
 * inside an MPI call (a peer died under some transports): a wait then still returns. */
int unit_lock_within(pc_unit *u, double seconds)
{
    if (seconds < 0) { unit_lock(u); return PC_OK; }
    if (pthread_mutex_trylock(&u->lock) == 0) return PC_OK;    /* free: no deadline to read */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = ts.tv_nsec + (long long)(seconds * 1e9);
    ts.tv_sec += ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    __atomic_add_fetch(&u->waiters, 1, __ATOMIC_SEQ_CST);
    int rc = pthread_mutex_timedlock(&u->lock, &ts);
    __atomic_sub_fetch(&u->waiters, 1, __ATOMIC_SEQ_CST);
    if (rc == 0) return PC_OK;
    return fail(PC_ERR_TIMEOUT, "the engine has been inside an MPI call on this collective for more than "
                "%.2f s (a peer may have died)", seconds);
}

/* PARTIALCOLL_DOOM_PAUSE_US (tests): the thread that dooms a unit keeps holding its lock
 * this long after, as a thread that is descheduled there does: the window in which
 * another thread's reap_units() finds the unit doomed while its lock is still held. */
static long long doom_pause_us(void)
{
    static long long us = -1;
    long long v = __atomic_load_n(&us, __ATOMIC_RELAXED);
    if (v >= 0) return v;
    const char *forced = getenv("PARTIALCOLL_DOOM_PAUSE_US");
    v = forced && atoll(forced) > 0 ? atoll(forced) : 0;
    __atomic_store_n(&us, v, __ATOMIC_RELAXED);
    return v;
}

/* Mark u to be freed once nothing runs it, no pass holds it and no thread holds its
 * lock (reap_units); a caller holding its lock reaps after letting go. */
void unit_doom(pc_unit *u)
{
    pthread_mutex_lock(&E.lock);
    if (!u->doomed) {
        STORE(u->doomed, 1);
        u->next_doomed = E.doomed;
        STORE(E.doomed, u);          /* unit_unpin looks without E.lock */
    }
    pthread_mutex_unlock(&E.lock);
    long long pause = doom_pause_us();
    if (pause > 0) {
        struct timespec ts = {(time_t)(pause / 1000000), (long)(pause % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
}

/* Take u off E.polled (E.lock held). */
static void polled_unlink(pc_unit *u)
{
    if (!u->listening) return;
    for (pc_unit **link = &E.polled; *link; link = &(*link)->next_polled)
        if (*link == u) { *link = u->next_polled; break; }
    u->next_polled = NULL;
    STORE(u->listening, 0);
    STORE(E.npolled, E.npolled - 1);
}

/* A unit with messages outside its schedules (a parked collective listens for its peers'
 * reports; a report deferred waits for a pass to send it) is polled by every pass while
 * on: passes visit only running schedules otherwise. due: it must not be freed before a
 * pass sent that message (reap_units). Unit lock held. */
void unit_listen(pc_unit *u, int on, int due)
{
    STORE(u->due, due);
    if (on == LOAD(u->listening)) return;
    pthread_mutex_lock(&E.lock);
    if (on && !u->listening) {
        u->next_polled = E.polled;
        E.polled = u;
        STORE(u->listening, 1);
        STORE(E.npolled, E.npolled + 1);
    } else if (!on) {
        polled_unlink(u);
    }
    pthread_mutex_unlock(&E.lock);
    if (on) kick();
}

/* Free the doomed units that nothing runs, no pass holds and no thread holds the lock
 * of: the thread that doomed a unit holds its lock until it lets go (unit_doom), and a
 * unit freed before that let go was written after its free (pthread_mutex_unlock writes
 * the mutex: glibc's heap broke at the next free). That thread reaps it after letting
 * go; a pass that ends meanwhile leaves it. Nothing takes a doomed unit's lock anew
 * (nothing runs and no pass holds it), so a lock found free stays free. No lock held. */
void reap_units(void)
{
    pc_unit *dead = NULL;
    pthread_mutex_lock(&E.lock);
    for (pc_unit **link = &E.doomed; *link;) {
        pc_unit *u = *link;
        if (u->passes == 0 && LOAD(u->pins) == 0 && u->nrunning == 0 && (!LOAD(u->due) || LOAD(E.stop))
            && pthread_mutex_trylock(&u->lock) == 0) {
            pthread_mutex_unlock(&u->lock);
            polled_unlink(u);
            __atomic_store_n(link, u->next_doomed, __ATOMIC_RELEASE);   /* may be E.doomed */
            u->next_doomed = dead;
            dead = u;
        } else {
            link = &u->next_doomed;
        }
    }
    pthread_mutex_unlock(&E.lock);
    while (dead) { pc_unit *u = dead; dead = u->next_doomed; u->destroy(u); }
}

/* The last pin of a doomed unit frees it (pc_internal.h, "pins"): the doomer could not,
 * as this thread was inside. */
void unit_unpin(pc_unit *u)
{
    /* once its pins reach 0 another thread's reap may free u at once: after the
     * decrement this thread reads E only, never u (ThreadSanitizer saw the read of
     * u->doomed here race with the progress thread's free of u) */
    if (__atomic_sub_fetch(&u->pins, 1, __ATOMIC_ACQ_REL) == 0 && LOAD(E.doomed)) reap_units();
}

/* ------------------------------------------------------------------ running list */
void running_add(pc_sched *s)
{
    pthread_mutex_lock(&E.lock);
    s->prev = NULL;
    s->next = E.running;
    if (E.running) E.running->prev = s;
    E.running = s;
    s->on_list = 1;
    STORE(E.nrunning, E.nrunning + 1);
    STORE(s->unit->nrunning, s->unit->nrunning + 1);
    pthread_mutex_unlock(&E.lock);
}

void running_remove(pc_sched *s)
{
    pthread_mutex_lock(&E.lock);
    if (s->on_list) {
        if (s->prev) s->prev->next = s->next; else E.running = s->next;
        if (s->next) s->next->prev = s->prev;
        s->next = s->prev = NULL;
        s->on_list = 0;
        STORE(E.nrunning, E.nrunning - 1);
        STORE(s->unit->nrunning, s->unit->nrunning - 1);
    }
    pthread_mutex_unlock(&E.lock);
}

/* s's flags (SF_*) become f (its unit lock held: the only writer of s->flags). The
 * schedules with each flag are counted (a schedule's flags are 0 unless it runs), so that
 * engine_flags() reads their OR without E.lock: a post's kick asks it twice a round. */
void engine_set_flags(pc_sched *s, int f)
{
    int old = s->flags;
    if (old == f) return;
    for (int b = 0; b < 3; b++)
        if ((old ^ f) & (1 << b)) __atomic_add_fetch(&E.nflag[b], f & (1 << b) ? 1 : -1, __ATOMIC_RELAXED);
    STORE(s->flags, f);
}

/* The OR of the running schedules' flags (SF_*): what the idle policy asks. */
static int engine_flags(void)
{
    int f = 0;
    for (int b = 0; b < 3; b++) if (LOAD(E.nflag[b]) > 0) f |= 1 << b;
    return f;
}

/* The most message steps (pc_sched.hops) of a running schedule that waits for its peers
 * (SF_POLLABLE), at least 1. */
static int engine_hops(void)
{
    int h = 1;
    pthread_mutex_lock(&E.lock);
    for (pc_sched *s = E.running; s; s = s->next)
        if ((LOAD(s->flags) & SF_POLLABLE) && s->hops > h) h = s->hops;
    pthread_mutex_unlock(&E.lock);
    return h;
}

/* ------------------------------------------------------------------ passes */
typedef struct { pc_sched **s; int cap; } snapshot;
static __thread snapshot snap;
static pthread_key_t snap_key;           /* frees a thread's snapshot when the thread ends */
static pthread_once_t snap_once = PTHREAD_ONCE_INIT;
static void snap_key_make(void) { pthread_key_create(&snap_key, free); }

/* Room for cap units in this thread's snapshot (E.lock held); 0, or -1 out of memory.
 * Application threads come and go (a framework's completion threads): the snapshot is
 * freed with its thread, never kept past it. */
static int snap_grow(int cap)
{
    pc_sched **p = realloc(snap.s, sizeof(pc_sched *) * (size_t)cap);
    if (!p) return -1;
    pthread_once(&snap_once, snap_key_make);
    pthread_setspecific(snap_key, p);
    snap.s = p;
    snap.cap = cap;
    return 0;
}

/* The unit's own messages, once a pass (unit lock held): withdraw what an abandon left
 * (not on the caller's thread), then its poll. */
static int unit_visit(pc_unit *u, uint64_t pass)
{
    int progressed = 0;
    if (u->withdraw) {
        u->withdraw = 0;
        u->abandon(u);
        progressed = 1;
    }
    if (u->poll && u->polled != pass) {     /* once a pass, however many schedules it runs */
        u->polled = pass;
        progressed |= u->poll(u);
    }
    return progressed;
}

/* One progress pass over every running schedule and every unit on E.polled (any thread,
 * no lock held); 1 if anything moved. */
int engine_pass(void)
{
    if (LOAD(E.nrunning) == 0 && LOAD(E.npolled) == 0) return 0;
    static uint64_t passes;
    uint64_t pass = __atomic_add_fetch(&passes, 1, __ATOMIC_RELAXED);
    int n = 0, m;
    pthread_mutex_lock(&E.lock);
    if (E.nrunning + E.npolled > snap.cap && snap_grow(2 * (E.nrunning + E.npolled) + 8)) {
        pthread_mutex_unlock(&E.lock);
        return 0;
    }
    for (pc_sched *s = E.running; s; s = s->next) { snap.s[n++] = s; s->unit->passes++; }
    m = n;                               /* then the listening units, stored as such */
    for (pc_unit *u = E.polled; u; u = u->next_polled) { snap.s[m++] = (pc_sched *)(void *)u; u->passes++; }
    pthread_mutex_unlock(&E.lock);
    int progressed = 0;
    for (int i = 0; i < n; i++) {
        pc_sched *s = snap.s[i];
        pc_unit *u = s->unit;
        if (LOAD(u->waiters) > 0 || pthread_mutex_trylock(&u->lock) != 0) continue;
        progressed |= unit_visit(u, pass);
        progressed |= stepper.step(s);
        pthread_mutex_unlock(&u->lock);
    }
    for (int i = n; i < m; i++) {
        pc_unit *u = (pc_unit *)(void *)snap.s[i];
        if (LOAD(u->waiters) > 0 || pthread_mutex_trylock(&u->lock) != 0) continue;
        progressed |= unit_visit(u, pass);
        pthread_mutex_unlock(&u->lock);
    }
    pthread_mutex_lock(&E.lock);
    for (int i = 0; i < n; i++) snap.s[i]->unit->passes--;
    for (int i = n; i < m; i++) ((pc_unit *)(void *)snap.s[i])->passes--;
    int reap = E.doomed != NULL;
    pthread_mutex_unlock(&E.lock);
    if (reap) reap_units();
    return progressed;
}

/* ------------------------------------------------------------------ kicks */
void kick(void)
{
    note_event();
    wake();
}

/* A report deferred (report_defer: made where no MPI call may be, as in a collective the
 * garbage collector dropped). The progress thread sends it at its next pass. Inline there
 * is none, and the application may never wait or test again (it blocks in MPI, computes,
 * or exits), while its peers wait for the report: a short-lived reporter thread runs
 * passes until no deferred report is left (at most a second), then ends. */
static void *reporter_main(void *arg)
{
    (void)arg;
    double until = now_us() + 1e6;
    for (;;) {
        while (LOAD(E.deferred) > 0 && !LOAD(E.stop) && now_us() < until) {
            if (!engine_pass()) {
                struct timespec ts = {0, 200000};
                nanosleep(&ts, NULL);
            }
        }
        STORE(E.reporter_on, 0);
        /* a report deferred as this thread decided to end saw it running: take it too */
        int off = 0;
        if (LOAD(E.deferred) == 0 || LOAD(E.stop) || now_us() >= until
            || !__atomic_compare_exchange_n(&E.reporter_on, &off, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return NULL;
    }
}

void kick_report(void)
{
    kick();
    int off = 0;
    if (E.threaded || LOAD(E.stop)
        || !__atomic_compare_exchange_n(&E.reporter_on, &off, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return;                          /* the progress thread, or a reporter, sends it */
    pthread_attr_t attr;
    pthread_t t;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, reporter_main, NULL) != 0)
        STORE(E.reporter_on, 0);         /* the next wait() or test() sends it */
    pthread_attr_destroy(&attr);
}

/* Wake the poller (the progress thread, or an inline waiter) without new work. */
void wake(void)
{
    pthread_mutex_lock(&E.wmtx);
    E.kicked = 1;
    pthread_cond_signal(&E.work);
    pthread_mutex_unlock(&E.wmtx);
}

/* An application thread left a wait() within the last spin_us: it runs a loop of
 * posts and waits, and its next wait() progresses inline. */
static int app_in_loop(double now)
{
    return now - (double)LOAD(E.app_left_us) < E.policy.spin_us;
}

/* Wake the progress thread if it sleeps for longer than sleep_max_us; where it stands
 * aside for a polling application thread, only for a large message (flags SF_BUSY):
 * that one needs polling while the application computes. */
static void wake_lazy(int flags)
{
    pthread_mutex_lock(&E.wmtx);
    E.kicked = 1;
    /* the clock only where the nap's end decides (a read costs 0.1 - 0.3 us in a VM): not
     * for a thread that stands aside while no large message moves (a post+wait loop) */
    int how = E.sleeping, sig = !E.threaded || how == SLEEP_PARKED;
    if (!sig && (how == SLEEP_NAP || (how == SLEEP_ASIDE && (flags & SF_BUSY))))
        sig = E.nap_until_us - now_us() > E.policy.sleep_max_us;
    if (sig) pthread_cond_signal(&E.work);
    pthread_mutex_unlock(&E.wmtx);
}

/* The kick of a post or of a round armed: the caller will usually drive progress itself
 * in the wait() that follows, so a futex wake-up of the progress thread is spent only
 * where it is needed:
 *  - nothing to poll (no message in flight, or a full round waiting for this rank's
 *    post; one process): no wake-up, only the event is noted;
 *  - the progress thread parked, or napping for longer than sleep_max_us, or inline
 *    progress: wake it now;
 *  - napping for at most sleep_max_us more, or awake: it finds the kick when its nap
 *    ends; a wait() or test() in between progresses inline. */
double kick_lazy(double now)
{
    if (now >= 0) note_at(now = now > 0 ? now : now_us());
    int flags = E.threaded ? engine_flags() : 0;
    if (!E.threaded || (flags & (idle_poll() ? SF_INFLIGHT : SF_POLLABLE))) wake_lazy(flags);
    return now > 0 ? now : 0;
}

/* The kick of a post that starts a round for others: wake the progress thread at once,
 * but only if it could do something (nothing to poll at P = 1). */
double kick_eager(double now)
{
    int noted = now >= 0;
    if (!noted) now = (double)LOAD(E.last_event_us);
    else note_at(now = now > 0 ? now : now_us());
    int flags = E.threaded ? engine_flags() : 0;
    if (!E.threaded || (flags & SF_INFLIGHT)) {
        if (idle_core_each() && app_in_loop(now)) wake_lazy(flags);   /* its wait() follows at once */
        else wake();
    }
    return noted ? now : 0;
}

static int take_kick(void)
{
    pthread_mutex_lock(&E.wmtx);
    int k = E.kicked;
    E.kicked = 0;
    pthread_mutex_unlock(&E.wmtx);
    return k;
}

/* Set by the progress thread itself (E.thread may not be stored yet when it starts). */
static __thread int on_progress_thread;

/* Sleep until kicked or for us microseconds (us < 0: until kicked). No lock held. */
static void sleep_as(double us, int how)
{
    int me = on_progress_thread;
    pthread_mutex_lock(&E.wmtx);
    if (!E.kicked && !LOAD(E.stop)) {
        if (us < 0) {
            if (me) STORE(E.sleeping, SLEEP_PARKED);
            pthread_cond_wait(&E.work, &E.wmtx);
        } else {
            struct timespec ts;
            if (me) { STORE(E.sleeping, how); E.nap_until_us = now_us() + us; }
            abs_deadline(&ts, us);
            pthread_cond_timedwait(&E.work, &E.wmtx, &ts);
        }
        STORE(E.sleeping, SLEEP_AWAKE);
    }
    E.kicked = 0;            /* a kick ends one sleep */
    pthread_mutex_unlock(&E.wmtx);
}

static void sleep_for_kick(double us) { sleep_as(us, SLEEP_NAP); }

/* A waiter counts itself in done_sleepers under dmtx before it tests its predicate, and
 * the caller changed what predicates read before this: either the waiter sees the change,
 * or this sees the waiter and wakes it. Without one, no lock (a round completed in the
 * waiting thread's own pass, the small-message loop). */
void notify_done(void)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&E.done_sleepers, __ATOMIC_SEQ_CST) == 0) return;
    pthread_mutex_lock(&E.dmtx);
    pthread_cond_broadcast(&E.done);
    pthread_mutex_unlock(&E.dmtx);
}

void notify_books(void)
{
    pthread_mutex_lock(&E.dmtx);
    pthread_cond_broadcast(&E.books);
    pthread_mutex_unlock(&E.dmtx);
}

/* ------------------------------------------------------------------ the idle policy
 * Shared by the progress thread and inline waits, counted from the last event: poll
 * (the policy "spin", or auto's spin while the node is not contended) up to the
 * adaptive bound idle_spin_bound_us(); otherwise spin spin_us, yield yield_us, then
 * sleep with a doubling, capped backoff. While a large message moves (SF_BUSY) it keeps
 * yielding instead of sleeping, up to idle_busy_bound_us() after the last event (a few
 * times the period at which large transfers showed progress, at most busy_cap_us). Past
 * deep_after_us the sleep cap grows to a tenth of the idle time divided by the message
 * steps of the longest armed schedule (at most deep_sleep_us): a round that crosses that
 * many napping ranks, one after another, answers within about a tenth of their idle time.
 * A kick (a local post) ends a sleep at once. Called without any lock. */
typedef struct { double idle_since, sleep_us; unsigned spins; } idle_state;

static void idle_reset(idle_state *st)
{
    st->idle_since = (double)__atomic_load_n(&E.last_event_us, __ATOMIC_RELAXED);
    st->sleep_us = E.policy.sleep_min_us;
    st->spins = 0;
}

/* A wait of an application thread ended (a round, or whatever it waited for, completed)
 * us after the rank's last event before it: the rank's idle time then, as the deep sleep
 * counts it (a rank that computes, then posts to a round it does not start, has been
 * idle since its previous round). The last eight are kept, for routine_wait_us(). Two
 * waits ending at once may share a slot (one sample lost). */
static void note_wait(double us)
{
    unsigned i = __atomic_load_n(&E.nwaits, __ATOMIC_RELAXED);   /* no locked RMW per wait */
    __atomic_store_n(&E.nwaits, i + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&E.waits_us[i & 7], (int64_t)us, __ATOMIC_RELAXED);
}

/* How idle this rank routinely is when its waits end: the third longest of the last
 * eight (note_wait; 0 before eight), so that a wait is routine once three of eight
 * lasted that long, and one or two longer ones (a late peer, now and then) are not. */
static double routine_wait_us(void)
{
    if (__atomic_load_n(&E.nwaits, __ATOMIC_RELAXED) < 8) return 0;
    int64_t w[8];
    for (int i = 0; i < 8; i++) w[i] = __atomic_load_n(&E.waits_us[i], __ATOMIC_RELAXED);
    for (int i = 1; i < 8; i++)          /* insertion sort, descending */
        for (int j = i; j > 0 && w[j] > w[j - 1]; j--) { int64_t t = w[j]; w[j] = w[j - 1]; w[j - 1] = t; }
    return (double)w[2];
}

/* How long without an event before the sleep cap grows (the deep sleep): deep_after_us,
 * or longer where this rank's idle periods are routinely long, at most 5 deep_after_us
 * (100 ms by default: a nap of sleep_max_us costs about 7 % of a core on a 2-core VM,
 * so a rank that waits for seconds still averages under 1 %):
 *  - while its application computes between posts: four periods between posts. A rank of
 *    a loop whose iteration is longer than deep_after_us was taken as idle in the middle
 *    of each iteration: the activation of a round it had not posted to yet (solo,
 *    majority, probe) waited up to a tenth of its idle time at every such rank it
 *    crossed (Fig. 9 at 10 ms skew across 8 hosts: probe 1.36x its ideal, 1.13x with the
 *    cap held);
 *  - while a thread of this rank waits (for a round: it posted, the round has not
 *    completed): four times the idle time at which three of its last eight waits ended
 *    (routine_wait_us). A rank that posts early in every iteration waits routinely, and
 *    the round that ends its wait (an activation, a peer's data) crosses it, so it stays
 *    awake that long; a wait longer than routine (a late peer) goes deep after
 *    deep_after_us, as a rank's first waits do: a wait of 150 ms for a late peer cost
 *    5 - 6 ms more CPU when waiting ranks kept the computing ranks' bound
 *    (tests/mpi/idle_checks.py). */
static double deep_after_us(void)
{
    double lo = E.policy.deep_after_us, hi = 5 * lo;
    int waiting = LOAD(E.done_sleepers) > 0 || LOAD(E.app_polling) > 0;
    double t = 4.0 * (waiting ? routine_wait_us() : (double)LOAD(E.post_period_us));
    return t < lo ? lo : t > hi ? hi : t;
}

static void idle_step(idle_state *st, int busy)
{
    int poll = idle_poll();
    /* read the clock on every 16th spin only: one read per spin was a fifth of a busy loop */
    if ((++st->spins & 15) != 0 && st->sleep_us == E.policy.sleep_min_us) {
        if (poll && (st->spins & 63) == 0) sched_yield();
        return;
    }
    double idle = now_us() - st->idle_since;
    if (poll && idle < idle_spin_bound_us()) {       /* cores to spare: poll, yielding now and then */
        if ((st->spins & 63) == 0) sched_yield();
        return;
    }
    if (idle < E.policy.spin_us) return;
    if (idle < E.policy.spin_us + E.policy.yield_us) {
        sched_yield();
        return;
    }
    if (busy && idle < idle_busy_bound_us()) {
        sched_yield();
        return;
    }
    sleep_for_kick(st->sleep_us);
    double cap = E.policy.sleep_max_us;
    if (idle > deep_after_us()) {
        double deep = idle / (10.0 * engine_hops());
        if (deep > cap) cap = deep < E.policy.deep_sleep_us ? deep : E.policy.deep_sleep_us;
    }
    st->sleep_us *= 2;
    if (st->sleep_us > cap) st->sleep_us = cap;
}

static void *progress_main(void *arg)
{
    (void)arg;
    on_progress_thread = 1;
    pthread_setname_np(pthread_self(), "pc-progress");    /* top -H, perf, /proc/PID/task */
    idle_state st;
    idle_reset(&st);
    for (;;) {
        if (LOAD(E.stop)) break;
        idle_sample();
        if (LOAD(E.app_polling) > 0 || (idle_core_each() && app_in_loop(now_us()))) {
            /* an application thread is polling in wait(), or left one spin_us ago (a loop of
             * post and wait): stay off MPI and off the engine's cache lines. Where each rank
             * has a core, stand aside asleep: where its progress thread has one too and the
             * policy polls (idle_spare), for spin_us at a time, so that it takes over soon
             * after the loop ends (a thread that spun on sched_yield() here took the lines
             * the waiter writes: 8 B rounds 2x slower on a 16-core node); else for 5
             * sleep_max_us (each wake-up preempts a rank's application thread, and its
             * peers wait for it). Where ranks share cores: yield (polling), or nap; while
             * the waiter polls a large message (SF_BUSY), until it stops (it wakes this
             * thread then: wake(), wake_lazy()): naps of sleep_max_us woke this thread
             * 4 - 8 times in a 1 MiB round at P = 8 on 2 cores, each wake-up preempting a
             * rank that was moving data (a small round's wait is over within one nap). */
            if (idle_core_each()) sleep_as(idle_spare() ? E.policy.spin_us : 5 * E.policy.sleep_max_us, SLEEP_ASIDE);
            else if (idle_poll()) sched_yield();
            else if (engine_flags() & SF_BUSY) sleep_as(-1, SLEEP_PARKED);
            else sleep_for_kick(E.policy.sleep_max_us);
            idle_reset(&st);
            continue;
        }
        /* polling (spin, or auto's spin) covers armed rounds (a message in flight), but
         * only within the bound after the last event; past it, as under sleep, only what
         * can complete without a local post: a full round armed waits for this rank's
         * post, which kicks, so the thread sleeps until then instead of waking every
         * sleep_max_us for nothing */
        double now = now_us();
        int hot = idle_poll() && now - st.idle_since < idle_spin_bound_us();
        int listening = LOAD(E.npolled) > 0;     /* a unit's messages outside its schedules */
        int flags = engine_flags(), any = LOAD(E.nrunning) > 0 || listening;
        int pollable = flags & (hot ? SF_INFLIGHT : SF_POLLABLE);
        STORE(E.pass_since_us, (int64_t)now);
        int progressed = any && engine_pass();
        STORE(E.pass_since_us, 0);
        if (!any || (!pollable && !progressed
                     && (hot || now_us() - st.idle_since > E.policy.spin_us + E.policy.yield_us))) {
            /* nothing to poll: sleep until a post (a listening unit: look again after a nap) */
            sleep_for_kick(listening ? E.policy.sleep_max_us : -1);
            idle_reset(&st);
        } else if (progressed || take_kick()) {
            idle_reset(&st);
        } else {
            idle_step(&st, flags & SF_BUSY);
        }
    }
    return NULL;
}

int pc_engine_start(int use_thread, const pc_idle_policy *policy)
{
    int provided = 0, rc = PC_OK;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE)
        return fail(PC_ERR_THREAD, "partialcoll needs MPI_THREAD_MULTIPLE, but MPI provides level %d "
                    "(initialize MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE); mpi4py does so by default)",
                    provided);
    if (policy->poll_armed < 0 || policy->poll_armed > 2)
        return fail(PC_ERR_ARG, "poll_armed must be 0 (sleep), 1 (spin) or 2 (auto), not %d", policy->poll_armed);
    pthread_mutex_lock(&E.lock);
    if (E.started) { pthread_mutex_unlock(&E.lock); return fail(PC_ERR_STATE, "engine already started"); }
    if (!E.conds_ready) {             /* deadlines are CLOCK_MONOTONIC (abs_deadline) */
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&E.work, &attr);
        pthread_cond_init(&E.done, &attr);
        pthread_cond_init(&E.books, &attr);
        pthread_condattr_destroy(&attr);
        E.conds_ready = 1;
    }
    E.policy = *policy;
    STORE(E.stop, 0);
    E.threaded = use_thread;
    if (use_thread && pthread_create(&E.thread, NULL, progress_main, NULL) != 0)
        rc = fail(PC_ERR_THREAD, "cannot start the progress thread: %s", strerror(errno));
    STORE(E.started, rc == PC_OK);
    pthread_mutex_unlock(&E.lock);
    return rc;
}

/* Every running schedule, pinned; unpin_all() gives them back. */
static int pin_all(void)
{
    int n = 0;
    pthread_mutex_lock(&E.lock);
    if (E.nrunning > snap.cap) snap_grow(E.nrunning + 8);
    for (pc_sched *s = E.running; s && n < snap.cap; s = s->next) { snap.s[n++] = s; s->unit->passes++; }
    pthread_mutex_unlock(&E.lock);
    return n;
}

static void unpin_all(int n)
{
    pthread_mutex_lock(&E.lock);
    for (int i = 0; i < n; i++) snap.s[i]->unit->passes--;
    pthread_mutex_unlock(&E.lock);
}

int pc_engine_set_node(void *shared, int local_rank, int local_size, int node_cpus)
{
    int rc = idle_set_node(shared, local_rank, local_size, node_cpus);
    wake();
    return rc;
}

int pc_engine_stop(void)
{
    pthread_mutex_lock(&E.lock);
    if (!E.started) { pthread_mutex_unlock(&E.lock); return PC_OK; }
    STORE(E.stop, 1);
    pthread_mutex_unlock(&E.lock);
    kick();
    if (E.threaded) pthread_join(E.thread, NULL);
    while (LOAD(E.reporter_on)) {       /* it sees E.stop at its next pass */
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    /* Withdraw what is still running: receives are cancelled, sends get up to a second
     * to complete (cancelling sends is no-op in Open MPI; freeing them while they read
     * a buffer would be wrong). What is still in flight then is forgotten, and the
     * memory it may touch is leaked on purpose, never freed. */
    int n = pin_all();
    for (int i = 0; i < n; i++) {
        pc_sched *s = snap.s[i];
        unit_lock(s->unit);
        if (s->running) stepper.fail(s, "engine stopped (partialcoll.finalize) while running");
        unit_unlock(s->unit);
    }
    unpin_all(n);
    double until = now_us() + 1e6;
    while (LOAD(E.nrunning) > 0 && now_us() < until) engine_pass();
    n = pin_all();
    for (int i = 0; i < n; i++) {
        pc_sched *s = snap.s[i];
        unit_lock(s->unit);
        if (s->running) {
            stepper.forget(s);
            pthread_mutex_lock(&E.lock);
            s->unit->leaked = 1;          /* may still be read or written by MPI: never freed */
            pthread_mutex_unlock(&E.lock);
            stepper.step(s);              /* nothing listed now: off the running list */
        }
        unit_unlock(s->unit);
    }
    unpin_all(n);
    reap_units();
    pthread_mutex_lock(&E.lock);
    STORE(E.started, 0);
    pthread_mutex_unlock(&E.lock);
    notify_done();
    notify_books();
    return PC_OK;
}

int pc_engine_threaded(void) { return LOAD(E.started) && E.threaded; }

/* Wait for pred without driving progress: for a thread that waits on the engine's
 * bookkeeping, not on a round (the balancer's pc_coll_stats). It sleeps on E.books until
 * pred holds or timeout_s passes, and never polls MPI or watches for a stuck pass as
 * wait_until does (a second waiter of that kind woke every sleep_max_us while the
 * progress thread reduced a large round, and took that CPU from it where ranks share
 * cores). E.books, not E.done: E.done wakes at every completion, two or three times a
 * round, where the balancer needs one wake-up per epoch. Whoever changes what pred reads
 * calls notify_books(). */
int wait_passive(int (*pred)(void *), void *arg, double timeout_s)
{
    double deadline = now_us() + timeout_s * 1e6;
    int rc = PC_OK;
    pthread_mutex_lock(&E.dmtx);
    while (!pred(arg)) {
        double now = now_us();
        if (!LOAD(E.started)) { rc = fail(PC_ERR_STATE, "the engine is not running (partialcoll.finalize was called)"); break; }
        if (now >= deadline) { rc = PC_ERR_TIMEOUT; break; }
        struct timespec ts;
        abs_deadline(&ts, deadline - now);
        pthread_cond_timedwait(&E.books, &E.dmtx, &ts);
    }
    pthread_mutex_unlock(&E.dmtx);
    return rc;
}

/* Wait (no lock held) until pred(arg) or the timeout; pred reads atomics only.
 * Thread mode: poll briefly (longer under the spin policy), progressing here to spare
 * the hand-off, then sleep on E.done while the progress thread works. If the progress
 * thread is stuck in a long step (a large reduction of another collective), the waiter
 * progresses itself every sleep_max_us, so its round does not wait for that step.
 * Inline mode: this thread drives progress, under the adaptive idle policy. */
int wait_until(int (*pred)(void *), void *arg, double timeout_s)
{
    double deadline = -1, now = 0;
    idle_state st;
    idle_reset(&st);
    int polling = 0, rc = PC_OK, passed = 0;   /* passed: a pass was made (a wait tests once) */
    int slept = 0;                             /* on E.done: then `now` is stale at the end */
    unsigned polls = 0;
    double began = -1;
    /* where each rank of the node has a core, yield it on every pass for yield_us more
     * before sleeping; else a rank that computes may need it: sleep after spin_us */
    double yield_until = E.policy.spin_us + (idle_core_each() ? E.policy.yield_us : 0);
    while (!pred(arg)) {
        if (!LOAD(E.started)) { rc = fail(PC_ERR_STATE, "the engine is not running (partialcoll.finalize was called)"); break; }
        /* the clock on every 4th pass while polling: a read costs as much as a pass's
         * MPI test in a VM (an 8 B round is a few passes) */
        if (!polling || (++polls & 3) == 0) now = now_us();
        /* idle since the last event (a post that starts no round is none): idle_reset's */
        if (began < 0) began = st.idle_since > 0 && st.idle_since < now ? st.idle_since : now;
        if (deadline < 0 && timeout_s >= 0) deadline = now + timeout_s * 1e6;
        /* the deadline only after one pass: wait(timeout=0) is a test, which progresses */
        if (deadline >= 0 && now >= deadline && passed) { rc = PC_ERR_TIMEOUT; break; }
        passed = 1;
        if (!E.threaded) {
            if (engine_pass()) idle_reset(&st);
            else idle_step(&st, engine_flags() & SF_BUSY);
            continue;
        }
        double idle = now - st.idle_since;
        int64_t pass_since = LOAD(E.pass_since_us);
        int stuck = pass_since > 0 && now - (double)pass_since > E.policy.sleep_max_us;
        int spin = idle < yield_until || (idle_poll() && idle < idle_spin_bound_us());
        /* a large message moves (SF_BUSY): the progress thread would poll it, yielding, up
         * to the busy bound; this thread does so instead, while the progress thread
         * stands aside. The rank polls with one thread either way, and the round's end is
         * seen here, without the hand-off: a futex wake-up of this thread that, where ranks
         * share cores, waited for a core behind the other ranks' polling threads (1 MiB
         * rounds at P = 4 on 2 cores: 1.1 - 1.3x MPI_Allreduce, not 0.9x) */
        if (!spin && idle < idle_busy_bound_us() && (engine_flags() & SF_BUSY)) spin = 1;
        if (spin) {
            /* spin phase: progress here, sparing the hand-off to the progress thread;
             * yield every 8th pass (not where every thread has a CPU: idle_spare), and on
             * every pass after spin_us: a peer's thread (or this rank's progress thread)
             * waiting for this core gets it at once, where a thread that only spins keeps
             * it for a whole time slice */
            if (!polling) { polling = 1; __atomic_add_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST); }
            if (engine_pass()) idle_reset(&st);
            else if (((++st.spins & 7) == 0 && !idle_spare()) || idle >= E.policy.spin_us) sched_yield();
            continue;
        }
        if (polling) { polling = 0; __atomic_sub_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST); wake(); }
        if (stuck && engine_pass()) { idle_reset(&st); continue; }
        /* the progress thread completes the round and E.done wakes this thread: the slice
         * only bounds how late a stuck pass is noticed, 10 ms, and a tenth of the idle time
         * once nothing has happened for longer (a late peer: fewer wake-ups) */
        double slice = idle / 10 > 10000.0 ? idle / 10 : 10000.0;
        if (deadline >= 0 && deadline - now < slice) slice = deadline - now;
        if (pass_since > 0 && slice > E.policy.sleep_max_us) slice = E.policy.sleep_max_us;
        struct timespec ts;
        abs_deadline(&ts, slice);
        pthread_mutex_lock(&E.dmtx);
        __atomic_add_fetch(&E.done_sleepers, 1, __ATOMIC_SEQ_CST);    /* notify_done */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (!pred(arg)) pthread_cond_timedwait(&E.done, &E.dmtx, &ts);
        __atomic_sub_fetch(&E.done_sleepers, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&E.dmtx);
        slept = 1;
    }
    /* how long the rank had been idle when its wait ended (what the deep sleep learns:
     * deep_after_us()); no clock read of its own for a wait that only polled (an 8 B
     * round: its last passes' clock) */
    if (rc == PC_OK && began >= 0 && E.threaded) note_wait((slept ? now_us() : now) - began);
    /* the progress thread takes over: at once if it is parked, else when its nap ends */
    if (polling) {
        /* when it left: the clock of its last passes (read every 4th pass; a few us old at
         * most, against a spin_us of tens), not a read of its own */
        STORE(E.app_left_us, (int64_t)now);
        __atomic_sub_fetch(&E.app_polling, 1, __ATOMIC_SEQ_CST);
        /* the flags matter only to a thread that stands aside (a racy read: one that
         * begins to stand aside just now takes over when its sleep ends, within 1 ms) */
        wake_lazy(LOAD(E.sleeping) == SLEEP_ASIDE ? engine_flags() : 0);
    }
    return rc;
}
