/* The int8 matmul's instruction sets against its portable C path, bit for bit, without
 * MLX or Python: for a CPU where the Python tests cannot run (an Arm board, or qemu).
 *
 *   S=mlxserve/csrc; aarch64-linux-gnu-gcc -O2 -std=gnu11 -ffp-contract=off -I$S \
 *     -march=armv8.2-a+dotprod bench/q8_cross_check.c $S/qmm.c $S/qmm_*.c $S/q8_*.c \
 *     -lm -lpthread -static -o /tmp/q8check && qemu-aarch64 -cpu max /tmp/q8check
 *
 * (the same line with gcc and -mavx2 -mfma -mf16c -mavxvnni -mavx512f -mavx512vl
 * -mavx512vnni checks the x86 paths the CPU has). Random problems over bits 2-8, group
 * sizes 32-128, float32 and float16 scales, 1-129 rows and column tails; each row is
 * also computed alone and must give the same bits. Prints one line per instruction set
 * and exits 1 on any difference.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qmm.h"

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)state;
}
static float uniform(void) { return (float)(next() >> 8) / 16777216.0f * 2.0f - 1.0f; }

static int run(qmm_problem *p, int isa, float *y) {
    p->y = y;
    if (mlxserve_q8_force_isa(isa) != 0) return -1;
    return mlxserve_qmm(p);
}

int main(void) {
    static const int bits_list[] = {2, 3, 4, 5, 6, 8}, rows[] = {1, 3, 9, 33, 64, 129};
    int failures = 0;
    for (int isa = 1; isa < Q8_NUM_ISAS; isa++) {
        if (!mlxserve_q8_isa_supported(isa)) {
            printf("%-10s not on this CPU\n", mlxserve_q8_isa_name(isa));
            continue;
        }
        int checked = 0, bad = 0;
        for (int trial = 0; trial < 72; trial++) {
            const int bits = bits_list[trial % 6], group = 32 << (trial / 6 % 3);
            const int64_t M = rows[(trial + trial / 6) % 6];
            const int64_t K = group * (1 + next() % 5), N = 1 + next() % 70;
            const int f16 = trial % 2;
            float *x = malloc(sizeof(float) * M * K), *s = malloc(sizeof(float) * N * K / group);
            float *b = malloc(sizeof(float) * N * K / group);
            uint16_t *s16 = malloc(2 * N * K / group), *b16 = malloc(2 * N * K / group);
            uint32_t *w = malloc(N * K * bits / 8);
            float *y0 = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * M * N);
            float *y2 = malloc(sizeof(float) * N);
            for (int64_t i = 0; i < M * K; i++) x[i] = uniform() * (1 + (float)(i / K % 7));
            for (int64_t i = 0; i < N * K * bits / 32; i++) w[i] = next();
            for (int64_t i = 0; i < N * K / group; i++) {
                s[i] = uniform() * 0.1f;
                b[i] = uniform();
                s16[i] = 0x2000 | (next() & 0x0FFF); /* small positive halves */
                b16[i] = 0x3000 | (next() & 0x8FFF);
            }
            qmm_problem p = {x, w, f16 ? (void *)s16 : s, f16 ? (void *)b16 : b, NULL, M, N, K,
                             group, bits, f16 ? QMM_F16 : QMM_F32, 8};
            if (run(&p, Q8_SCALAR, y0) || run(&p, isa, y1)) return 2;
            int same = memcmp(y0, y1, sizeof(float) * M * N) == 0;
            for (int64_t m = 0; m < M && same; m += 1 + M / 5) {
                qmm_problem one = p;
                one.x = x + m * K;
                one.M = 1;
                if (run(&one, isa, y2)) return 2;
                same = memcmp(y2, y1 + m * N, sizeof(float) * N) == 0;
            }
            checked++;
            if (!same) {
                bad++;
                printf("  differs: bits %d group %d M %ld K %ld N %ld %s\n", bits, group, (long)M,
                       (long)K, (long)N, f16 ? "f16" : "f32");
            }
            free(x), free(s), free(b), free(s16), free(b16), free(w), free(y0), free(y1), free(y2);
        }
        printf("%-10s %d problems, %d differ from scalar\n", mlxserve_q8_isa_name(isa), checked, bad);
        failures += bad;
    }
    return failures ? 1 : 0;
}
