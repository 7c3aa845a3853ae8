/* The quantized matmul algorithm, written once over a small vector vocabulary that each
 * qmm_<isa>.c defines before including this file:
 *
 *   VW                 floats per vector; vf its type
 *   vzero vload vstore vfma(a, b, c) = a * b + c, vset1, vsum (horizontal add)
 *   deq4(p, q)         16 bytes = 32 4-bit values -> 32 / VW vectors, in the order
 *                      perm4() gives (low nibbles of VW bytes, then their high nibbles)
 *   deq8(p, q)         32 bytes = 32 8-bit values -> 32 / VW vectors, in order (2-, 3-,
 *                      5- and 6-bit values are unpacked to bytes first, see unpack_bits)
 *   cvt_f16(s, n, d)   n float16 -> float32
 *   QMM_ENTRY          the exported function's name
 *   MV_ROWS            most rows of x the GEMV keeps in registers
 *   MR                 weight rows per GEMM micro-tile (MR x 2 vectors of accumulators)
 *
 * Dot products are over k in any fixed order, so x is permuted once per call into the
 * order the dequantizer produces values in, instead of shuffling every weight.
 */
#include "qmm_common.h"

#define BLOCK 32 /* values per dequantized block (the smallest group size) */
#define VPB (BLOCK / VW)

/* Position -> value index inside a 32-value block of 4-bit weights (see deq4). */
static void perm4(int *idx) {
    for (int c = 0; c < 16 / VW; c++)
        for (int j = 0; j < VW; j++) {
            idx[c * 2 * VW + j] = 2 * (c * VW + j);
            idx[c * 2 * VW + VW + j] = 2 * (c * VW + j) + 1;
        }
}

static void block_order(int bits, int *idx) {
    if (bits == 4)
        perm4(idx);
    else
        for (int i = 0; i < BLOCK; i++) idx[i] = i;
}

static inline void deq(int bits, const uint8_t *p, vf *q) {
    if (bits == 4) {
        deq4(p, q);
    } else if (bits == 8) {
        deq8(p, q);
    } else {
        uint8_t u[BLOCK];
        unpack_bits(p, bits, u);
        deq8(u, q);
    }
}

/* ---------------------------------------------------------------- GEMV (few rows) */

typedef struct {
    const qmm_problem *p;
    const float *xp; /* (M, K) permuted */
    int64_t g, rows_per_item;
} mv_ctx;

/* y[m, n] for weight rows n .. n + nr - 1 together: each block of 32 weights is
 * dequantized once (q * scale + bias, as mx.dequantize computes it) and multiplied with
 * every row of x, so a row of x costs VPB FMAs per block on top of the shared
 * dequantization (speculative verification and small batches cost little more than one
 * row). Each (m, n) is accumulated in the same order whatever m_rows is: a request's
 * row gets the same bits alone or beside others. Two accumulators per (r, m), for the
 * even and the odd vectors of a block, halve the FMA dependency chains. */
