/* The int8-activation GEMV (1 .. Q8_MAX_ROWS rows of x, rounded by mlxserve_q8_quantize),
 * written once over a small vocabulary that each q8_<isa>.c defines before including it:
 *
 *   q8f                float accumulator vector; q8_fzero(), q8_fadd(a, b), q8_fsum(v)
 *   q8w                one block of 32 weights as bytes, in kernel order
 *   q8_w4(p)           16 packed bytes of 4-bit weights -> q8w: the low nibbles (values
 *                      0, 2, ..., 30), then the high nibbles (1, 3, ..., 31)
 *   q8_w8(p)           32 weight bytes -> q8w, in order
 *   q8i                a block's int32 partial sums (each exact)
 *   q8_dot4(w, q)      sum of w_k q_k over the block, split into partial sums; q: 32 int8
 *                      in the weights' order; 4-bit weights (w_k < 16)
 *   q8_dot8(w, q)      the same for bytes up to 255 (8-bit weights, and 2/3/5/6-bit ones
 *                      unpacked to bytes)
 *   q8_acc(i, ds, acc) acc + float(i) * ds, per lane (ds a float)
 *   Q8_ENTRY           the exported function's name
 *
 * The math. Row m of x is rounded per block b of 32 values: x_k ~ x'_k = d_b q_k, q_k in
 * [-127, 127] (qmm.h). Row n of w holds unsigned w_k in [0, 2^bits) and dequantizes to
 * s_g w_k + b_g for k in group g (a group is group_size / 32 blocks). So
 *
 *   y[m, n] = sum_k x'_k (s_g w_k + b_g)
 *           = sum_b (d_b s_g) * sum_{k in b} q_k w_k  +  sum_g b_g * sum_{b in g} d_b sum_{k in b} q_k
 *           = sum_b ds_b * dot_b                       +  sum_g b_g * xs_g
 *
 * dot_b is an integer dot product of signed activations with unsigned weights, at most
 * 32 * 255 * 127 < 2^21 in magnitude: exact in int32 and in float32, as are its partial
 * sums. ds_b = d_b * s_g is one float32 product per (row of x, block, row of w), made
 * once per row of w for all its blocks. xs_g = sum of dsum_b over the group's blocks
 * depends on x alone (once per call). So per block and row of x the kernel does one
 * integer dot product, one int->float conversion and one FMA; the weights are unpacked
 * once per block for all rows of x.
 *
 * Signs: x86's integer dot products multiply unsigned bytes by signed bytes (vpdpbusd;
 * vpmaddubsw), which is exactly w_k (unsigned) times q_k (signed): no offset or sign
 * trick is needed. vpmaddubsw adds pairs into int16 and saturates past 32767, which
 * 2 * 255 * 127 exceeds: AVX2 splits 8-bit weights into nibbles (w = lo + 16 hi) and
 * combines in int32. NEON's sdot is signed x signed: 4-bit weights are valid int8 as
 * they are, 8-bit ones are split into nibbles the same way.
 *
 * Each (m, n) is accumulated in the same order whatever the number of rows of x, as in
 * the float GEMV: a request's row gets the same bits alone or beside others.
 */
#include "qmm_common.h"

typedef struct {
    const q8_problem *q;
    const float *xs; /* (M, groups) */
    int64_t nb, g, rows_per_item;
} q8_ctx;

/* Kinds of weight rows, as unpacked per block. */
enum { Q8_BITS4 = 0, Q8_BITS8 = 1, Q8_BITS_OTHER = 2 };

static inline float q8_dotf(const float *a, const float *b, int64_t n) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* four chains: n is small (groups per row) */
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += a[i + j] * b[i + j];
    for (; i < n; i++) s[0] += a[i] * b[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* Block b of weight rows n .. n + nr - 1 times every row of x, into acc[r][m][slot]. */
static inline __attribute__((always_inline)) void q8_block(const q8_ctx *c, int64_t n,
                                                           const float *ds,
                                                           q8f acc[2][Q8_MAX_ROWS][2], int64_t b,
                                                           const int slot, const int m_rows,
                                                           const int nr, const int kind) {
    const qmm_problem *p = c->q->p;
    const int64_t K = p->K, nb = c->nb;
    const int bits = p->bits;
    const int64_t row_bytes = K * bits / 8, block_bytes = 32 * bits / 8;
#pragma GCC unroll 2
    for (int r = 0; r < nr; r++) {
        const uint8_t *wb = (const uint8_t *)p->w + (n + r) * row_bytes + b * block_bytes;
        q8w w;
        if (kind == Q8_BITS4) {
            w = q8_w4(wb);
        } else if (kind == Q8_BITS8) {
            w = q8_w8(wb);
        } else {
            uint8_t u[32];
            unpack_bits(wb, bits, u);
            w = q8_w8(u);
        }
        const int8_t *qb = c->q->q + b * 32;
        const float *dsr = ds + r * m_rows * nb + b;
#pragma GCC unroll 8
        for (int m = 0; m < m_rows; m++) {
            const q8i t = kind == Q8_BITS4 ? q8_dot4(w, qb + m * K) : q8_dot8(w, qb + m * K);
            acc[r][m][slot] = q8_acc(t, dsr[m * nb], acc[r][m][slot]);
        }
    }
}

/* y[m, n .. n + nr - 1] for all m_rows rows of x; sc, bi: those weight rows' float32
 * scales and biases ((nr, g)); ds: scratch of nr * m_rows * nb floats. */
static inline __attribute__((always_inline)) void q8_rows(const q8_ctx *c, int64_t n,
                                                          const float *sc, const float *bi,
                                                          float *ds, const int m_rows,
                                                          const int nr, const int kind) {
    const qmm_problem *p = c->q->p;
    const int64_t N = p->N, nb = c->nb, g = c->g;
    const int subs = p->group_size / 32;
    const float *d = c->q->d;
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < m_rows; m++) {
            float *out = ds + (r * m_rows + m) * nb;
            const float *dm = d + m * nb, *sr = sc + r * g;
            if (subs == 1)
                for (int64_t b = 0; b < nb; b++) out[b] = dm[b] * sr[b];
            else
                for (int64_t gi = 0; gi < g; gi++)
                    for (int s = 0; s < subs; s++)
                        out[gi * subs + s] = dm[gi * subs + s] * sr[gi];
        }
    q8f acc[2][Q8_MAX_ROWS][2];
#pragma GCC unroll 2
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 8
        for (int m = 0; m < m_rows; m++) acc[r][m][0] = acc[r][m][1] = q8_fzero();
    /* Even and odd blocks into separate accumulators (a constant index: registers). */
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        q8_block(c, n, ds, acc, b, 0, m_rows, nr, kind);
        q8_block(c, n, ds, acc, b + 1, 1, m_rows, nr, kind);
    }
    if (b < nb) q8_block(c, n, ds, acc, b, 0, m_rows, nr, kind);
