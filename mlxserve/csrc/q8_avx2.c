/* q8_impl.h with AVX2 integer dot products (vpmaddubsw); compiled with -mavx2 -mfma -mf16c. */
#include "qmm.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_ENTRY mlxserve_q8_avx2
#define Q8_RN 2
#define Q8_RN_BYTE 1 /* bytes split into two nibble sums: 16 registers hold one vector */
#include "q8_x86.h"
const int mlxserve_q8_built_avx2 = 1;

#else /* not this architecture, or the compiler lacks the flags: never called */
const int mlxserve_q8_built_avx2 = 0;
void mlxserve_q8_avx2(const q8_problem *q) { (void)q; }
#endif