static inline __attribute__((always_inline)) void mv_block(const mv_ctx *c, int64_t n,
                                                           const float *srow, const float *brow,
                                                           const int m_rows, const int nr) {
    const qmm_problem *p = c->p;
    const int64_t K = p->K, N = p->N, g_count = c->g;
    const int bits = p->bits, subs = p->group_size / BLOCK;
    const int64_t row_bytes = K * bits / 8, block_bytes = BLOCK * bits / 8;
    vf acc[2][MV_ROWS][2];
#pragma GCC unroll 2
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 8
        for (int m = 0; m < m_rows; m++) acc[r][m][0] = acc[r][m][1] = vzero();
    for (int64_t gi = 0; gi < g_count; gi++) {
#pragma GCC unroll 2
        for (int r = 0; r < nr; r++) {
            const uint8_t *wr = (const uint8_t *)p->w + (n + r) * row_bytes;
            const vf sv = vset1(srow[r * g_count + gi]), bv = vset1(brow[r * g_count + gi]);
            for (int s = 0; s < subs; s++) {
                const int64_t k0 = (gi * subs + s) * BLOCK;
                vf q[VPB];
                deq(bits, wr + (k0 / BLOCK) * block_bytes, q);
#pragma GCC unroll 32
                for (int v = 0; v < VPB; v++) q[v] = vfma(q[v], sv, bv);
                const float *xb = c->xp + k0;
#pragma GCC unroll 8
                for (int m = 0; m < m_rows; m++)
#pragma GCC unroll 32
                    for (int v = 0; v < VPB; v++)
                        acc[r][m][v & 1] = vfma(q[v], vload(xb + m * K + v * VW), acc[r][m][v & 1]);
            }
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 8
        for (int m = 0; m < m_rows; m++)
            p->y[m * N + n + r] = vsum(acc[r][m][0] + acc[r][m][1]);
}

static inline __attribute__((always_inline)) void mv_rows(const mv_ctx *c, int64_t n0,
                                                          int64_t n1, const float *sc,
                                                          const float *bi, const int m_rows) {
    const int64_t g = c->g;
    /* Two weight rows at a time for one or two rows of x (more: register spills). */
    int64_t n = n0;
    if (m_rows <= 2)
        for (; n + 2 <= n1; n += 2)
            mv_block(c, n, sc + (n - n0) * g, bi + (n - n0) * g, m_rows, 2);
    for (; n < n1; n++) mv_block(c, n, sc + (n - n0) * g, bi + (n - n0) * g, m_rows, 1);
}

static void mv_item(void *vctx, int64_t item) {
    const mv_ctx *c = (const mv_ctx *)vctx;
    const qmm_problem *p = c->p;
    const int64_t n0 = item * c->rows_per_item;
    const int64_t n1 = n0 + c->rows_per_item < p->N ? n0 + c->rows_per_item : p->N;
    const int64_t count = (n1 - n0) * c->g;
    float *buf = p->scale_type == QMM_F32 ? NULL : scratch(&tls_c, &tls_c_cap, 2 * (size_t)count);
    const float *sc = params_f32(p, p->scales, n0 * c->g, count, buf);
    const float *bi = params_f32(p, p->biases, n0 * c->g, count, buf ? buf + count : NULL);
    switch ((int)p->M) {
#define MV_CASE(R) \
    case R: mv_rows(c, n0, n1, sc, bi, R); break;
        MV_CASE(1)
#if MV_ROWS >= 2
        MV_CASE(2)
#endif
#if MV_ROWS >= 3
        MV_CASE(3)
#endif
#if MV_ROWS >= 4
        MV_CASE(4)
#endif
#if MV_ROWS >= 5
        MV_CASE(5)
#endif
#if MV_ROWS >= 6
        MV_CASE(6)
#endif
#if MV_ROWS >= 7
        MV_CASE(7)
#endif
#if MV_ROWS >= 8
        MV_CASE(8)
#endif
#undef MV_CASE
    }
}

static void qmv(const qmm_problem *p) {
    const int64_t M = p->M, K = p->K, g = K / p->group_size;
    float *xp = scratch(&tls_a, &tls_a_cap, (size_t)(M * K));
    int idx[BLOCK];
    block_order(p->bits, idx);
    for (int64_t m = 0; m < M; m++) {
        const float *x = p->x + m * K;
        for (int64_t k0 = 0; k0 < K; k0 += BLOCK)
            for (int i = 0; i < BLOCK; i++) xp[m * K + k0 + i] = x[k0 + idx[i]];
    }
    /* ~16 KB of weights per item: enough work to pay for the hand-off, many items. */
    int64_t rows = (16384 * 8) / (K * p->bits);
    if (rows < 1) rows = 1;
    mv_ctx c = {p, xp, g, rows};
    mlxserve_qmm_parallel_for((p->N + rows - 1) / rows, mv_item, &c);
}

/* ---------------------------------------------------------------- GEMM (many rows) */

#define NM (2 * VW) /* rows of x per packed chunk */

typedef struct {
    const qmm_problem *p;
    const float *xp; /* chunks of NM rows: [chunk][k][NM], permuted k, zero-padded rows */
    int64_t chunks;
} mm_ctx;

/* Dequantize weight rows n0 .. n0 + MR - 1 into wd (MR, K), permuted k; rows past N: 0. */
static void dequant_panel(const qmm_problem *p, int64_t n0, float *wd, float *buf, int64_t g) {
    const int64_t K = p->K;
    const int bits = p->bits, subs = p->group_size / BLOCK;
    const int64_t row_bytes = K * bits / 8, block_bytes = BLOCK * bits / 8;
    const int64_t rows = p->N - n0 < MR ? p->N - n0 : MR;
    const float *sc = params_f32(p, p->scales, n0 * g, rows * g, buf);
    const float *bi = params_f32(p, p->biases, n0 * g, rows * g, buf + MR * g);
    memset(wd + rows * K, 0, sizeof(float) * (size_t)((MR - rows) * K));
    for (int64_t i = 0; i < rows; i++) {
        float *out = wd + i * K;
        const uint8_t *wr = (const uint8_t *)p->w + (n0 + i) * row_bytes;
        for (int64_t gi = 0; gi < g; gi++) {
            const vf sv = vset1(sc[i * g + gi]), bv = vset1(bi[i * g + gi]);
            for (int s = 0; s < subs; s++) {
                const int64_t k0 = (gi * subs + s) * BLOCK;
                vf q[VPB];
                deq(bits, wr + (k0 / BLOCK) * block_bytes, q);
#pragma GCC unroll 32
                for (int v = 0; v < VPB; v++) vstore(out + k0 + v * VW, vfma(q[v], sv, bv));
            }
        }
    }
}

static inline __attribute__((always_inline)) void micro(const float *wd, const float *xc,
                                                        int64_t K, float *tile, const int nv) {
    vf acc[MR][2];
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
        acc[i][0] = vzero();
        acc[i][1] = vzero();
    }
    for (int64_t k = 0; k < K; k++) {
        const vf x0 = vload(xc + k * NM);
        const vf x1 = nv == 2 ? vload(xc + k * NM + VW) : x0;
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            const vf wb = vset1(wd[i * K + k]);
            acc[i][0] = vfma(wb, x0, acc[i][0]);
            if (nv == 2) acc[i][1] = vfma(wb, x1, acc[i][1]);
        }
    }
    for (int i = 0; i < MR; i++) {
        vstore(tile + i * NM, acc[i][0]);
        if (nv == 2) vstore(tile + i * NM + VW, acc[i][1]);
    }
}

