/* q8_impl.h's vocabulary on x86 with 256-bit vectors: 8 columns per vector, one per 32-bit
 * lane. The includer defines Q8_DPBUSD(acc, u8, s8) (vpdpbusd: AVX-512 VNNI or AVX-VNNI)
 * or leaves it undefined for AVX2 (vpmaddubsw + vpmaddwd), Q8_RN and Q8_ENTRY. */
#include <immintrin.h>

#include "qmm.h"

#define cvt_f16 cvt_f16_f16c
#define Q8_VC 8
#define Q8_RM 4

static inline void q8_pack(const uint8_t *w0, int64_t row_bytes, int ncols, int64_t nb, int bits,
                           uint8_t *dst, int nv);
static inline void q8_params(const qmm_problem *p, const void *src, int64_t n0, int ncols,
                             int64_t g, float *tmp, float *dst);
static inline void q8_tile(const uint8_t *pw, int nv, const int8_t *q, int64_t K, const float *d,
                           int64_t nb, const float *sc, const float *bi, const float *xs,
                           int64_t g, int subs, float *f, const int rm,
                           const int rn, const int kind);

static inline void q8_tile_raw(const uint8_t *raw, int64_t row_bytes, const uint8_t *next,
                               int64_t ahead, const int8_t *q, int64_t K,
                               const float *d, int64_t nb, const float *sc, const float *bi,
                               const float *xs, int64_t g, int subs, float *f, const int rn,
                               const int kind);
static inline void q8_tile_any(const uint8_t *pw, int nv, const uint8_t *raw, int64_t row_bytes,
                               const uint8_t *next, int64_t ahead,
                               const int8_t *q, int64_t K, const float *d, int64_t nb,
                               const float *sc, const float *bi, const float *xs, int64_t g,
                               int subs, float *f, const int rm, const int rn, const int kind,
                               const int is_raw);
#define Q8_RAW 1 /* q8_tile_raw: one row of 4- or 8-bit weights without packing */
#ifdef Q8_ZMM
static inline void q8_tile_zmm(const uint8_t *pw, int nv, const int8_t *q, int64_t K,
                               const float *d, int64_t nb, const float *sc, const float *bi,
                               const float *xs, int64_t g, int subs, float *f, const int rm,
                               const int nz, int last_cols);
#endif

#include "q8_impl.h"

/* Quads 0-7 of one block (its 16 bytes at p) of 8 whole columns of 4-bit weights (row_bytes
 * apart), one register each, as q8_pack lays them out: the 4 words of each column
 * transposed (word t of columns 0-7 in one register), low nibbles quad t, high ones t + 4. */
static inline __attribute__((always_inline)) void q8_quads4(const uint8_t *p, int64_t row_bytes,
                                                            __m256i v[8]) {
    const __m256i low = _mm256_set1_epi8(15);
#define Q8_PAIR(j) \
    _mm256_loadu2_m128i((const __m128i *)(p + ((j) + 4) * row_bytes), (const __m128i *)(p + (j) * row_bytes))
    const __m256i r0 = Q8_PAIR(0), r1 = Q8_PAIR(1), r2 = Q8_PAIR(2), r3 = Q8_PAIR(3);
#undef Q8_PAIR
    const __m256i t0 = _mm256_unpacklo_epi32(r0, r1), t1 = _mm256_unpackhi_epi32(r0, r1);
    const __m256i t2 = _mm256_unpacklo_epi32(r2, r3), t3 = _mm256_unpackhi_epi32(r2, r3);
    const __m256i w[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    for (int t = 0; t < 4; t++) {
        v[t] = _mm256_and_si256(w[t], low);
        v[t + 4] = _mm256_and_si256(_mm256_srli_epi16(w[t], 4), low);
    }
}

/* Quads 0-7 of one block (its 32 bytes at p) of 8 whole columns of 8-bit weights (row_bytes
 * apart), one register each, as q8_pack lays them out: the 8 words of each column
 * transposed (an 8 x 8 transpose of 32-bit words). */
static inline __attribute__((always_inline)) void q8_quads8(const uint8_t *p, int64_t row_bytes,
                                                            __m256i v[8]) {
    __m256i r[8], u[8], t[8];
    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_si256((const __m256i *)(p + j * row_bytes));
    for (int j = 0; j < 8; j += 2) {
        u[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);     /* c_j w0 c_j+1 w0 c_j w1 .. */
        u[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]); /* words 2, 3 (and 6, 7) */
    }
    for (int j = 0; j < 8; j += 4)
        for (int h = 0; h < 2; h++) {
            t[j + 2 * h] = _mm256_unpacklo_epi64(u[j + h], u[j + 2 + h]);
            t[j + 2 * h + 1] = _mm256_unpackhi_epi64(u[j + h], u[j + 2 + h]);
        }
    /* t[0..3]: words 0-3 (low half) and 4-7 (high half) of columns 0-3; t[4..7]: of
     * columns 4-7. */
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(t[i], t[4 + i], 0x20);
        v[i + 4] = _mm256_permute2x128_si256(t[i], t[4 + i], 0x31);
    }
}

