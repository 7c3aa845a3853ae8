/* q8_impl.h with AVX-512 VNNI's vpdpbusd on 256-bit vectors (AVX-512VL: a block of 32
 * weights is one register, as in llama.cpp); compiled with -mavx512f -mavx512vl
 * -mavx512vnni -mavx2 -mfma -mf16c. */
#include "qmm.h"

#if defined(__x86_64__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#define Q8_ENTRY mlxserve_q8_avx512vnni
#define Q8_DPBUSD _mm256_dpbusd_epi32
#define Q8_RN 3
#define Q8_ZMM 1 /* items of several rows: 512-bit tiles (q8_tile_zmm), the panel's 48 columns */
#include "q8_x86.h"
const int mlxserve_q8_built_avx512vnni = 1;

#else /* not this architecture, or the compiler lacks the flags: never called */
const int mlxserve_q8_built_avx512vnni = 0;
void mlxserve_q8_avx512vnni(const q8_problem *q) { (void)q; }
#endif
