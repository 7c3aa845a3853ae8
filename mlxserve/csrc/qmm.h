/* Quantized matmul kernels for the CPU over MLX's affine-quantized weights.
 *
 * y (M, N) = x (M, K) @ dequantize(w)^T, where row n of w holds K values of `bits` bits
 * packed little-endian into uint32 words (value k at bit (k * bits) % 32 of word
 * k * bits / 32), and value k of row n dequantizes to
 *     q * scales[n, k / group_size] + biases[n, k / group_size].
 * This is the layout of mx.quantize(..., mode="affine") and nn.QuantizedLinear.
 *
 * The weights are never expanded in memory: a GEMV reads them once per call and
 * dequantizes in registers (M <= a few rows: decoding); a blocked GEMM dequantizes a
 * panel of rows into a per-thread buffer and multiplies it with all of x (prefill and
 * batches). With int8 activations (act_bits 8, below) one blocked integer kernel serves
 * every M. Instruction sets are chosen at run time (x86: AVX-512F, AVX2+FMA; Arm:
 * NEON; a portable C path otherwise) and work is spread over a small thread pool.
 */
#ifndef MLXSERVE_QMM_H
#define MLXSERVE_QMM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { QMM_SCALAR = 0, QMM_AVX2 = 1, QMM_AVX512 = 2, QMM_NEON = 3, QMM_NUM_ISAS = 4 };
enum { QMM_F32 = 0, QMM_F16 = 1, QMM_BF16 = 2 }; /* dtype of scales and biases */

typedef struct {
    const float *x;      /* (M, K) row-major */
    const uint32_t *w;   /* (N, K * bits / 32) */
    const void *scales;  /* (N, K / group_size), scale_type */
    const void *biases;  /* (N, K / group_size), scale_type */
    float *y;            /* (M, N) row-major */
    int64_t M, N, K;
    int group_size, bits, scale_type;
    int act_bits; /* 0: x as given (float32); 8: x rounded to int8 per block, see below */
} qmm_problem;

/* 0 on success; -1 for an unsupported problem (bits not 2, 3, 4, 5, 6 or 8, group size
 * not a multiple of 32, K not a multiple of the group size, act_bits not 0 or 8). */
int mlxserve_qmm(const qmm_problem *p);

/* The instruction set in use; force one (returns 0, or -1 if this CPU/build lacks it);
 * QMM_NUM_ISAS restores the automatic choice. */
int mlxserve_qmm_isa(void);
int mlxserve_qmm_isa_supported(int isa);
int mlxserve_qmm_force_isa(int isa);
const char *mlxserve_qmm_isa_name(int isa);

/* Threads used per call (the caller included); n <= 0 restores the default (the CPUs
 * this process may run on). Returns the count now in effect. */
int mlxserve_qmm_set_threads(int n);
int mlxserve_qmm_threads(void);

/* The pool's tuning (bench/gemv_shapes.py interleaves settings in one process); each
 * setter returns the previous value, and a negative argument only reads it.
 * Claims: a thread takes (items left) / (claim_div * threads) items at once (at least
 * one, at most 8), so a call of many small items costs fewer claims than one contended
 * atomic per item and a thread's items are mostly consecutive, and the last claims stay
 * single items for balance; 0: always one item. Default 2.
 * Spin: how long (nanoseconds) the workers spin for the next call before sleeping. */
long mlxserve_qmm_set_claim_div(long div);
long mlxserve_qmm_set_spin_ns(long ns);

/* Work spread over the pool (used by the per-instruction-set files). */
typedef void (*qmm_work_fn)(void *ctx, int64_t item);
void mlxserve_qmm_parallel_for(int64_t n_items, qmm_work_fn fn, void *ctx);

/* ---------------------------------------------------------------- int8 activations
 *
 * With act_bits == 8 the result is x' @ dequantize(w)^T, where x' is x rounded to 8 bits
 * per block of 32 values (llama.cpp's Q8_0 rounding, in spirit). For row m and block b
 * (values k = 32 b .. 32 b + 31 of the row), all in float32:
 *     amax = max |x_k|;  id = 127 / amax;  q_k = rint(x_k * id) (nearest, ties to even,
 *     clamped to [-127, 127]);  d_b = amax / 127;  x'_k = d_b * q_k
 * (amax == 0: d_b = 0 and q = 0; a non-finite amax: q = 0 and d_b = amax / 127, so the
 * outputs become NaN as a float matmul's would). One blocked integer matmul computes it
 * for any number of rows (q8_impl.h: int8 x weight-byte dot products per block, then a
 * fixed sequence of float32 operations per output), so a row gets the same bits alone, in
 * a batch, or in a prompt's chunk, and every instruction set gives the same bits. */
enum { Q8_SCALAR = 0, Q8_AVX2 = 1, Q8_AVXVNNI = 2, Q8_AVX512VNNI = 3, Q8_NEON = 4, Q8_NUM_ISAS = 5 };

/* Rounds the rows of x (M, K) as above: q (M, K) int8, d (M, K / 32) and dsum (M, K / 32)
 * = d_b * sum_k q_k (float32). perm4: store each block's q in the 4-bit kernels' order
 * (the block's even values, then its odd values) instead of in order. */
void mlxserve_q8_quantize(const float *x, int64_t M, int64_t K, int perm4, int8_t *q, float *d,
                          float *dsum);

/* The integer matmul's instruction set: in use, supported, forced (Q8_NUM_ISAS: automatic),
 * named; as for the float kernels. */
int mlxserve_q8_isa(void);
int mlxserve_q8_isa_supported(int isa);
int mlxserve_q8_force_isa(int isa);
const char *mlxserve_q8_isa_name(int isa);

typedef struct {
    const qmm_problem *p;
    const int8_t *q;      /* x rounded (mlxserve_q8_quantize), perm4 when bits == 4 */
    const float *d, *dsum;
} q8_problem;

void mlxserve_q8_scalar(const q8_problem *q);
void mlxserve_q8_avx2(const q8_problem *q);
void mlxserve_q8_avxvnni(const q8_problem *q);
void mlxserve_q8_avx512vnni(const q8_problem *q);
void mlxserve_q8_neon(const q8_problem *q);
extern const int mlxserve_q8_built_avx2, mlxserve_q8_built_avxvnni, mlxserve_q8_built_avx512vnni,
    mlxserve_q8_built_neon;

/* SwiGLU's elementwise part over rows of a fused gate|up product: act (rows, hidden) =
 * (g * sigmoid(g)) * up for gu (rows, 2 * hidden) = [g | up], the same bits as MLX's CPU
 * ops give (swiglu.c), on the thread pool. */
void mlxserve_swiglu(const float *gu, int64_t rows, int64_t hidden, float *act);

/* Per-instruction-set entry points (qmm_impl.h instantiated in qmm_<isa>.c). */
void mlxserve_qmm_scalar(const qmm_problem *p);
void mlxserve_qmm_avx2(const qmm_problem *p);
void mlxserve_qmm_avx512(const qmm_problem *p);
void mlxserve_qmm_neon(const qmm_problem *p);
extern const int mlxserve_qmm_built_avx2, mlxserve_qmm_built_avx512, mlxserve_qmm_built_neon;

#ifdef __cplusplus
}
#endif

#endif
