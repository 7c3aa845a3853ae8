/* SwiGLU's elementwise part, act = (g * sigmoid(g)) * up, bit for bit as MLX's CPU ops
 * compute it (models/compiled.swiglu; qmm.h: mlxserve_swiglu), vectorized and spread over
 * the kernels' thread pool. A prompt's MLP runs it on rows x 1536 values per layer: done
 * one value at a time with a libm fmaf call per polynomial step it cost as much as the
 * layer's attention.
 *
 * MLX's sigmoid (mlx/backend/cpu/unary_ops.h, simd/math.h with one lane) is
 *   y = 1 / (1 + exp(|x|)); x < 0 ? y : 1 - y
 * where exp(x) = 2^i * p(f): t = x * 1.442695f, i = floor(t + 0.5) (the + 0.5 in double:
 * exact), f = t - i, p a degree-6 polynomial by fused multiply-adds, 2^i by shifting
 * i + 127 into the exponent; NaN gives x, x > 88 infinity, x < -88 zero. The vector path
 * does each of these operations lane by lane: a fused multiply-add is exact-then-rounded
 * on every CPU (libm's fmaf too), floor(t + 0.5) is t rounded to nearest plus one where
 * that rounding went down from a tie (t - rint(t) == 0.5, exact), so every path gives the
 * same bits (tests/test_cpu_layer.py). Compiled with -ffp-contract=off: nothing else fused. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qmm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SWIGLU_X86 1
#endif

static const float EXP_C[7] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                               9.618437357674640e-3f, 5.550332471162809e-2f,
                               2.402264791363012e-1f, 6.931472028550421e-1f, 1.000000000000000f};

static inline float exp_mlx(float x_init) {
    const float t = x_init * 1.442695f;
    const float ipart = (float)floor((double)t + 0.5);
    const float fpart = t - ipart;
    float p = EXP_C[0];
    for (int i = 1; i < 7; i++) p = fmaf(p, fpart, EXP_C[i]);
    /* (int)ipart for the lanes kept below (|x| <= 88); unsigned shift: no overflow. */
    const int32_t ip = isfinite(ipart) && fabsf(ipart) < 1e9f ? (int32_t)ipart : 0;
    const uint32_t bits = (uint32_t)(ip + 127) << 23;
    float two_i;
    memcpy(&two_i, &bits, sizeof two_i);
    float r = isnan(x_init) ? x_init : two_i * p;
    r = x_init > 88.0f ? INFINITY : r;
    return x_init < -88.0f ? 0.0f : r;
}

static inline float swiglu_one(float g, float up) {
    const float y = 1.0f / (1.0f + exp_mlx(fabsf(g)));
    const float sig = g < 0.0f ? y : 1.0f - y;
    return (g * sig) * up;
}

#ifdef SWIGLU_X86
/* Eight lanes of swiglu_one (the same operations, see the top). */
__attribute__((target("avx2,fma"))) static inline __m256 swiglu8(__m256 g, __m256 up) {
    const __m256 x_init = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g); /* |g| */
    const __m256 t = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
    const __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 tie = _mm256_cmp_ps(_mm256_sub_ps(t, r), _mm256_set1_ps(0.5f), _CMP_EQ_OQ);
    const __m256 ipart = _mm256_add_ps(r, _mm256_and_ps(tie, _mm256_set1_ps(1.0f)));
    const __m256 fpart = _mm256_sub_ps(t, ipart);
    __m256 p = _mm256_set1_ps(EXP_C[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(EXP_C[i]));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
    __m256 ex = _mm256_mul_ps(_mm256_castsi256_ps(e), p);
    ex = _mm256_blendv_ps(ex, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
    ex = _mm256_blendv_ps(ex, _mm256_set1_ps(INFINITY),
                          _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    /* x_init = |g| >= 0 (or NaN): never below -88. */
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, ex));
    const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sig = _mm256_blendv_ps(_mm256_sub_ps(one, y), y, neg);
    return _mm256_mul_ps(_mm256_mul_ps(g, sig), up);
}

__attribute__((target("avx2,fma"))) static void swiglu_avx2(const float *g, const float *up,
                                                             float *act, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(act + i, swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(up + i)));
    for (; i < n; i++) act[i] = swiglu_one(g[i], up[i]);
}

static int has_avx2_fma(void) {
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return has;
}
#endif

typedef struct {
    const float *gu;
    float *act;
    int64_t rows, hidden, rows_per_item;
    int vector;
} swiglu_ctx;

static void swiglu_rows(void *vctx, int64_t item) {
    const swiglu_ctx *c = (const swiglu_ctx *)vctx;
    const int64_t h = c->hidden, r0 = item * c->rows_per_item;
    const int64_t r1 = r0 + c->rows_per_item < c->rows ? r0 + c->rows_per_item : c->rows;
    for (int64_t r = r0; r < r1; r++) {
        const float *g = c->gu + r * 2 * h;
        float *act = c->act + r * h;
#ifdef SWIGLU_X86
        if (c->vector) {
            swiglu_avx2(g, g + h, act, h);
            continue;
        }
#endif
        for (int64_t i = 0; i < h; i++) act[i] = swiglu_one(g[i], g[h + i]);
    }
}

void mlxserve_swiglu(const float *gu, int64_t rows, int64_t hidden, float *act) {
    swiglu_ctx c = {gu, act, rows, hidden, 1, 0};
#ifdef SWIGLU_X86
    c.vector = has_avx2_fma() && mlxserve_qmm_isa() != QMM_SCALAR; /* scalar: forced off */
#endif
    /* Items of ~16k values (a few microseconds): one row alone stays on the caller. */
    c.rows_per_item = hidden > 0 ? (16384 + hidden - 1) / hidden : 1;
    const int64_t items = (rows + c.rows_per_item - 1) / c.rows_per_item;
    mlxserve_qmm_parallel_for(items, swiglu_rows, &c);
}
