/* A decode step's one-row int8 matmuls against the memory floor, without MLX or Python.
 *
 *   PYTHONPATH=. python bench/gemv_floor.py [--csrc DIR ...] [threads,claim_div,spin_us ...]
 *
 * builds it as the extension builds the kernels (mlxserve/cpu/build.py's flags: other
 * flags, say -O2 with every -m flag on every file, measured a 1.7x slower kernel here) and
 * runs it (arguments: rounds, then the settings), for one source tree or several
 * alternately (an A/B of main and a branch).
 *
 * SmolLM2-135M's step as the default model loads it: 30 layers of fused q/k/v 576 -> 960,
 * o 576 -> 576, fused gate/up 576 -> 3072 and down 1536 -> 576 (4-bit) and the tied LM head
 * 576 -> 49152 (8-bit), group 32, float16 scales and biases: ~98 MB of distinct weights,
 * called in a step's order, so they stream from where they would in a step (not from L2).
 * After each sweep of the matmuls, a plain read of the same bytes (the weights, scales and
 * biases of every matrix, in the same order, 128-bit loads) on 1 thread and on as many
 * threads as the setting has (the pool's threads, each a share of each matrix): the floor
 * for a step's weights on this machine. Every setting (threads, claim divisor, spin window:
 * qmm.h) is interleaved round by round, best of `rounds`, so a load change hits them all.
 * Prints per shape us per call and GB/s, and per setting the step's matmul time, its CPU
 * time (all threads: spinning included) and the floor.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qmm.h"

enum { NUM_SHAPES = 5, MAX_SETTINGS = 16 };
static const struct {
    const char *name;
    int K, N, bits, count;
} SHAPES[NUM_SHAPES] = {{"qkv", 576, 960, 4, 30},
                        {"o", 576, 576, 4, 30},
                        {"gate_up", 576, 3072, 4, 30},
                        {"down", 1536, 576, 4, 30},
                        {"lm_head", 576, 49152, 8, 1}};

static double seconds(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)state;
}

static void *fill(size_t n) {
    uint8_t *p = aligned_alloc(64, (n + 63) / 64 * 64);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)next();
    return p;
}

/* The plain read: [p, p + n) once (up to a 64-byte tail), 64 bytes a step as four 16-byte
 * vectors summed (GCC/clang vector extensions: SSE2 or NEON loads without -m flags), so the
 * loop is bound by memory, not by arithmetic, prefetching 2 KB ahead (without, this
 * machine's plain read got 6 GB/s where the prefetching kernel got 10-15). */
typedef uint64_t u64x2 __attribute__((vector_size(16), aligned(1)));

static uint64_t read_bytes(const void *p, size_t n) {
    const u64x2 *v = p;
    u64x2 a = {0}, b = {0}, c = {0}, d = {0};
    for (size_t i = 0; i + 4 <= n / 16; i += 4) {
        __builtin_prefetch((const char *)(v + i) + 2048);
        a += v[i], b += v[i + 1], c += v[i + 2], d += v[i + 3];
    }
    a += b + c + d;
    return a[0] + a[1];
}

typedef struct {
    const qmm_problem *probs;
    int count, part, parts;
    uint64_t sum;
} read_task;

static size_t weight_bytes(const qmm_problem *p) { return (size_t)(p->N * p->K * p->bits / 8); }
static size_t param_bytes(const qmm_problem *p) {
    return (size_t)(p->N * (p->K / p->group_size) * 2);
}