/* 4-bit: the 16 bytes of a block of 8 columns as 4 words each, transposed (word t of
 * columns 0-7 in one register); the low nibbles of word t are quad t, the high ones quad
 * t + 4. 8-bit: the 8 words of each column transposed (an 8 x 8 transpose). */
static inline void q8_pack(const uint8_t *w0, int64_t row_bytes, int ncols, int64_t nb, int bits,
                           uint8_t *dst, int nv) {
    if (ncols < Q8_VC || (bits != 4 && bits != 8)) {
        q8_pack_generic(w0, row_bytes, ncols, nb, bits, dst, nv);
        return;
    }
    const int64_t tstride = (int64_t)nv * Q8_VC * 4, bstride = 8 * tstride;
    for (int64_t b = 0; b < nb; b++) {
        __m256i v[8];
        if (bits == 4)
            q8_quads4(w0 + b * 16, row_bytes, v);
        else
            q8_quads8(w0 + b * 32, row_bytes, v);
        for (int t = 0; t < 8; t++)
            _mm256_storeu_si256((__m256i *)(dst + b * bstride + t * tstride), v[t]);
    }
}

/* 8 x 8 floats: rows r[i] become columns. */
static inline void q8_transpose8(__m256 r[8]) {
    __m256 u[8], v[8];
    for (int i = 0; i < 8; i += 2) {
        u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            v[i + 2 * h] = _mm256_shuffle_ps(u[i + h], u[i + 2 + h], 0x44);
            v[i + 2 * h + 1] = _mm256_shuffle_ps(u[i + h], u[i + 2 + h], 0xEE);
        }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(v[i], v[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(v[i], v[4 + i], 0x31);
    }
}

/* float32 and float16 parameters, 8 columns by 8 groups at a time (an 8 x 8 transpose);
 * the rest as q8_params_generic. */
static inline void q8_params(const qmm_problem *p, const void *src, int64_t n0, int ncols,
                             int64_t g, float *tmp, float *dst) {
    if (ncols % 8 || g < 8 || p->scale_type == QMM_BF16) {
        q8_params_generic(p, src, n0, ncols, g, tmp, dst);
        return;
    }
    const int f16 = p->scale_type == QMM_F16;
    for (int j0 = 0; j0 < ncols; j0 += 8) {
        int64_t gi = 0;
        for (; gi + 8 <= g; gi += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) {
                const int64_t at = (n0 + j0 + j) * g + gi;
                r[j] = f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + at)))
                           : _mm256_loadu_ps((const float *)src + at);
            }
            q8_transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (gi + i) * Q8_PANEL + j0, r[i]);
        }
        for (; gi < g; gi++)
            for (int j = 0; j < 8; j++) {
                const int64_t at = (n0 + j0 + j) * g + gi;
                dst[gi * Q8_PANEL + j0 + j] =
                    f16 ? _cvtsh_ss(((const uint16_t *)src)[at]) : ((const float *)src)[at];
            }
    }
    (void)tmp;
}

