/* Dispatch (instruction set chosen at run time) and the thread pool of the kernels. */
#define _GNU_SOURCE
#include "qmm.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* ------------------------------------------------------------ instruction sets */

static const char *const ISA_NAMES[QMM_NUM_ISAS] = {"scalar", "avx2", "avx512", "neon"};
static int forced_isa = -1;

int mlxserve_qmm_isa_supported(int isa) {
    switch (isa) {
    case QMM_SCALAR:
        return 1;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    case QMM_AVX2:
        __builtin_cpu_init();
        return mlxserve_qmm_built_avx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case QMM_AVX512:
        __builtin_cpu_init();
        return mlxserve_qmm_built_avx512 && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("f16c");
#endif
#if defined(__aarch64__)
    case QMM_NEON:
        return mlxserve_qmm_built_neon;
#endif
    default:
        return 0;
    }
}

/* The first of `order` (best first) that `supported` accepts; the scalar path (0) if none. */
static int first_supported(const int *order, int n, int (*supported)(int)) {
    for (int i = 0; i < n; i++)
        if (supported(order[i])) return order[i];
    return 0;
}

/* Forcing one of n instruction sets (n: automatic again) into *forced; -1 if unsupported. */
static int force(int isa, int n, int (*supported)(int), int *forced) {
    if (isa == n) {
        *forced = -1;
        return 0;
    }
    if (isa < 0 || isa >= n || !supported(isa)) return -1;
    *forced = isa;
    return 0;
}

static const char *isa_name(int isa, int n, const char *const *names) {
    return isa >= 0 && isa < n ? names[isa] : "unknown";
}

int mlxserve_qmm_isa(void) {
    static const int order[] = {QMM_AVX512, QMM_AVX2, QMM_NEON};
    static int best = -1;
    if (best < 0) best = first_supported(order, 3, mlxserve_qmm_isa_supported);
    return forced_isa >= 0 ? forced_isa : best;
}

int mlxserve_qmm_force_isa(int isa) {
    return force(isa, QMM_NUM_ISAS, mlxserve_qmm_isa_supported, &forced_isa);
}

const char *mlxserve_qmm_isa_name(int isa) { return isa_name(isa, QMM_NUM_ISAS, ISA_NAMES); }

static void qmm_float(const qmm_problem *p) {
    static void (*const kernels[QMM_NUM_ISAS])(const qmm_problem *) = {
        [QMM_SCALAR] = mlxserve_qmm_scalar, [QMM_AVX2] = mlxserve_qmm_avx2,
        [QMM_AVX512] = mlxserve_qmm_avx512, [QMM_NEON] = mlxserve_qmm_neon,
    };
    kernels[mlxserve_qmm_isa()](p);
}

/* ------------------------------------------------------------ int8 activations */

static const char *const Q8_NAMES[Q8_NUM_ISAS] = {"scalar", "avx2", "avxvnni", "avx512vnni",
                                                  "neon"};
static int forced_q8 = -1;

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

int mlxserve_q8_isa_supported(int isa) {
    switch (isa) {
    case Q8_SCALAR:
        return 1;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    case Q8_AVX2:
        return mlxserve_q8_built_avx2 && mlxserve_qmm_isa_supported(QMM_AVX2);
    case Q8_AVXVNNI:
        __builtin_cpu_init();
        return mlxserve_q8_built_avxvnni && mlxserve_qmm_isa_supported(QMM_AVX2) &&
               __builtin_cpu_supports("avxvnni");
    case Q8_AVX512VNNI:
        __builtin_cpu_init();
        return mlxserve_q8_built_avx512vnni && mlxserve_qmm_isa_supported(QMM_AVX2) &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__aarch64__)
    case Q8_NEON:
#if defined(__APPLE__)
        return mlxserve_q8_built_neon; /* every Apple arm64 CPU has the dot product */
#elif defined(__linux__)
        return mlxserve_q8_built_neon && (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
        return 0;
#endif
#endif
    default:
        return 0;
    }
}

