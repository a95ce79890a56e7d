/* A wall-clock shift for one process, the chaos suite's clock jump (benchmarks/faults.py: ClockShift).
 *
 * Preloaded (LD_PRELOAD), it adds the seconds written in the file $CLOCKSHIFT_FILE (re-read at most
 * once a second) to CLOCK_REALTIME as clock_gettime, gettimeofday and time report it, so writing
 * that file steps the process's wall clock while it runs, as an NTP step would. The monotonic
 * clocks, sleeps and timed waits are untouched (libfaketime 0.9.10 breaks Python's time.sleep).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static long offset_s;
static struct timespec checked;

static void refresh(void) {
    struct timespec now;
    real_clock_gettime(CLOCK_MONOTONIC, &now);
    if (checked.tv_sec != 0 && now.tv_sec - checked.tv_sec < 1) return;
    checked = now;
    const char *path = getenv("CLOCKSHIFT_FILE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return;
    long v;
    if (fscanf(f, "%ld", &v) == 1) offset_s = v;
    fclose(f);
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    if (!real_clock_gettime) real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real_clock_gettime(clk, ts);
    if (rc == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) {
        refresh();
        ts->tv_sec += offset_s;
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0 && tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    (void)tz;
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