/* y = f + e for rm rows and rn vectors of 8 columns into f (q8_impl.h's formula). */
static inline __attribute__((always_inline)) void q8_tile(const uint8_t *pw, int nv,
                                                          const int8_t *q, int64_t K,
                                                          const float *d, int64_t nb,
                                                          const float *sc, const float *bi,
                                                          const float *xs, int64_t g, int subs,
                                                          float *f,
                                                          const int rm, const int rn,
                                                          const int kind) {
    q8_tile_any(pw, nv, NULL, 0, NULL, 0, q, K, d, nb, sc, bi, xs, g, subs, f, rm, rn, kind, 0);
}

/* One row by rn vectors of whole columns of 4-bit (kind Q8_SMALL) or 8-bit (Q8_BYTE) weights
 * read where they are (raw: the first column's row, row_bytes apart), unpacked in
 * registers: no packed panel. The same integer dot products (exact in any order) and
 * float32 operations as q8_tile. The `ahead` bytes at `next` are prefetched meanwhile, a
 * share per block. */
static inline __attribute__((always_inline)) void q8_tile_raw(
    const uint8_t *raw, int64_t row_bytes, const uint8_t *next, int64_t ahead, const int8_t *q,
    int64_t K, const float *d, int64_t nb, const float *sc, const float *bi, const float *xs,
    int64_t g, int subs, float *f, const int rn, const int kind) {
    q8_tile_any(NULL, 0, raw, row_bytes, next, ahead, q, K, d, nb, sc, bi, xs, g, subs, f, 1, rn,
                kind, 1);
}

/* A vector's 8 quads of block b, read in place (q8_tile_raw). */
static inline __attribute__((always_inline)) void q8_quads_raw(const uint8_t *raw,
                                                               int64_t row_bytes, int64_t b,
                                                               const int kind, __m256i w[8]) {
    if (kind == Q8_SMALL)
        q8_quads4(raw + b * 16, row_bytes, w);
    else
        q8_quads8(raw + b * 32, row_bytes, w);
}

static inline __attribute__((always_inline)) void q8_tile_any(const uint8_t *pw, int nv,
                                                              const uint8_t *raw,
                                                              int64_t row_bytes,
                                                              const uint8_t *next, int64_t ahead,
                                                              const int8_t *q, int64_t K,
                                                              const float *d, int64_t nb,
                                                              const float *sc, const float *bi,
                                                              const float *xs, int64_t g,
                                                              int subs, float *f, const int rm,
                                                              const int rn, const int kind,
                                                              const int is_raw) {
    const int64_t tstride = (int64_t)nv * 32, lines_per_block = (ahead + 64 * nb - 1) / (64 * nb);
    __m256 acc[Q8_RM][Q8_RN];
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < rn; c++) acc[m][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = is_raw ? NULL : pw + b * 8 * tstride;
        const int8_t *qb = q + b * 32;
        if (is_raw) /* this block's share of the bytes ahead */
            for (int64_t at = b * lines_per_block * 64, i = 0; i < lines_per_block && at < ahead;
                 i++, at += 64)
                _mm_prefetch((const char *)next + at, _MM_HINT_T0);
#ifdef Q8_DPBUSD
        (void)kind;
        __m256i dot[Q8_RM][Q8_RN];
        for (int m = 0; m < rm; m++)
            for (int c = 0; c < rn; c++) dot[m][c] = _mm256_setzero_si256();
        if (is_raw) /* rm == 1: a vector's 8 quads at a time */
            for (int c = 0; c < rn; c++) {
                __m256i w[8];
                q8_quads_raw(raw + c * 8 * row_bytes, row_bytes, b, kind, w);
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
                    int32_t x4;
                    memcpy(&x4, qb + 4 * t, 4);
                    dot[0][c] = Q8_DPBUSD(dot[0][c], w[t], _mm256_set1_epi32(x4));
                }
            }
        else
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m256i w[Q8_RN];
            for (int c = 0; c < rn; c++) w[c] = _mm256_loadu_si256((const __m256i *)(wb + t * tstride + c * 32));
            for (int m = 0; m < rm; m++) {
                int32_t x4;
                memcpy(&x4, qb + m * K + 4 * t, 4);
                const __m256i x = _mm256_set1_epi32(x4);
                for (int c = 0; c < rn; c++) dot[m][c] = Q8_DPBUSD(dot[m][c], w[c], x);
            }
        }