int mlxserve_q8_isa(void) {
    static const int order[] = {Q8_AVX512VNNI, Q8_AVXVNNI, Q8_AVX2, Q8_NEON};
    static int best = -1;
    if (best < 0) best = first_supported(order, 4, mlxserve_q8_isa_supported);
    return forced_q8 >= 0 ? forced_q8 : best;
}

int mlxserve_q8_force_isa(int isa) {
    return force(isa, Q8_NUM_ISAS, mlxserve_q8_isa_supported, &forced_q8);
}

const char *mlxserve_q8_isa_name(int isa) { return isa_name(isa, Q8_NUM_ISAS, Q8_NAMES); }

/* Thread-local buffers of the int8 path, grown as needed. */
static __thread void *q8_buf;
static __thread size_t q8_cap;

/* Rows of x rounded to int8 (mlxserve_q8_quantize), Q8_ROUND_ROWS per pool item: each
 * row's rounding is its own, so any split gives the same bits. */
#define Q8_ROUND_ROWS 32
typedef struct {
    const float *x;
    int64_t K, M_end;
    int perm4;
    int8_t *q;
    float *d, *dsum;
} q8_rounding;

static void round_rows(void *ctx, int64_t item) {
    const q8_rounding *r = (const q8_rounding *)ctx;
    const int64_t m0 = item * Q8_ROUND_ROWS, nb = r->K / 32;
    const int64_t rows = r->M_end - m0 < Q8_ROUND_ROWS ? r->M_end - m0 : Q8_ROUND_ROWS;
    mlxserve_q8_quantize(r->x + m0 * r->K, rows, r->K, r->perm4, r->q + m0 * r->K, r->d + m0 * nb,
                         r->dsum + m0 * nb);
}

/* x rounded once, then the integer matmul over all rows (q8_impl.h): a row's result is
 * the same bits whatever the rows around it, so a request's logits do not depend on its
 * batch, drafts or prompt chunking. */
static int qmm_int8(const qmm_problem *p) {
    static void (*const kernels[Q8_NUM_ISAS])(const q8_problem *) = {
        [Q8_SCALAR] = mlxserve_q8_scalar,         [Q8_AVX2] = mlxserve_q8_avx2,
        [Q8_AVXVNNI] = mlxserve_q8_avxvnni,       [Q8_AVX512VNNI] = mlxserve_q8_avx512vnni,
        [Q8_NEON] = mlxserve_q8_neon,
    };
    const int64_t M = p->M, K = p->K, nb = K / 32;
    const size_t need = (size_t)(M * K) + 2 * sizeof(float) * (size_t)(M * nb); /* q, d, dsum */
    if (need > q8_cap) {
        free(q8_buf);
        q8_buf = aligned_alloc(64, (need + 63) / 64 * 64);
        q8_cap = q8_buf ? need : 0;
        if (!q8_buf) return -2;
    }
    float *d = (float *)q8_buf, *dsum = d + M * nb;
    int8_t *q = (int8_t *)(dsum + M * nb);
    const q8_rounding r = {p->x, K, M, p->bits == 4, q, d, dsum};
    if (M >= 2 * Q8_ROUND_ROWS && M * K >= 65536) /* a prompt's rows: on the pool */
        mlxserve_qmm_parallel_for((M + Q8_ROUND_ROWS - 1) / Q8_ROUND_ROWS, round_rows, (void *)&r);
    else
        mlxserve_q8_quantize(p->x, M, K, p->bits == 4, q, d, dsum);
    const q8_problem qp = {p, q, d, dsum};
    kernels[mlxserve_q8_isa()](&qp);
    return 0;
}

