/* q8_impl.h with Arm NEON's sdot (Armv8.2 dot product: Apple M1 and later, Graviton 2+,
 * Cortex-A76+); compiled with -march=armv8.2-a+dotprod, chosen only when the CPU has it. */
#include "qmm.h"

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>

#define cvt_f16 cvt_f16_neon
#define Q8_VC 4
#define Q8_RM 4
#define Q8_RN 2
#define q8_pack q8_pack_generic
#define q8_params q8_params_generic

static inline void q8_tile(const uint8_t *pw, int nv, const int8_t *q, int64_t K, const float *d,
                           int64_t nb, const float *sc, const float *bi, const float *xs,
                           int64_t g, int subs, float *f, const int rm,
                           const int rn, const int kind);
static inline void q8_tile_raw(const uint8_t *raw, int64_t row_bytes, const uint8_t *next,
                               int64_t ahead, const int8_t *q, int64_t K,
                               const float *d, int64_t nb, const float *sc, const float *bi,
                               const float *xs, int64_t g, int subs, float *f, const int rn,
                               const int kind);
#define Q8_RAW 1 /* q8_tile_raw: one row of 4- or 8-bit weights without packing */

#define Q8_ENTRY mlxserve_q8_neon
#include "q8_impl.h"

/* y = f + e for rm rows and rn vectors of 4 columns into f (q8_impl.h's formula). sdot multiplies
 * signed bytes: values below 16 are valid as they are; bytes are split into nibbles
 * (w = lo + 16 hi), both valid. */
static inline __attribute__((always_inline)) void q8_tile(const uint8_t *pw, int nv,
                                                          const int8_t *q, int64_t K,
                                                          const float *d, int64_t nb,
                                                          const float *sc, const float *bi,
                                                          const float *xs, int64_t g, int subs,
                                                          float *f,
                                                          const int rm, const int rn,
                                                          const int kind) {
    const int64_t tstride = (int64_t)nv * 16;
    const uint8x16_t low = vdupq_n_u8(15);
    float32x4_t acc[Q8_RM][Q8_RN];
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < rn; c++) acc[m][c] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = pw + b * 8 * tstride;
        const int8_t *qb = q + b * 32;
        int32x4_t lo[Q8_RM][Q8_RN], hi[Q8_RM][Q8_RN];
        for (int m = 0; m < rm; m++)
            for (int c = 0; c < rn; c++) lo[m][c] = hi[m][c] = vdupq_n_s32(0);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            int8x16_t wl[Q8_RN], wh[Q8_RN];
            for (int c = 0; c < rn; c++) {
                const uint8x16_t w = vld1q_u8(wb + t * tstride + c * 16);
                if (kind == Q8_SMALL) {
                    wl[c] = vreinterpretq_s8_u8(w);
                } else {
                    wl[c] = vreinterpretq_s8_u8(vandq_u8(w, low));
                    wh[c] = vreinterpretq_s8_u8(vshrq_n_u8(w, 4));
                }
            }
            for (int m = 0; m < rm; m++) {
                int32_t x4;
                memcpy(&x4, qb + m * K + 4 * t, 4);
                const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
                for (int c = 0; c < rn; c++) {
                    lo[m][c] = vdotq_s32(lo[m][c], wl[c], x);
                    if (kind == Q8_BYTE) hi[m][c] = vdotq_s32(hi[m][c], wh[c], x);
                }
            }
        }
        const float *s = sc + (b / subs) * Q8_PANEL;
        for (int m = 0; m < rm; m++) {
            const float32x4_t dm = vdupq_n_f32(d[m * nb + b]);
            for (int c = 0; c < rn; c++) {
                const int32x4_t dot =
                    kind == Q8_BYTE ? vaddq_s32(lo[m][c], vshlq_n_s32(hi[m][c], 4)) : lo[m][c];
                const float32x4_t ds = vmulq_f32(dm, vld1q_f32(s + c * 4));
                acc[m][c] = vaddq_f32(acc[m][c], vmulq_f32(vcvtq_f32_s32(dot), ds));
            }
        }
    }
    float32x4_t e[Q8_RM][Q8_RN];
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < rn; c++) e[m][c] = vdupq_n_f32(0.0f);
    for (int64_t gi = 0; gi < g; gi++)
        for (int c = 0; c < rn; c++) {
            const float32x4_t bv = vld1q_f32(bi + gi * Q8_PANEL + c * 4);
            for (int m = 0; m < rm; m++)
                e[m][c] = vaddq_f32(e[m][c], vmulq_f32(bv, vdupq_n_f32(xs[m * g + gi])));
        }
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < rn; c++) vst1q_f32(f + m * Q8_PANEL + c * 4, vaddq_f32(acc[m][c], e[m][c]));
}

