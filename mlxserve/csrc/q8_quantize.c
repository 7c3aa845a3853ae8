/* The activations' rounding to int8 (qmm.h: mlxserve_q8_quantize), in plain C and with
 * AVX2, the same float32 operations either way: compiled with -ffp-contract=off. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qmm.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* rint(v) for |v| < 2^22 in float32 arithmetic (the sum rounds to an integer, ties to
 * even); qmm.c is compiled with -ffp-contract=off, so x * id is rounded before. */
#define Q8_RINT(v) (((v) + 12582912.0f) - 12582912.0f)

/* One block of 32 values: q (perm4: the 4-bit kernels' order), d and dsum. */
static void q8_block(const float *xb, int perm4, int8_t *qb, float *d, float *dsum) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(xb[i]);
        amax = a > amax || a != a ? a : amax; /* NaN wins */
    }
    const float dm = amax / 127.0f;
    int32_t v[32], sum = 0;
    if (amax == 0.0f || !isfinite(amax)) {
        memset(v, 0, sizeof(v));
    } else {
        const float id = 127.0f / amax;
        for (int i = 0; i < 32; i++) {
            const float r = Q8_RINT(xb[i] * id);
            v[i] = (int32_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
    }
    for (int i = 0; i < 32; i++) {
        sum += v[i];
        qb[perm4 ? (i & 1) * 16 + i / 2 : i] = (int8_t)v[i]; /* value i's place */
    }
    *d = dm;
    *dsum = dm * (float)sum;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The same rounding with AVX2, the same float32 operations lane by lane (this file is
 * compiled with -ffp-contract=off); blocks with a zero or non-finite value take q8_block. */
__attribute__((target("avx2"))) static void q8_quantize_avx2(const float *x, int64_t n_blocks,
                                                              int perm4, int8_t *q, float *d,
                                                              float *dsum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 magic = _mm256_set1_ps(12582912.0f), hi = _mm256_set1_ps(127.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    /* Within each 16-byte lane: its even bytes, then its odd ones. */
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13,
                                                15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11,
                                                13, 15);
    for (int64_t b = 0; b < n_blocks; b++) {
        const float *xb = x + b * 32;
        __m256 v[4], mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs_mask));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (_mm256_movemask_ps(nan) || amax == 0.0f || !isfinite(amax)) {
            q8_block(xb, perm4, q + b * 32, d + b, dsum + b);
            continue;
        }
        const __m256 id = _mm256_set1_ps(127.0f / amax);
        __m256i r[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[i], id), magic), magic);
            r[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(t, hi), lo));
            sum = _mm256_add_epi32(sum, r[i]);
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                             _mm256_packs_epi32(r[2], r[3]));
        __m256i bytes = _mm256_permutevar8x32_epi32(p, order); /* values 0 .. 31 in order */
        if (perm4) /* even values of the block, then odd ones */
            bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, evens_odds), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + b * 32), bytes);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        const float dm = amax / 127.0f;
        d[b] = dm;
        dsum[b] = dm * (float)_mm_cvtsi128_si32(s4);
    }
}
#endif

void mlxserve_q8_quantize(const float *x, int64_t M, int64_t K, int perm4, int8_t *q, float *d,
                          float *dsum) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (mlxserve_q8_isa() != Q8_SCALAR) { /* every x86 integer path implies AVX2 */
        q8_quantize_avx2(x, M * (K / 32), perm4, q, d, dsum);
        return;
    }
#endif
    for (int64_t b = 0; b < M * (K / 32); b++)
        q8_block(x + b * 32, perm4, q + b * 32, d + b, dsum + b);
}