#else
        /* vpmaddubsw adds pairs into int16. Values below 16: a block's 16 products per
         * int16 lane stay within 16 * 15 * 127 < 2^15, summed in int16 and widened once.
         * Bytes: split into nibbles (w = lo + 16 hi), each summed so. */
        __m256i lo[Q8_RM][Q8_RN], hi[Q8_RM][Q8_RN], dot[Q8_RM][Q8_RN];
        const __m256i low = _mm256_set1_epi8(15);
        for (int m = 0; m < rm; m++)
            for (int c = 0; c < rn; c++) lo[m][c] = hi[m][c] = _mm256_setzero_si256();
        if (is_raw) /* rm == 1: a vector's 8 quads at a time */
            for (int c = 0; c < rn; c++) {
                __m256i w[8];
                q8_quads_raw(raw + c * 8 * row_bytes, row_bytes, b, kind, w);
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
                    int32_t x4;
                    memcpy(&x4, qb + 4 * t, 4);
                    const __m256i x = _mm256_set1_epi32(x4);
                    if (kind == Q8_SMALL) {
                        lo[0][c] = _mm256_add_epi16(lo[0][c], _mm256_maddubs_epi16(w[t], x));
                    } else {
                        const __m256i wl = _mm256_and_si256(w[t], low);
                        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(w[t], 4), low);
                        lo[0][c] = _mm256_add_epi16(lo[0][c], _mm256_maddubs_epi16(wl, x));
                        hi[0][c] = _mm256_add_epi16(hi[0][c], _mm256_maddubs_epi16(wh, x));
                    }
                }
            }
        else
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m256i wl[Q8_RN], wh[Q8_RN];
            for (int c = 0; c < rn; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + t * tstride + c * 32));
                if (kind == Q8_SMALL) {
                    wl[c] = w;
                } else {
                    wl[c] = _mm256_and_si256(w, low);
                    wh[c] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                }
            }
            for (int m = 0; m < rm; m++) {
                int32_t x4;
                memcpy(&x4, qb + m * K + 4 * t, 4);
                const __m256i x = _mm256_set1_epi32(x4);
                for (int c = 0; c < rn; c++) {
                    lo[m][c] = _mm256_add_epi16(lo[m][c], _mm256_maddubs_epi16(wl[c], x));
                    if (kind == Q8_BYTE)
                        hi[m][c] = _mm256_add_epi16(hi[m][c], _mm256_maddubs_epi16(wh[c], x));
                }
            }
        }
        for (int m = 0; m < rm; m++)
            for (int c = 0; c < rn; c++) {
                dot[m][c] = _mm256_madd_epi16(lo[m][c], _mm256_set1_epi16(1));
                if (kind == Q8_BYTE)
                    dot[m][c] = _mm256_add_epi32(dot[m][c],
                                                 _mm256_madd_epi16(hi[m][c], _mm256_set1_epi16(16)));
            }