#pragma GCC unroll 2
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 8
        for (int m = 0; m < m_rows; m++)
            p->y[m * N + n + r] = q8_fsum(q8_fadd(acc[r][m][0], acc[r][m][1])) +
                                  q8_dotf(bi + r * g, c->xs + m * g, g);
}

static inline __attribute__((always_inline)) void q8_span(const q8_ctx *c, int64_t n0,
                                                          int64_t n1, const float *sc,
                                                          const float *bi, float *ds,
                                                          const int m_rows, const int kind) {
    const int64_t g = c->g;
    int64_t n = n0;
    if (m_rows <= 2) /* two weight rows at a time: more independent chains for few rows */
        for (; n + 2 <= n1; n += 2)
            q8_rows(c, n, sc + (n - n0) * g, bi + (n - n0) * g, ds, m_rows, 2, kind);
    for (; n < n1; n++) q8_rows(c, n, sc + (n - n0) * g, bi + (n - n0) * g, ds, m_rows, 1, kind);
}

#define Q8_KIND(R, KIND)                                  \
    case KIND:                                            \
        q8_span(c, n0, n1, sc, bi, ds, R, KIND);          \
        break;
#define Q8_CASE(R)                                        \
    case R:                                               \
        switch (kind) {                                   \
            Q8_KIND(R, Q8_BITS4)                          \
            Q8_KIND(R, Q8_BITS8)                          \
            Q8_KIND(R, Q8_BITS_OTHER)                     \
        }                                                 \
        break;

static void q8_item(void *vctx, int64_t item) {
    const q8_ctx *c = (const q8_ctx *)vctx;
    const qmm_problem *p = c->q->p;
    const int64_t n0 = item * c->rows_per_item;
    const int64_t n1 = n0 + c->rows_per_item < p->N ? n0 + c->rows_per_item : p->N;
    const int64_t count = (n1 - n0) * c->g;
    const int kind = p->bits == 4 ? Q8_BITS4 : p->bits == 8 ? Q8_BITS8 : Q8_BITS_OTHER;
    float *buf = scratch(&tls_c, &tls_c_cap, 2 * (size_t)count + 2 * Q8_MAX_ROWS * (size_t)c->nb);
    float *ds = buf + 2 * count;
    const float *sc = params_f32(p, p->scales, n0 * c->g, count, buf);
    const float *bi = params_f32(p, p->biases, n0 * c->g, count, buf + count);
    switch ((int)p->M) {
        Q8_CASE(1)
        Q8_CASE(2)
        Q8_CASE(3)
        Q8_CASE(4)
        Q8_CASE(5)
        Q8_CASE(6)
        Q8_CASE(7)
        Q8_CASE(8)
    }
}
#undef Q8_CASE
#undef Q8_KIND

void Q8_ENTRY(const q8_problem *q) {
    const qmm_problem *p = q->p;
    const int64_t M = p->M, nb = p->K / 32, g = p->K / p->group_size, subs = nb / g;
    float *xs = scratch(&tls_a, &tls_a_cap, (size_t)(M * g));
    for (int64_t m = 0; m < M; m++)
        for (int64_t gi = 0; gi < g; gi++) {
            float t = 0.0f;
            for (int64_t s = 0; s < subs; s++) t += q->dsum[m * nb + gi * subs + s];
            xs[m * g + gi] = t;
        }
    /* ~16 KB of weights per item: enough work to pay for the hand-off, many items. */
    int64_t rows = (16384 * 8) / (p->K * p->bits);
    if (rows < 1) rows = 1;
    q8_ctx c = {q, xs, nb, g, rows};
    mlxserve_qmm_parallel_for((p->N + rows - 1) / rows, q8_item, &c);
}
