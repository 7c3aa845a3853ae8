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
 * batches). Instruction sets are chosen at run time (x86: AVX-512F, AVX2+FMA; Arm:
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
} qmm_problem;

/* 0 on success; -1 for an unsupported problem (bits not 2, 3, 4, 5, 6 or 8, group size
 * not a multiple of 32, K not a multiple of the group size). */
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

/* Work spread over the pool (used by the per-instruction-set files). */
typedef void (*qmm_work_fn)(void *ctx, int64_t item);
void mlxserve_qmm_parallel_for(int64_t n_items, qmm_work_fn fn, void *ctx);

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
