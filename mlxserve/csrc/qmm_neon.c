/* qmm_impl.h with Arm NEON vectors (4 floats); AArch64 has NEON everywhere. */
#include "qmm.h"

#if defined(__aarch64__)
#include <arm_neon.h>

#define VW 4
typedef float32x4_t vf;
static inline vf vzero(void) { return vdupq_n_f32(0.0f); }
static inline vf vload(const float *p) { return vld1q_f32(p); }
static inline void vstore(float *p, vf v) { vst1q_f32(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vset1(float f) { return vdupq_n_f32(f); }
static inline float vsum(vf v) { return vaddvq_f32(v); }

static inline vf lo4(uint16x8_t h) { return vcvtq_f32_u32(vmovl_u16(vget_low_u16(h))); }
static inline vf hi4(uint16x8_t h) { return vcvtq_f32_u32(vmovl_u16(vget_high_u16(h))); }

/* Per 4 bytes: their low nibbles (even values), then their high nibbles (odd values). */
static inline void deq4(const uint8_t *p, vf *q) {
    const uint8x16_t b = vld1q_u8(p);
    const uint8x16_t lo = vandq_u8(b, vdupq_n_u8(15)), hi = vshrq_n_u8(b, 4);
    const uint16x8_t l0 = vmovl_u8(vget_low_u8(lo)), l1 = vmovl_u8(vget_high_u8(lo));
    const uint16x8_t h0 = vmovl_u8(vget_low_u8(hi)), h1 = vmovl_u8(vget_high_u8(hi));
    q[0] = lo4(l0), q[1] = lo4(h0), q[2] = hi4(l0), q[3] = hi4(h0);
    q[4] = lo4(l1), q[5] = lo4(h1), q[6] = hi4(l1), q[7] = hi4(h1);
}

static inline void deq8(const uint8_t *p, vf *q) {
    for (int i = 0; i < 2; i++) {
        const uint8x16_t b = vld1q_u8(p + 16 * i);
        const uint16x8_t l = vmovl_u8(vget_low_u8(b)), h = vmovl_u8(vget_high_u8(b));
        q[4 * i] = lo4(l), q[4 * i + 1] = hi4(l), q[4 * i + 2] = lo4(h), q[4 * i + 3] = hi4(h);
    }
}

#define cvt_f16 cvt_f16_neon
#define QMM_ENTRY mlxserve_qmm_neon
#define MV_ROWS 8
#define MR 12
#include "qmm_impl.h"
const int mlxserve_qmm_built_neon = 1;

#else /* not this architecture, or the compiler lacks the flags: never called */
const int mlxserve_qmm_built_neon = 0;
void mlxserve_qmm_neon(const qmm_problem *p) { (void)p; }
#endif
