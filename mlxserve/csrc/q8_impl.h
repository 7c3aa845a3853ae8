/* The int8-activation matmul (any number of rows of x, rounded by mlxserve_q8_quantize),
 * written once over a small vocabulary that each q8_<isa>.c defines before including it:
 *
 *   Q8_VC              columns of w per vector (8 on x86's 256-bit vectors, 4 on NEON)
 *   Q8_RM, Q8_RN       the register tile: rows of x by vectors of columns (Q8_RN_BYTE:
 *                      fewer vectors for byte weights, when they take more registers)
 *   q8_pack(...)       one vector of columns, every block, into the packed layout below
 *                      (q8_pack_generic does it in plain C)
 *   q8_params(...)     scales or biases of a panel transposed to float32 (g, Q8_PANEL)
 *                      (q8_params_generic)
 *   q8_tile(...)       the tile's y = f + e (below), for rm <= Q8_RM rows and rn <= Q8_RN
 *                      vectors, with weights of `kind` (Q8_SMALL, Q8_BYTE)
 *   Q8_ENTRY           the exported function's name
 *
 * The math. Row m of x is rounded per block b of 32 values: x_k ~ x'_k = d_b q_k, q_k in
 * [-127, 127] (qmm.h). Row n of w holds unsigned w_k in [0, 2^bits) and dequantizes to
 * s_g w_k + b_g for k in group g (a group is group_size / 32 blocks). So
 *
 *   y[m, n] = sum_b (d_b s_g) * sum_{k in b} q_k w_k  +  sum_g b_g * sum_{b in g} d_b sum_{k in b} q_k
 *           = sum_b ds_b * dot_b                       +  sum_g b_g * xs_g
 *
 * dot_b, an integer dot product of signed activations with unsigned weights, is at most
 * 32 * 255 * 127 < 2^21 in magnitude: exact in int32 and in float32, whatever the order
 * its products are added in. Everything after it is one fixed sequence of float32
 * operations per (m, n), each rounded (no fused multiply-add: the q8 files are compiled
 * with -ffp-contract=off):
 *
 *   f = 0;  for b in order: f = f + float(dot_b) * (d_b * s_g)
 *   xs_g = 0 + dsum_{b0} + dsum_{b0+1} ...  (dsum_b = d_b * sum_k q_k, from the rounding)
 *   e = 0;  for g in order: e = e + b_g * xs_g
 *   y[m, n] = f + e
 *
 * So every instruction set gives the same bits (tests/test_cpu_int8.py replays this in
 * numpy float32 and compares exactly), and a row's result does not depend on the other
 * rows in the product: a request's logits are the same alone, in a batch, beside drafts
 * or in any chunk of its prompt.
 *
 * The loops. Work is split over panels of columns (Q8_PANEL columns) by chunks of up to
 * Q8_ITEM_ROWS rows, one per thread pool item. A panel's weights are unpacked once into bytes laid out for the integer dot
 * products of the ISAs (x86 vpdpbusd / vpmaddubsw, Arm sdot): block b, then quad t of
 * its 32 values (values 4t .. 4t + 3 in the kernel order below), then the column, then
 * the quad's 4 bytes; a 32-bit broadcast of a row's quad of q then meets Q8_VC columns
 * in one instruction, the sums landing one column per 32-bit lane. Then register tiles
 * of Q8_RM rows by Q8_RN vectors of columns sweep the panel, each packed weight loaded
 * once per Q8_RM rows. 4-bit values are in the kernel order of the rounding's perm4
 * (a block's low nibbles, values 0, 2, .., 30, then its high nibbles), so unpacking
 * takes a mask and a shift; other widths are in order.
 *
 * One row (decode) of 4- or 8-bit weights skips the panel where the ISA has q8_tile_raw
 * (Q8_RAW: x86, NEON): whole vectors of columns are read straight from w (x86 transposes
 * them in registers, NEON adds up each column's lanes), and the bytes of the next tile (the
 * rows after it in memory) and the next panel's scales and biases are prefetched meanwhile:
 * a decode step streams ~100 MB of weights from memory, and with the hardware's prefetchers
 * alone the loads waited (about half a plain read's bandwidth).
 */
