/* An sgemm that sends matrix-vector products to sgemv.
 *
 * MLX's CPU backend computes every float32 matmul with cblas_sgemm. OpenBLAS's sgemm
 * packs the whole weight matrix before multiplying, which for a single row of
 * activations (one decoding request) costs more than the product: sgemv reads the
 * weights once, ~3-4x faster for M = 1. mlxserve/blas.py points libmlx's cblas_sgemm
 * slot at mlxserve_sgemm; everything that is not a matrix-vector product goes to the
 * real sgemm, bound by mlxserve_bind() (cblas_sgemm or scipy_cblas_sgemm, same ABI).
 */
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

static sgemm_fn real_sgemm = 0;
static sgemv_fn real_sgemv = 0;
static long num_gemv_calls = 0;

void mlxserve_bind(void *sgemm, void *sgemv) {
    real_sgemm = (sgemm_fn)sgemm;
    real_sgemv = (sgemv_fn)sgemv;
}

long mlxserve_num_gemv_calls(void) { return num_gemv_calls; }

void mlxserve_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    if (order == ROW_MAJOR && m == 1 && n > 1 && k > 0 && real_sgemv) {
        /* c (1, n) = a (1, k) @ op(b) (k, n): y = op(b)^T x with x = a's row. */
        if (beta == 0.0f) memset(c, 0, sizeof(float) * (size_t)n); /* c may be garbage */
        int x_inc = trans_a == NO_TRANS ? 1 : lda;
        if (trans_b == TRANS) /* b stored (n, k): y = b @ x */
            real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, x_inc, beta, c, 1);
        else /* b stored (k, n): y = b^T @ x */
            real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, x_inc, beta, c, 1);
        num_gemv_calls++;
        return;
    }
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