int mlxserve_qmm(const qmm_problem *p) {
    if (p->bits < 2 || p->bits > 8 || p->bits == 7 || p->group_size < 32 || p->group_size % 32 ||
        p->K % p->group_size || p->M < 0 || p->N < 0 || p->scale_type < QMM_F32 ||
        p->scale_type > QMM_BF16 || (p->act_bits != 0 && p->act_bits != 8))
        return -1;
    if (p->M == 0 || p->N == 0) return 0;
    if (p->act_bits == 8) return qmm_int8(p);
    qmm_float(p);
    return 0;
}

/* ------------------------------------------------------------ thread pool
 *
 * Workers spin a short while after each call (decode issues ~200 matmuls per step a few
 * microseconds apart), then sleep on a condition variable. Items are claimed from a
 * ticket that carries the call's generation, so a worker that wakes late (the OS ran
 * something else on its core) finds the call over and touches nothing: the caller
 * waits only for items actually claimed, never for a worker to show up. A claim can take
 * a share of the items left (qmm.h: claims): a one-row call of 12-64 small items (a few
 * microseconds each) then costs a handful of contended atomics instead of two per item.
 */

#define MAX_THREADS 256

/* Claims of a share of what is left, at most MAX_CLAIM items: consecutive items then mostly
 * go to one thread, so the one-row kernels' prefetching of the next rows (q8_impl.h) lands
 * in the cache of the core that reads them (bench/gemv_floor.py at 2 threads, loaded
 * machine: 0.7-0.95x the step's matmul time of one item a claim). The cap keeps what a
 * descheduled helper can hold small (under oversubscription the caller cannot take over a
 * claimed item, only the unclaimed ones). */
#define MAX_CLAIM 8
/* The spin window covers the gaps between one step's calls (microseconds: norms, scatters),
 * not the host's graph building between steps (~1.5 ms), when the workers sleep either way;
 * spinning longer only takes a core from whoever else runs (single-stream decode in one
 * engine, bench/pool_settings.py, 2 threads, load 8.5-10.6: medians 7-53% higher at 50 us
 * than at 200 in five comparisons). */
static atomic_long spin_ns = 50000L, claim_div = 2;

long mlxserve_qmm_set_claim_div(long div) {
    return div >= 0 ? atomic_exchange(&claim_div, div) : atomic_load(&claim_div);
}

long mlxserve_qmm_set_spin_ns(long ns) {
    return ns >= 0 ? atomic_exchange(&spin_ns, ns) : atomic_load(&spin_ns);
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_mutex_t call; /* one parallel_for at a time; others run on their caller */
    int started, threads, wanted, sleepers;
    long calls;                /* caller-side generation counter */
    atomic_long generation;    /* the call workers should join */
    atomic_uint_fast64_t ticket; /* generation << 32 | next item */
    atomic_long done;          /* items finished in the current call */
    _Atomic(qmm_work_fn) fn;
    _Atomic(void *) ctx;
    atomic_long n_items;
    atomic_long share; /* claim_div * threads of the current call; 0: one item a claim */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER};

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Claim and run items of call `gen` until none is left (or the call is over): a share of
 * what is left per claim (qmm.h: claims), the items of a claim in order. */
static void run_items(long gen, qmm_work_fn fn, void *ctx, long n, long share) {
    uint_fast64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    for (;;) {
        const long next = (long)(t & 0xFFFFFFFFu);
        if ((long)(t >> 32) != (gen & 0xFFFFFFFFL) || next >= n) return;
        long take = share > 0 ? (n - next) / share : 1;
        if (take < 1) take = 1;
        if (take > MAX_CLAIM) take = MAX_CLAIM;
        if (atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + (uint_fast64_t)take,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            for (long i = next; i < next + take; i++) fn(ctx, (int64_t)i);
            atomic_fetch_add_explicit(&pool.done, take, memory_order_release);
            t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        }
    }
}

