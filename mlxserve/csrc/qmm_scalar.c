/* qmm_impl.h with one float per "vector": the portable path, and the others' reference. */
#include <string.h>

#include "qmm.h"

#define VW 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vload(const float *p) { return *p; }
static inline void vstore(float *p, vf v) { *p = v; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vset1(float f) { return f; }
static inline float vsum(vf v) { return v; }

static inline void deq4(const uint8_t *p, vf *q) {
    for (int i = 0; i < 16; i++) {
        q[2 * i] = (float)(p[i] & 15);
        q[2 * i + 1] = (float)(p[i] >> 4);
    }
}

static inline void deq8(const uint8_t *p, vf *q) {
    for (int i = 0; i < 32; i++) q[i] = (float)p[i];
}

#define cvt_f16 cvt_f16_portable
#define QMM_ENTRY mlxserve_qmm_scalar
#define MV_ROWS 4
#define MR 4
#include "qmm_impl.h"
