/* Helpers shared by the float (qmm_impl.h) and int8-activation (q8_impl.h) algorithms of
 * one instruction-set file; the includer defines cvt_f16(s, n, d) (n float16 -> float32) as
 * one of the conversions below first. Everything is static: each qmm_<isa>.c / q8_<isa>.c
 * gets its own copy.
 */
#ifndef MLXSERVE_QMM_COMMON_H
#define MLXSERVE_QMM_COMMON_H

#include <stdlib.h>
#include <string.h>

#include "qmm.h"

/* float16 -> float32: portable (IEEE half, subnormals and infinities included), F16C, NEON. */
static inline void cvt_f16_portable(const uint16_t *s, int64_t n, float *d) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t h = s[i], sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
        uint32_t u;
        if (exp == 31) {
            u = sign | 0x7F800000u | (man << 13);
        } else if (exp != 0) {
            u = sign | ((exp + 112) << 23) | (man << 13);
        } else if (man == 0) {
            u = sign;
        } else { /* subnormal: value = man * 2^-24 */
            float f = (float)man * 5.9604644775390625e-8f;
            memcpy(&u, &f, 4);
            u |= sign;
        }
        memcpy(d + i, &u, 4);
    }
}

#if defined(__x86_64__) && defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>

static inline void cvt_f16_f16c(const uint16_t *s, int64_t n, float *d) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) d[i] = _cvtsh_ss(s[i]);
}

#endif

#if defined(__aarch64__)
#include <arm_neon.h>

static inline void cvt_f16_neon(const uint16_t *s, int64_t n, float *d) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(d + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s + i))));
    for (; i < n; i++) {
        __fp16 h;
        __builtin_memcpy(&h, s + i, 2);
        d[i] = (float)h;
    }
}

#endif

/* 32 values of 2, 3, 5 or 6 bits (a little-endian bit stream: 8 values in every `bits`
 * bytes) -> 32 bytes, in order. */
static inline void unpack_bits(const uint8_t *p, int bits, uint8_t *out) {
    const uint64_t mask = (1u << bits) - 1;
    for (int g = 0; g < 4; g++) {
        uint64_t v = 0;
        memcpy(&v, p + g * bits, (size_t)bits); /* little-endian hosts only (x86, arm64) */
        for (int j = 0; j < 8; j++) out[g * 8 + j] = (uint8_t)((v >> (j * bits)) & mask);
    }
}

/* `count` scales or biases from element `first` on, as float32: the weights' own array
 * when it is float32, else converted into buf. */
static const float *params_f32(const qmm_problem *p, const void *src, int64_t first,
                               int64_t count, float *buf) {
    if (p->scale_type == QMM_F32) return (const float *)src + first;
    const uint16_t *s = (const uint16_t *)src + first;
    if (p->scale_type == QMM_F16) {
        cvt_f16(s, count, buf);
    } else { /* bfloat16: the high half of a float32 */
        for (int64_t i = 0; i < count; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            memcpy(buf + i, &u, 4);
        }
    }
    return buf;
}

/* Thread-local scratch that only grows. */
static float *scratch(float **buf, size_t *cap, size_t n) {
    if (n > *cap) {
        free(*buf);
        *buf = (float *)aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}
static __thread float *tls_a, *tls_b, *tls_c;
static __thread size_t tls_a_cap, tls_b_cap, tls_c_cap;

#endif