#endif
        const float *s = sc + (b / subs) * Q8_PANEL;
        for (int m = 0; m < rm; m++) {
            const __m256 dm = _mm256_set1_ps(d[m * nb + b]);
            for (int c = 0; c < rn; c++) {
                const __m256 ds = _mm256_mul_ps(dm, _mm256_loadu_ps(s + c * 8));
                acc[m][c] = _mm256_add_ps(acc[m][c], _mm256_mul_ps(_mm256_cvtepi32_ps(dot[m][c]), ds));
            }
        }
    }
    __m256 e[Q8_RM][Q8_RN];
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < rn; c++) e[m][c] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < g; gi++)
        for (int c = 0; c < rn; c++) {
            const __m256 bv = _mm256_loadu_ps(bi + gi * Q8_PANEL + c * 8);
            for (int m = 0; m < rm; m++)
                e[m][c] = _mm256_add_ps(e[m][c], _mm256_mul_ps(bv, _mm256_set1_ps(xs[m * g + gi])));
        }
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < rn; c++)
            _mm256_storeu_ps(f + m * Q8_PANEL + c * 8, _mm256_add_ps(acc[m][c], e[m][c]));
}

#ifdef Q8_ZMM
/* Several rows by up to Q8_PANEL columns with 512-bit vectors (16 columns each; AVX-512
 * VNNI): the packed panel holds a (block, quad)'s columns contiguously, so two of its
 * 8-column vectors are one 64-byte load, and scales, biases and results are per column
 * too. nz vectors of 16 columns, the last one `last_cols` wide (8 or 16; masked loads give
 * zeros past the panel). The same integer dot products and float32 operations per column
 * as q8_tile, so the same bits: a prompt's rows run twice the columns per instruction. */
static inline __attribute__((always_inline)) void q8_tile_zmm(const uint8_t *pw, int nv,
                                                              const int8_t *q, int64_t K,
                                                              const float *d, int64_t nb,
                                                              const float *sc, const float *bi,
                                                              const float *xs, int64_t g,
                                                              int subs, float *f, const int rm,
                                                              const int nz, int last_cols) {
    const int64_t tstride = (int64_t)nv * 32;
    __mmask16 mask[3]; /* lanes of each vector inside the panel */
    for (int c = 0; c < nz; c++) mask[c] = c < nz - 1 || last_cols == 16 ? 0xFFFF : 0x00FF;
    __m512 acc[Q8_RM][3];
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < nz; c++) acc[m][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = pw + b * 8 * tstride;
        const int8_t *qb = q + b * 32;
        __m512i dot[Q8_RM][3];
        for (int m = 0; m < rm; m++)
            for (int c = 0; c < nz; c++) dot[m][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m512i w[3];
            for (int c = 0; c < nz; c++)
                w[c] = _mm512_maskz_loadu_epi32(mask[c], wb + t * tstride + c * 64);
            for (int m = 0; m < rm; m++) {
                int32_t x4;
                memcpy(&x4, qb + m * K + 4 * t, 4);
                const __m512i x = _mm512_set1_epi32(x4);
                for (int c = 0; c < nz; c++) dot[m][c] = _mm512_dpbusd_epi32(dot[m][c], w[c], x);
            }
        }
        const float *s = sc + (b / subs) * Q8_PANEL;
        for (int m = 0; m < rm; m++) {
            const __m512 dm = _mm512_set1_ps(d[m * nb + b]);
            for (int c = 0; c < nz; c++) {
                const __m512 ds = _mm512_mul_ps(dm, _mm512_maskz_loadu_ps(mask[c], s + c * 16));
                const __m512 prod = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][c]), ds);
                acc[m][c] = _mm512_add_ps(acc[m][c], prod);
            }
        }
    }
    __m512 e[Q8_RM][3];
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < nz; c++) e[m][c] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < g; gi++)
        for (int c = 0; c < nz; c++) {
            const __m512 bv = _mm512_maskz_loadu_ps(mask[c], bi + gi * Q8_PANEL + c * 16);
            for (int m = 0; m < rm; m++)
                e[m][c] = _mm512_add_ps(e[m][c], _mm512_mul_ps(bv, _mm512_set1_ps(xs[m * g + gi])));
        }
    for (int m = 0; m < rm; m++)
        for (int c = 0; c < nz; c++)
            _mm512_storeu_ps(f + m * Q8_PANEL + c * 16, _mm512_add_ps(acc[m][c], e[m][c]));
}
#endif