static void mm_item(void *vctx, int64_t item) {
    const mm_ctx *c = (const mm_ctx *)vctx;
    const qmm_problem *p = c->p;
    const int64_t K = p->K, N = p->N, M = p->M, n0 = item * MR;
    const int64_t g = K / p->group_size;
    float *wd = scratch(&tls_b, &tls_b_cap, (size_t)(MR * K + 2 * MR * g));
    dequant_panel(p, n0, wd, wd + MR * K, g);
    float tile[MR * NM];
    for (int64_t ch = 0; ch < c->chunks; ch++) {
        const int64_t m0 = ch * NM;
        const int64_t rows = M - m0 < NM ? M - m0 : NM;
        if (rows > VW)
            micro(wd, c->xp + ch * K * NM, K, tile, 2);
        else
            micro(wd, c->xp + ch * K * NM, K, tile, 1);
        for (int i = 0; i < MR && n0 + i < N; i++)
            for (int64_t j = 0; j < rows; j++) p->y[(m0 + j) * N + n0 + i] = tile[i * NM + j];
    }
}

static void qgemm(const qmm_problem *p) {
    const int64_t M = p->M, K = p->K, chunks = (M + NM - 1) / NM;
    float *xp = scratch(&tls_a, &tls_a_cap, (size_t)(chunks * K * NM));
    int idx[BLOCK];
    block_order(p->bits, idx);
    for (int64_t ch = 0; ch < chunks; ch++) {
        float *dst = xp + ch * K * NM;
        for (int64_t j = 0; j < NM; j++) {
            const int64_t m = ch * NM + j;
            if (m >= M) {
                for (int64_t k = 0; k < K; k++) dst[k * NM + j] = 0.0f;
                continue;
            }
            const float *x = p->x + m * K;
            for (int64_t k0 = 0; k0 < K; k0 += BLOCK)
                for (int i = 0; i < BLOCK; i++) dst[(k0 + i) * NM + j] = x[k0 + idx[i]];
        }
    }
    mm_ctx c = {p, xp, chunks};
    mlxserve_qmm_parallel_for((p->N + MR - 1) / MR, mm_item, &c);
}

void QMM_ENTRY(const qmm_problem *p) {
    if (p->M <= MV_ROWS)
        qmv(p);
    else
        qgemm(p);
}