/* One row by rn vectors of 4 whole columns of 4-bit (Q8_SMALL) or 8-bit (Q8_BYTE) weights read
 * where they are (raw: the first column's row, row_bytes apart): each column's block meets
 * the block of q in place (sdot sums 4 products per lane) and a pairwise-add tree turns 4
 * columns' lanes into one vector of their dot products, exact integers as in q8_tile; the
 * float32 operations after them are q8_tile's. 4-bit: the low nibbles of a block's 16 bytes
 * are its even values, the high ones its odd values (the order of the rounding's perm4).
 * 8-bit: sdot is signed, so w - 128 (the top bit flipped) meets q and 128 * sum(q) is added
 * back. The `ahead` bytes at `next` are prefetched meanwhile, a share per block. */
static inline __attribute__((always_inline)) void q8_tile_raw(
    const uint8_t *raw, int64_t row_bytes, const uint8_t *next, int64_t ahead, const int8_t *q,
    int64_t K, const float *d, int64_t nb, const float *sc, const float *bi, const float *xs,
    int64_t g, int subs, float *f, const int rn, const int kind) {
    (void)K;
    const int64_t lines_per_block = (ahead + 64 * nb - 1) / (64 * nb);
    const uint8x16_t low = vdupq_n_u8(15), top = vdupq_n_u8(128);
    float32x4_t acc[Q8_RN];
    for (int c = 0; c < rn; c++) acc[c] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t at = b * lines_per_block * 64, i = 0; i < lines_per_block && at < ahead;
             i++, at += 64)
            __builtin_prefetch(next + at);
        const int8x16_t x0 = vld1q_s8(q + b * 32), x1 = vld1q_s8(q + b * 32 + 16);
        const int32_t shift = kind == Q8_BYTE ? 128 * (vaddlvq_s8(x0) + vaddlvq_s8(x1)) : 0;
        const float *s = sc + (b / subs) * Q8_PANEL;
        const float32x4_t dm = vdupq_n_f32(d[b]);
        for (int c = 0; c < rn; c++) {
            int32x4_t lanes[4];
            for (int j = 0; j < 4; j++) {
                const uint8_t *w = raw + (c * 4 + j) * row_bytes;
                if (kind == Q8_SMALL) {
                    const uint8x16_t v = vld1q_u8(w + b * 16);
                    const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, low));
                    const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
                    lanes[j] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, x0), hi, x1);
                } else {
                    const uint8x16_t v0 = vld1q_u8(w + b * 32), v1 = vld1q_u8(w + b * 32 + 16);
                    const int8x16_t s0 = vreinterpretq_s8_u8(veorq_u8(v0, top));
                    const int8x16_t s1 = vreinterpretq_s8_u8(veorq_u8(v1, top));
                    lanes[j] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), s0, x0), s1, x1);
                }
            }
            const int32x4_t dot = vaddq_s32(vpaddq_s32(vpaddq_s32(lanes[0], lanes[1]),
                                                       vpaddq_s32(lanes[2], lanes[3])),
                                            vdupq_n_s32(shift));
            const float32x4_t ds = vmulq_f32(dm, vld1q_f32(s + c * 4));
            acc[c] = vaddq_f32(acc[c], vmulq_f32(vcvtq_f32_s32(dot), ds));
        }
    }
    for (int c = 0; c < rn; c++) {
        float32x4_t e = vdupq_n_f32(0.0f);
        for (int64_t gi = 0; gi < g; gi++)
            e = vaddq_f32(e, vmulq_f32(vld1q_f32(bi + gi * Q8_PANEL + c * 4), vdupq_n_f32(xs[gi])));
        vst1q_f32(f + c * 4, vaddq_f32(acc[c], e));
    }
}

const int mlxserve_q8_built_neon = 1;

#else /* not this architecture, or the compiler lacks the flags: never called */
const int mlxserve_q8_built_neon = 0;
void mlxserve_q8_neon(const q8_problem *q) { (void)q; }
#endif
