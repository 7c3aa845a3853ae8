/* q8_impl.h with Arm NEON's sdot (Armv8.2 dot product: Apple M1 and later, Graviton 2+,
 * Cortex-A76+); compiled with -march=armv8.2-a+dotprod, chosen only when the CPU has it. */
#include "qmm.h"

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>

#define cvt_f16 cvt_f16_neon

typedef float32x4_t q8f;
typedef int32x4_t q8i;
typedef struct {
    uint8x16_t a, b; /* values 0-15 and 16-31 of the block in kernel order */
} q8w;

static inline q8f q8_fzero(void) { return vdupq_n_f32(0.0f); }
static inline q8f q8_fadd(q8f a, q8f b) { return vaddq_f32(a, b); }
static inline float q8_fsum(q8f v) { return vaddvq_f32(v); }
static inline q8f q8_acc(q8i i, float ds, q8f acc) { return vfmaq_n_f32(acc, vcvtq_f32_s32(i), ds); }

static inline q8w q8_w4(const uint8_t *p) {
    const uint8x16_t b = vld1q_u8(p);
    const q8w w = {vandq_u8(b, vdupq_n_u8(15)), vshrq_n_u8(b, 4)};
    return w;
}
static inline q8w q8_w8(const uint8_t *p) {
    const q8w w = {vld1q_u8(p), vld1q_u8(p + 16)};
    return w;
}
/* 4-bit weights are < 16: valid signed bytes as they are. */
static inline q8i q8_dot4(q8w w, const int8_t *q) {
    const int32x4_t t = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(w.a), vld1q_s8(q));
    return vdotq_s32(t, vreinterpretq_s8_u8(w.b), vld1q_s8(q + 16));
}
/* Weight bytes up to 255: w = lo + 16 hi, both nibbles valid signed bytes. */
static inline q8i q8_dot8(q8w w, const int8_t *q) {
    const uint8x16_t m = vdupq_n_u8(15);
    const int8x16_t x0 = vld1q_s8(q), x1 = vld1q_s8(q + 16);
    int32x4_t t = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vshrq_n_u8(w.a, 4)), x0);
    t = vshlq_n_s32(vdotq_s32(t, vreinterpretq_s8_u8(vshrq_n_u8(w.b, 4)), x1), 4);
    t = vdotq_s32(t, vreinterpretq_s8_u8(vandq_u8(w.a, m)), x0);
    return vdotq_s32(t, vreinterpretq_s8_u8(vandq_u8(w.b, m)), x1);
}

#define Q8_ENTRY mlxserve_q8_neon
#include "q8_impl.h"
const int mlxserve_q8_built_neon = 1;

#else /* not this architecture, or the compiler lacks the flags: never called */
const int mlxserve_q8_built_neon = 0;
void mlxserve_q8_neon(const q8_problem *q) { (void)q; }
#endif