static void read_part(void *ctx, int64_t part) {
    read_task *t = ctx;
    uint64_t sum = 0;
    for (int i = 0; i < t->count; i++) {
        const qmm_problem *p = t->probs + i;
        const size_t w = weight_bytes(p) / t->parts, s = param_bytes(p) / t->parts;
        sum += read_bytes((const uint8_t *)p->w + part * w, w);
        sum += read_bytes((const uint8_t *)p->scales + part * s, s);
        sum += read_bytes((const uint8_t *)p->biases + part * s, s);
    }
    __atomic_add_fetch(&t->sum, sum, __ATOMIC_RELAXED);
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 10;
    int settings = 0, threads[MAX_SETTINGS], div[MAX_SETTINGS], spin[MAX_SETTINGS];
    for (int i = 2; i < argc && settings < MAX_SETTINGS; i++)
        if (sscanf(argv[i], "%d,%d,%d", &threads[settings], &div[settings], &spin[settings]) == 3)
            settings++;
    if (!settings) { /* 1 and 2 threads with the pool's defaults */
        for (int t = 0; t < 2; t++) {
            threads[t] = t + 1;
            div[t] = (int)mlxserve_qmm_set_claim_div(-1);
            spin[t] = (int)(mlxserve_qmm_set_spin_ns(-1) / 1000);
        }
        settings = 2;
    }
    float *x = malloc(sizeof(float) * 1536), *y = malloc(sizeof(float) * 49152);
    for (int i = 0; i < 1536; i++) x[i] = (float)(next() % 2001) / 1000.0f - 1.0f;
    qmm_problem *probs[NUM_SHAPES];
    double total_bytes = 0, shape_bytes[NUM_SHAPES];
    for (int s = 0; s < NUM_SHAPES; s++) {
        probs[s] = calloc(SHAPES[s].count, sizeof(qmm_problem));
        shape_bytes[s] = 0;
        for (int c = 0; c < SHAPES[s].count; c++) {
            qmm_problem *p = probs[s] + c;
            *p = (qmm_problem){x, NULL, NULL, NULL, y, 1, SHAPES[s].N, SHAPES[s].K, 32,
                               SHAPES[s].bits, QMM_F16, 8};
            p->w = fill(weight_bytes(p));
            uint16_t *sc = fill(param_bytes(p)), *bi = fill(param_bytes(p));
            for (size_t i = 0; i < param_bytes(p) / 2; i++) { /* finite halves, ~1e-2 */
                sc[i] = 0x2000 | (sc[i] & 0x03FF);
                bi[i] = 0xA000 | (bi[i] & 0x03FF);
            }
            p->scales = sc, p->biases = bi;
            shape_bytes[s] += weight_bytes(p) + 2.0 * param_bytes(p);
        }
        total_bytes += shape_bytes[s];
    }
    printf("int8 %s; %.1f MB of weights, scales and biases per step; best of %d rounds\n",
           mlxserve_q8_isa_name(mlxserve_q8_isa()), total_bytes / 1e6, rounds);
    double best[MAX_SETTINGS][NUM_SHAPES], best_cpu[MAX_SETTINGS], best_read[MAX_SETTINGS][2];
    for (int k = 0; k < settings; k++) {
        for (int s = 0; s < NUM_SHAPES; s++) best[k][s] = 1e9;
        best_cpu[k] = best_read[k][0] = best_read[k][1] = 1e9;
    }
    static volatile uint64_t sink; /* keeps the reads */
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < settings; k++) {
            mlxserve_qmm_set_threads(threads[k]);
            mlxserve_qmm_set_claim_div(div[k]);
            mlxserve_qmm_set_spin_ns((long)spin[k] * 1000);
            double cpu = 0;
            for (int s = 0; s < NUM_SHAPES; s++) {
                const double t = seconds(CLOCK_MONOTONIC), c = seconds(CLOCK_PROCESS_CPUTIME_ID);
                for (int i = 0; i < SHAPES[s].count; i++) mlxserve_qmm(probs[s] + i);
                const double dt = seconds(CLOCK_MONOTONIC) - t;
                cpu += seconds(CLOCK_PROCESS_CPUTIME_ID) - c;
                if (dt < best[k][s]) best[k][s] = dt;
            }
            if (cpu < best_cpu[k]) best_cpu[k] = cpu;
            for (int n = 0; n < 2; n++) { /* the floor: 1 thread, then the setting's threads */
                const int parts = n ? threads[k] : 1;
                const double t = seconds(CLOCK_MONOTONIC);
                for (int s = 0; s < NUM_SHAPES; s++) {
                    read_task task = {probs[s], SHAPES[s].count, 0, parts, 0};
                    mlxserve_qmm_parallel_for(parts, read_part, &task);
                    sink = sink + task.sum;
                }
                const double dt = seconds(CLOCK_MONOTONIC) - t;
                if (dt < best_read[k][n]) best_read[k][n] = dt;
            }
        }
    for (int k = 0; k < settings; k++) {
        printf("%d threads, claim-div %d, spin %d us:\n", threads[k], div[k], spin[k]);
        double step = 0;
        for (int s = 0; s < NUM_SHAPES; s++) {
            step += best[k][s];
            printf("  %-8s %5dx%-6d %d-bit %8.1f us/call %6.1f GB/s\n", SHAPES[s].name,
                   SHAPES[s].K, SHAPES[s].N, SHAPES[s].bits, best[k][s] / SHAPES[s].count * 1e6,
                   shape_bytes[s] / best[k][s] / 1e9);
        }
        printf("  step %.2f ms (%.1f GB/s, CPU %.2f ms); plain read 1 thread %.2f ms (%.1f GB/s), "
               "%d threads %.2f ms (%.1f GB/s)\n",
               step * 1e3, total_bytes / step / 1e9, best_cpu[k] * 1e3, best_read[k][0] * 1e3,
               total_bytes / best_read[k][0] / 1e9, threads[k], best_read[k][1] * 1e3,
               total_bytes / best_read[k][1] / 1e9);
    }
    return 0;
}