#include "qmm_common.h"

#ifndef Q8_RN_BYTE /* the tile's vectors of columns for byte weights, if fewer */
#define Q8_RN_BYTE Q8_RN
#endif
#define Q8_PANEL_V (2 * Q8_RN)            /* vectors of columns per panel */
#define Q8_PANEL (Q8_PANEL_V * Q8_VC)     /* columns per panel */

/* Kinds of weights: values below 16 (bits <= 4) or any byte. */
enum { Q8_SMALL = 0, Q8_BYTE = 1 };

typedef struct {
    const q8_problem *q;
    const float *xs; /* (M, groups) */
    int64_t nb, g, panels;
} q8_ctx;

/* Rows per pool item: the same rows' q stay in cache across panels, and items stay small
 * enough to balance two threads on a busy machine. */
#define Q8_ITEM_ROWS 64

/* Block b of one column as 32 bytes in kernel order. */
static inline void q8_unpack_column(const uint8_t *wb, int bits, uint8_t u[32]) {
    if (bits == 4) {
        for (int i = 0; i < 16; i++) {
            u[i] = wb[i] & 15;
            u[16 + i] = wb[i] >> 4;
        }
    } else if (bits == 8) {
        memcpy(u, wb, 32);
    } else {
        unpack_bits(wb, bits, u);
    }
}

/* Columns w0 .. w0 + (ncols - 1) rows (ncols <= Q8_VC; the rest of the vector is zeros),
 * every block, into dst (the vector's place in block 0, quad 0 of a panel of nv vectors). */
static inline void q8_pack_generic(const uint8_t *w0, int64_t row_bytes, int ncols, int64_t nb,
                                   int bits, uint8_t *dst, int nv) {
    const int64_t tstride = (int64_t)nv * Q8_VC * 4, bstride = 8 * tstride;
    const int64_t block_bytes = 32 * bits / 8;
    for (int j = 0; j < Q8_VC; j++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t u[32];
            if (j < ncols)
                q8_unpack_column(w0 + j * row_bytes + b * block_bytes, bits, u);
            else
                memset(u, 0, sizeof(u));
            for (int t = 0; t < 8; t++) memcpy(dst + b * bstride + t * tstride + j * 4, u + 4 * t, 4);
        }
}

/* Scales or biases of columns n0 .. n0 + ncols - 1 ((ncols, g) in the weights' dtype) as
 * float32 in dst (g, Q8_PANEL): a vector of columns per group; padding columns zero. */
static inline void q8_params_generic(const qmm_problem *p, const void *src, int64_t n0, int ncols,
                                     int64_t g, float *tmp, float *dst) {
    const float *s = params_f32(p, src, n0 * g, ncols * g, tmp);
    const int padded = (ncols + Q8_VC - 1) / Q8_VC * Q8_VC;
    for (int64_t gi = 0; gi < g; gi++) {
        for (int j = 0; j < ncols; j++) dst[gi * Q8_PANEL + j] = s[j * g + gi];
        for (int j = ncols; j < padded; j++) dst[gi * Q8_PANEL + j] = 0.0f;
    }
}

/* One (rows, vectors) tile shape, with both kinds of weights: constants for q8_tile. */
#define Q8_TILE(RM, RN)                                                                     \
    case (RM) * 16 + (RN):                                                                  \
        if (kind == Q8_SMALL)                                                               \
            q8_tile(pw + c0 * Q8_VC * 4, nv, qm, K, dm, nb, sc + c0 * Q8_VC, bi + c0 * Q8_VC, \
                    xs, g, subs, f + c0 * Q8_VC, RM, RN, Q8_SMALL);                         \
        else                                                                                \
            q8_tile(pw + c0 * Q8_VC * 4, nv, qm, K, dm, nb, sc + c0 * Q8_VC, bi + c0 * Q8_VC, \
                    xs, g, subs, f + c0 * Q8_VC, RM, RN, Q8_BYTE);                          \
        break;