static void *worker(void *arg) {
    long seen = (long)(intptr_t)arg; /* the generation before this worker's first call */
    for (;;) {
        long g = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (g == seen) {
            const long until = now_ns() + atomic_load_explicit(&spin_ns, memory_order_relaxed);
            for (int i = 0; (g = atomic_load_explicit(&pool.generation, memory_order_acquire)) ==
                            seen;
                 i++) {
                cpu_relax();
                if ((i & 63) == 63 && now_ns() > until) {
                    pthread_mutex_lock(&pool.mu);
                    pool.sleepers++;
                    while ((g = atomic_load(&pool.generation)) == seen)
                        pthread_cond_wait(&pool.wake, &pool.mu);
                    pool.sleepers--;
                    pthread_mutex_unlock(&pool.mu);
                    break;
                }
            }
        }
        seen = g;
        /* Acquire: should any of these be a later call's (this worker ran late), that
         * call's caller closed call g's ticket before writing it, so run_items sees a
         * closed or newer ticket and claims nothing with a mismatched set. */
        run_items(g, atomic_load_explicit(&pool.fn, memory_order_acquire),
                  atomic_load_explicit(&pool.ctx, memory_order_acquire),
                  atomic_load_explicit(&pool.n_items, memory_order_acquire),
                  atomic_load_explicit(&pool.share, memory_order_acquire));
    }
    return NULL;
}
static int default_threads(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void after_fork_in_child(void) { pool.started = pool.threads = pool.sleepers = 0; }

static void start_pool(void) {
    int want = pool.wanted > 0 ? pool.wanted : default_threads();
    if (want > MAX_THREADS) want = MAX_THREADS;
    if (!pool.started) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        pool.started = 1;
        pool.threads = 1; /* the caller */
    }
    while (pool.threads < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        void *seen = (void *)(intptr_t)atomic_load(&pool.generation);
        const int err = pthread_create(&t, &attr, worker, seen);
        pthread_attr_destroy(&attr);
        if (err) break;
        pool.threads++;
    }
}

int mlxserve_qmm_set_threads(int n) {
    pthread_mutex_lock(&pool.call);
    pool.wanted = n > 0 ? n : 0;
    pthread_mutex_unlock(&pool.call);
    return mlxserve_qmm_threads();
}

int mlxserve_qmm_threads(void) {
    int want = pool.wanted > 0 ? pool.wanted : default_threads();
    return want > MAX_THREADS ? MAX_THREADS : want;
}

void mlxserve_qmm_parallel_for(int64_t n_items, qmm_work_fn fn, void *ctx) {
    const int want = mlxserve_qmm_threads();
    if (n_items <= 1 || n_items > 0x7FFFFFFF || want <= 1 ||
        pthread_mutex_trylock(&pool.call) != 0) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i);
        return;
    }
    start_pool();
    const long gen = ++pool.calls;
    atomic_store_explicit(&pool.fn, fn, memory_order_release);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_release);
    atomic_store_explicit(&pool.n_items, n_items, memory_order_release);
    const long share = atomic_load_explicit(&claim_div, memory_order_relaxed) * want;
    atomic_store_explicit(&pool.share, share, memory_order_release);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.ticket, (uint_fast64_t)(gen & 0xFFFFFFFFL) << 32,
                          memory_order_release);
    atomic_store_explicit(&pool.generation, gen, memory_order_release);
    pthread_mutex_lock(&pool.mu);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    run_items(gen, fn, ctx, n_items, share);
    for (int i = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < n_items; i++) {
        if (i < 4096)
            cpu_relax();
        else
            sched_yield(); /* a helper holding an item was descheduled: give it the core */
    }
    /* Closed: a worker that still holds this call's generation claims nothing more, even
     * if it reads the next call's fn, ctx or n_items (worker()). */
    atomic_store_explicit(&pool.ticket, (uint_fast64_t)(gen & 0xFFFFFFFFL) << 32 | 0xFFFFFFFFu,
                          memory_order_release);
    pthread_mutex_unlock(&pool.call);
}
