/* q8_impl.h in plain C: the portable path, and the others' reference. */
#include "qmm.h"

#define cvt_f16 cvt_f16_portable
#define Q8_VC 8
#define Q8_RM 4
#define Q8_RN 1
#define q8_pack q8_pack_generic
#define q8_params q8_params_generic

static inline void q8_tile(const uint8_t *pw, int nv, const int8_t *q, int64_t K, const float *d,
                           int64_t nb, const float *sc, const float *bi, const float *xs,
                           int64_t g, int subs, float *f, const int rm,
                           const int rn, const int kind);

#define Q8_ENTRY mlxserve_q8_scalar
#include "q8_impl.h"

/* y = f + e for rm rows and rn vectors of Q8_VC columns into f (q8_impl.h's formula). */
static inline void q8_tile(const uint8_t *pw, int nv, const int8_t *q, int64_t K, const float *d,
                           int64_t nb, const float *sc, const float *bi, const float *xs,
                           int64_t g, int subs, float *f, const int rm,
                           const int rn, const int kind) {
    (void)kind;
    const int64_t tstride = (int64_t)nv * Q8_VC * 4;
    const int cols = rn * Q8_VC;
    for (int m = 0; m < rm; m++)
        for (int j = 0; j < cols; j++) f[m * Q8_PANEL + j] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = pw + b * 8 * tstride;
        const float *s = sc + (b / subs) * Q8_PANEL;
        for (int m = 0; m < rm; m++) {
            const int8_t *qb = q + m * K + b * 32;
            const float dmb = d[m * nb + b];
            for (int j = 0; j < cols; j++) {
                int32_t dot = 0;
                for (int t = 0; t < 8; t++) {
                    const uint8_t *w = wb + t * tstride + j * 4;
                    for (int i = 0; i < 4; i++) dot += (int32_t)w[i] * qb[4 * t + i];
                }
                f[m * Q8_PANEL + j] = f[m * Q8_PANEL + j] + (float)dot * (dmb * s[j]);
            }
        }
    }
    for (int m = 0; m < rm; m++)
        for (int j = 0; j < cols; j++) {
            float e = 0.0f;
            for (int64_t gi = 0; gi < g; gi++) e = e + bi[gi * Q8_PANEL + j] * xs[m * g + gi];
            f[m * Q8_PANEL + j] = f[m * Q8_PANEL + j] + e;
        }
}
