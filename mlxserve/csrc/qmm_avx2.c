/* qmm_impl.h with AVX2 + FMA vectors (8 floats); compiled with -mavx2 -mfma -mf16c. */
#include "qmm.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vset1(float f) { return _mm256_set1_ps(f); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline vf u8x8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }

/* Per 8 bytes: their low nibbles (even values), then their high nibbles (odd values). */
static inline void deq4(const uint8_t *p, vf *q) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    q[0] = u8x8(lo);
    q[1] = u8x8(hi);
    q[2] = u8x8(_mm_srli_si128(lo, 8));
    q[3] = u8x8(_mm_srli_si128(hi, 8));
}

static inline void deq8(const uint8_t *p, vf *q) {
    for (int i = 0; i < 4; i++) q[i] = u8x8(_mm_loadl_epi64((const __m128i *)(p + 8 * i)));
}

#define cvt_f16 cvt_f16_f16c
#define QMM_ENTRY mlxserve_qmm_avx2
#define MV_ROWS 4
#define MR 6
#include "qmm_impl.h"
const int mlxserve_qmm_built_avx2 = 1;

#else /* not this architecture, or the compiler lacks the flags: never called */
const int mlxserve_qmm_built_avx2 = 0;
void mlxserve_qmm_avx2(const qmm_problem *p) { (void)p; }
#endif
