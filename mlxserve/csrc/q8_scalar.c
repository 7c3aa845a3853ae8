/* q8_impl.h with one int32 per block: the portable path, and the others' reference. */
#include "qmm.h"

#define cvt_f16 cvt_f16_portable

typedef float q8f;
typedef int32_t q8i;
typedef struct {
    uint8_t v[32];
} q8w;

static inline q8f q8_fzero(void) { return 0.0f; }
static inline q8f q8_fadd(q8f a, q8f b) { return a + b; }
static inline float q8_fsum(q8f v) { return v; }
static inline q8f q8_acc(q8i i, float ds, q8f acc) { return (float)i * ds + acc; }

static inline q8w q8_w4(const uint8_t *p) {
    q8w w;
    for (int i = 0; i < 16; i++) {
        w.v[i] = p[i] & 15;
        w.v[16 + i] = p[i] >> 4;
    }
    return w;
}
static inline q8w q8_w8(const uint8_t *p) {
    q8w w;
    for (int i = 0; i < 32; i++) w.v[i] = p[i];
    return w;
}
static inline q8i q8_dot8(q8w w, const int8_t *q) {
    int32_t t = 0;
    for (int i = 0; i < 32; i++) t += (int32_t)w.v[i] * q[i];
    return t;
}
static inline q8i q8_dot4(q8w w, const int8_t *q) { return q8_dot8(w, q); }

#define Q8_ENTRY mlxserve_q8_scalar
#include "q8_impl.h"
