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

void abs_deadline(struct timespec *ts, double us)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    long long ns = ts->tv_nsec + (long long)(us * 1e3);
    ts->tv_sec += ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}
