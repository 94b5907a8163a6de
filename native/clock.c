/* clock.c -- monotonic time for the engine's units (CLOCK_MONOTONIC: the clock of
 * Python's time.monotonic, so that times the engine reports order with the
 * application's). Calls nothing of the engine. */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <time.h>

double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

/* A cheap, coarse CLOCK_MONOTONIC (its tick: 1 - 4 ms), for rates that need no more: a
 * CLOCK_MONOTONIC read costs 0.1 - 0.3 us in a VM (a few per pass added up to a tenth of
 * an 8 B round at P = 2), the coarse one a tenth of that. */
double now_coarse_us(void)
{
    struct timespec ts;
#ifdef CLOCK_MONOTONIC_COARSE
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
#else
    clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

void abs_deadline(struct timespec *ts, double us)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    long long ns = ts->tv_nsec + (long long)(us * 1e3);
    ts->tv_sec += ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}