static void q8_item(void *vctx, int64_t item) {
    const q8_ctx *c = (const q8_ctx *)vctx;
    const qmm_problem *p = c->q->p;
    const int64_t M = p->M, N = p->N, K = p->K, nb = c->nb, g = c->g;
    const int subs = p->group_size / 32, bits = p->bits;
    const int kind = bits <= 4 ? Q8_SMALL : Q8_BYTE;
    const int64_t n0 = item % c->panels * Q8_PANEL, m_first = item / c->panels * Q8_ITEM_ROWS;
    const int64_t m_end = m_first + Q8_ITEM_ROWS < M ? m_first + Q8_ITEM_ROWS : M;
    const int ncols = (int)(N - n0 < Q8_PANEL ? N - n0 : Q8_PANEL);
    const int nv = (ncols + Q8_VC - 1) / Q8_VC;
    const int64_t row_bytes = K * bits / 8;
    /* Scratch: packed weights, transposed scales and biases ((g, Q8_PANEL)), room for
     * their float32 copies before transposing, and the tile's results. */
    const size_t packed_floats = (size_t)(nb * 8 * nv * Q8_VC), pg = (size_t)(g * Q8_PANEL);
    float *buf = scratch(&tls_c, &tls_c_cap,
                         packed_floats + 4 * pg + Q8_RM * (size_t)Q8_PANEL);
    uint8_t *pw = (uint8_t *)buf;
    float *sc = buf + packed_floats, *bi = sc + pg, *tmp = bi + pg, *f = tmp + 2 * pg;
    /* One row of 4- or 8-bit weights (decode, the LM head): whole vectors of columns are
     * read where they are (q8_tile_raw), packing them would cost as much as the dot
     * products; the partial last vector is packed. */
#ifdef Q8_RAW
    const int raw_vectors = (bits == 4 || bits == 8) && m_end - m_first == 1 ? ncols / Q8_VC : 0;
#else
    const int raw_vectors = 0;
#endif
    for (int v = raw_vectors; v < nv; v++) {
        const int cols = ncols - v * Q8_VC < Q8_VC ? ncols - v * Q8_VC : Q8_VC;
        q8_pack((const uint8_t *)p->w + (n0 + v * Q8_VC) * row_bytes, row_bytes, cols, nb, bits,
                pw + v * Q8_VC * 4, nv);
    }
    q8_params(p, p->scales, n0, ncols, g, tmp, sc);
    q8_params(p, p->biases, n0, ncols, g, tmp, bi);
    if (raw_vectors && n0 + Q8_PANEL < N) { /* and the next panel's scales and biases */
        const int64_t size = p->scale_type == QMM_F32 ? 4 : 2, end = N * g * size;
        const int64_t at = (n0 + Q8_PANEL) * g * size;
        for (int64_t i = 0; i < Q8_PANEL * g * size && at + i < end; i += 64) {
            __builtin_prefetch((const char *)p->scales + at + i);
            __builtin_prefetch((const char *)p->biases + at + i);
        }
    }
    for (int64_t m0 = m_first; m0 < m_end; m0 += Q8_RM) {
        const int rm = (int)(m_end - m0 < Q8_RM ? m_end - m0 : Q8_RM);
        const int8_t *qm = c->q->q + m0 * K;
        const float *dm = c->q->d + m0 * nb, *xs = c->xs + m0 * g;
        const int tile_rn = kind == Q8_SMALL ? Q8_RN : Q8_RN_BYTE;
#ifdef Q8_ZMM
        if (m_end - m_first > 1) { /* several rows: the panel in 512-bit vectors at once */
            switch (rm * 4 + (nv + 1) / 2) {
#define Q8_TILE_ZMM(RM, NZ)                                                                 \
    case (RM) * 4 + (NZ):                                                                   \
        q8_tile_zmm(pw, nv, qm, K, dm, nb, sc, bi, xs, g, subs, f, RM, NZ, nv % 2 ? 8 : 16); \
        break;
                Q8_TILE_ZMM(1, 1) Q8_TILE_ZMM(2, 1) Q8_TILE_ZMM(3, 1) Q8_TILE_ZMM(4, 1)
                Q8_TILE_ZMM(1, 2) Q8_TILE_ZMM(2, 2) Q8_TILE_ZMM(3, 2) Q8_TILE_ZMM(4, 2)
                Q8_TILE_ZMM(1, 3) Q8_TILE_ZMM(2, 3) Q8_TILE_ZMM(3, 3) Q8_TILE_ZMM(4, 3)
#undef Q8_TILE_ZMM
            }
            for (int m = 0; m < rm; m++)
                memcpy(p->y + (m0 + m) * N + n0, f + m * Q8_PANEL, (size_t)ncols * sizeof(float));
            continue;
        }
#endif
        for (int c0 = 0, rn; c0 < nv; c0 += rn) {
            rn = nv - c0 < tile_rn ? nv - c0 : tile_rn;
#ifdef Q8_RAW
            if (c0 < raw_vectors) {
                rn = raw_vectors - c0 < rn ? raw_vectors - c0 : rn;
                const uint8_t *raw = (const uint8_t *)p->w + (n0 + c0 * Q8_VC) * row_bytes;
                /* The rows of the tile after this one follow it in memory: fetched while
                 * this one runs (the hardware's prefetchers leave the loads waiting). */
                const uint8_t *next = raw + rn * Q8_VC * row_bytes;
                const int64_t left = (const uint8_t *)p->w + N * row_bytes - next;
                const int64_t ahead = left < rn * Q8_VC * row_bytes ? left : rn * Q8_VC * row_bytes;
                switch (rn * 2 + kind) {
#define Q8_RAW_TILE(RN, KIND)                                                                 \
    case (RN) * 2 + (KIND):                                                                   \
        q8_tile_raw(raw, row_bytes, next, ahead, qm, K, dm, nb, sc + c0 * Q8_VC,             \
                    bi + c0 * Q8_VC, xs, g, subs, f + c0 * Q8_VC, RN, KIND);                  \
        break;
                    Q8_RAW_TILE(1, Q8_SMALL)
                    Q8_RAW_TILE(1, Q8_BYTE)
#if Q8_RN >= 2
                    Q8_RAW_TILE(2, Q8_SMALL)
                    Q8_RAW_TILE(2, Q8_BYTE)
#endif
#if Q8_RN >= 3
                    Q8_RAW_TILE(3, Q8_SMALL)
                    Q8_RAW_TILE(3, Q8_BYTE)
#endif
#undef Q8_RAW_TILE
                }
            } else
#endif
            switch (rm * 16 + rn) {
                Q8_TILE(1, 1)
                Q8_TILE(2, 1)
                Q8_TILE(3, 1)
                Q8_TILE(4, 1)
#if Q8_RN >= 2
                Q8_TILE(1, 2)
                Q8_TILE(2, 2)
                Q8_TILE(3, 2)
                Q8_TILE(4, 2)
#endif
#if Q8_RN >= 3
                Q8_TILE(1, 3)
                Q8_TILE(2, 3)
                Q8_TILE(3, 3)
                Q8_TILE(4, 3)
#endif
            }
            const int j0 = c0 * Q8_VC, j1 = (c0 + rn) * Q8_VC < ncols ? (c0 + rn) * Q8_VC : ncols;
            for (int m = 0; m < rm; m++)
                memcpy(p->y + (m0 + m) * N + n0 + j0, f + m * Q8_PANEL + j0,
                       (size_t)(j1 - j0) * sizeof(float));
        }
    }
}
#undef Q8_TILE

void Q8_ENTRY(const q8_problem *q) {
    const qmm_problem *p = q->p;
    const int64_t M = p->M, nb = p->K / 32, g = p->K / p->group_size, subs = nb / g;
    float *xs = scratch(&tls_a, &tls_a_cap, (size_t)(M * g));
    for (int64_t m = 0; m < M; m++)
        for (int64_t gi = 0; gi < g; gi++) {
            float t = 0.0f;
            for (int64_t s = 0; s < subs; s++) t = t + q->dsum[m * nb + gi * subs + s];
            xs[m * g + gi] = t;
        }
    const int64_t panels = (p->N + Q8_PANEL - 1) / Q8_PANEL;
    q8_ctx c = {q, xs, nb, g, panels};
    mlxserve_qmm_parallel_for(panels * ((M + Q8_ITEM_ROWS - 1) / Q8_ITEM_ROWS), q8_item, &c);
}
