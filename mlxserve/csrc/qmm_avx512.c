/* qmm_impl.h with AVX-512F vectors (16 floats); compiled with -mavx512f -mfma -mf16c. */
#include "qmm.h"

#if defined(__x86_64__) && defined(__AVX512F__)
#include <immintrin.h>

#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vset1(float f) { return _mm512_set1_ps(f); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }

/* 16 bytes -> 16 dwords; low nibbles are the even values, high nibbles the odd ones. */
static inline void deq4(const uint8_t *p, vf *q) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}

static inline void deq8(const uint8_t *p, vf *q) {
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
}

static void cvt_f16(const uint16_t *s, int64_t n, float *d) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
    for (; i < n; i++) d[i] = _cvtsh_ss(s[i]);
}

#define QMM_ENTRY mlxserve_qmm_avx512
#define MV_ROWS 8
#define MR 12
#include "qmm_impl.h"
const int mlxserve_qmm_built_avx512 = 1;

#else /* not this architecture, or the compiler lacks the flags: never called */
const int mlxserve_qmm_built_avx512 = 0;
void mlxserve_qmm_avx512(const qmm_problem *p) { (void)p; }
#endif
