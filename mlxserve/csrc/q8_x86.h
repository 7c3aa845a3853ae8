/* q8_impl.h's vocabulary on x86 with 256-bit vectors: one block of 32 weights is one
 * register. The includer defines Q8_DPBUSD(acc, u8, s8) (vpdpbusd: AVX-512 VNNI or
 * AVX-VNNI) or leaves it undefined for AVX2 (vpmaddubsw + vpmaddwd), and Q8_ENTRY. */
#include <immintrin.h>

#include "qmm.h"

#define cvt_f16 cvt_f16_f16c

typedef __m256 q8f;
typedef __m256i q8i;
#ifdef Q8_DPBUSD
typedef __m256i q8w;
#else
typedef struct {
    __m256i lo, hi; /* low nibbles; high nibbles (8-bit weights only) */
} q8w;
#endif

static inline q8f q8_fzero(void) { return _mm256_setzero_ps(); }
static inline q8f q8_fadd(q8f a, q8f b) { return _mm256_add_ps(a, b); }
static inline float q8_fsum(q8f v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline q8f q8_acc(q8i i, float ds, q8f acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(ds), acc);
}

/* 16 packed bytes in both halves; the upper half shifted by 4: low nibbles, high nibbles. */
static inline __m256i q8_nibbles(const uint8_t *p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i shifted = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(shifted, _mm256_set1_epi8(15));
}

static inline __m256i q8_load(const int8_t *q) { return _mm256_loadu_si256((const __m256i *)q); }

#ifdef Q8_DPBUSD
static inline q8w q8_w4(const uint8_t *p) { return q8_nibbles(p); }
static inline q8w q8_w8(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline q8i q8_dot4(q8w w, const int8_t *q) {
    return Q8_DPBUSD(_mm256_setzero_si256(), w, q8_load(q));
}
static inline q8i q8_dot8(q8w w, const int8_t *q) { return q8_dot4(w, q); }
#else
static inline q8w q8_w4(const uint8_t *p) {
    const q8w w = {q8_nibbles(p), _mm256_setzero_si256()};
    return w;
}
static inline q8w q8_w8(const uint8_t *p) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p), mask = _mm256_set1_epi8(15);
    const q8w w = {_mm256_and_si256(b, mask), _mm256_and_si256(_mm256_srli_epi16(b, 4), mask)};
    return w;
}
/* Pairs of u8 * s8 into int16 (at most 2 * 15 * 127: no saturation), then into int32. */
static inline q8i q8_dot4(q8w w, const int8_t *q) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.lo, q8_load(q)), _mm256_set1_epi16(1));
}
static inline q8i q8_dot8(q8w w, const int8_t *q) {
    const __m256i x = q8_load(q);
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(w.lo, x), _mm256_set1_epi16(1));
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(w.hi, x), _mm256_set1_epi16(16));
    return _mm256_add_epi32(lo, hi);
}
#endif

#include "q8_impl.h"
