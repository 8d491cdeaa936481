/* The thread pool of the native kernels: a fixed set of workers that stay hot between jobs.
 *
 * el_pool_run publishes a job by bumping a generation counter; workers spin on it (with a pause
 * instruction) for a bounded time after their last job, then sleep on a condition variable, so an
 * idle pool costs nothing and a pool on shared, busy cores does not steal them for long. The caller
 * is thread 0. A job must hand out its work dynamically (an atomic chunk counter, see decode.c and
 * linear.c): the caller runs it, and so does every worker that picks it up before the caller is
 * done; then the caller waits only for those. A worker the OS has descheduled on a busy machine
 * therefore delays a job by at most the chunk it holds, never by a whole time slice per job.
 * Nothing is allocated per job. */
#define _GNU_SOURCE
#include "edgellm_kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EL_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define EL_PAUSE() __asm__ __volatile__("yield")
#else
#define EL_PAUSE() ((void)0)
#endif

/* How long an idle worker spins before sleeping. Between the ops of one decode step the gaps are a
 * few microseconds; between tokens Python samples for ~0.1 ms. EDGELLM_SPIN_US overrides it. */
#define EL_SPIN_US_DEFAULT 200
#define EL_CHECK_EVERY 64 /* pauses between clock reads */

typedef struct {
    el_pool *pool;
    int ith;
} el_worker;

/* The job word: generation (bits 32..63) | closed (bit 16) | threads running the job (bits 0..15).
 * A worker joins the current job only while it is open, so the caller never waits for a worker the
 * OS has not scheduled since the job was published: it closes the job when its own share is done
 * (work is handed out dynamically, so nothing is left for late workers) and waits for the joined. */
#define EL_CLOSED (1ull << 16)
#define EL_ACTIVE 0xffffull
#define EL_GEN(s) ((s) >> 32)

struct el_pool {
    int n;
    long spin_ns;
    pthread_t *threads;
    el_worker *workers;
    el_task_fn fn;
    void *ctx;
    _Alignas(64) atomic_ullong job;  /* see above; read by every spinning worker */
    _Alignas(64) atomic_int sleepers; /* workers blocked (or about to block) on wake */
    atomic_int stop;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_mutex_t run_lock; /* one job at a time: two engines may share a pool from two threads */
};

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Wait until the generation differs from `seen`: spin for pool->spin_ns, then sleep. */
static unsigned long long wait_for_job(el_pool *p, unsigned long long seen) {
    long deadline = 0;
    for (int i = 1;; i++) {
        unsigned long long g = EL_GEN(atomic_load_explicit(&p->job, memory_order_acquire));
        if (g != seen || atomic_load_explicit(&p->stop, memory_order_relaxed)) return g;
        EL_PAUSE();
        if (i % EL_CHECK_EVERY) continue;
        long t = now_ns();
        if (!deadline) deadline = t + p->spin_ns;
        else if (t >= deadline) break;
    }
    pthread_mutex_lock(&p->lock);
    /* sleepers++ before re-reading the job, and the caller publishes the job before reading sleepers
     * (both sequentially consistent): either the caller sees us and signals, or we see its job. */
    atomic_fetch_add(&p->sleepers, 1);
    unsigned long long g;
    while ((g = EL_GEN(atomic_load(&p->job))) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->wake, &p->lock);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->lock);
    return g;
}

/* Count this worker in if job `gen` is still open; 0 when it is closed or already replaced. */
static int join_job(el_pool *p, unsigned long long gen) {
    unsigned long long s = atomic_load(&p->job);
    while (EL_GEN(s) == gen && !(s & EL_CLOSED))
        if (atomic_compare_exchange_weak(&p->job, &s, s + 1)) return 1;
    return 0;
}

static void *worker_main(void *arg) {
    el_worker *w = arg;
    el_pool *p = w->pool;
    unsigned long long seen = 0;
    for (;;) {
        seen = wait_for_job(p, seen);
        if (atomic_load(&p->stop)) return NULL;
        if (!join_job(p, seen)) continue;
        p->fn(p->ctx, w->ith, p->n);
        atomic_fetch_sub_explicit(&p->job, 1, memory_order_release);
    }
}

el_pool *el_pool_create(int nthreads) {
    const char *env = getenv("EDGELLM_SPIN_US");
    return el_pool_create_spin(nthreads, env ? atol(env) : EL_SPIN_US_DEFAULT);
}

el_pool *el_pool_create_spin(int nthreads, long spin_us) {
    if (nthreads < 1) nthreads = 1;
    el_pool *p = aligned_alloc(64, (sizeof(el_pool) + 63) / 64 * 64);
    if (!p) return NULL;
    p->n = nthreads;
    p->spin_ns = 1000L * (spin_us > 0 ? spin_us : 0);
    p->fn = NULL;
    p->ctx = NULL;
    atomic_init(&p->job, EL_CLOSED);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, 0);
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_mutex_init(&p->run_lock, NULL);
    p->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    p->workers = calloc((size_t)nthreads, sizeof(el_worker));
    if (!p->threads || !p->workers) {
        p->n = 1;
        el_pool_destroy(p);
        return NULL;
    }
    for (int i = 1; i < nthreads; i++) {
        p->workers[i] = (el_worker){p, i};
        if (pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i]) != 0) {
            p->n = i; /* the workers started so far are joined by destroy */
            el_pool_destroy(p);
            return NULL;
        }
    }
    return p;
}

void el_pool_run(el_pool *p, el_task_fn fn, void *ctx) {
    if (p->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&p->run_lock);
    p->fn = fn;
    p->ctx = ctx;
    unsigned long long gen = EL_GEN(atomic_load_explicit(&p->job, memory_order_relaxed)) + 1;
    atomic_store(&p->job, gen << 32); /* open, nobody joined; publishes fn and ctx */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->lock);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
    }
    fn(ctx, 0, p->n);
    /* Close the job, then wait for the workers that joined it: spin briefly, then give the core away
     * (a joined worker may be waiting for it). */
    unsigned long long s = atomic_fetch_or(&p->job, EL_CLOSED) | EL_CLOSED;
    for (int i = 0; s & EL_ACTIVE; i++, s = atomic_load_explicit(&p->job, memory_order_acquire)) {
        if (i < 4096) EL_PAUSE();
        else sched_yield();
    }
    pthread_mutex_unlock(&p->run_lock);
}

int el_pool_threads(const el_pool *p) { return p->n; }

void el_pool_destroy(el_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->job, 1ull << 32);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->lock);
    pthread_mutex_destroy(&p->run_lock);
    pthread_cond_destroy(&p->wake);
    free(p->threads);
    free(p->workers);
    free(p);
}
