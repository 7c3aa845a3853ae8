/* q8_impl.h with AVX-VNNI's vpdpbusd on 256-bit vectors (Alder Lake and later, without
 * AVX-512); compiled with -mavxvnni -mavx2 -mfma -mf16c. */
#include "qmm.h"

#if defined(__x86_64__) && defined(__AVXVNNI__) && defined(__FMA__) && defined(__F16C__)
#define Q8_ENTRY mlxserve_q8_avxvnni
#define Q8_DPBUSD _mm256_dpbusd_avx_epi32
#define Q8_RN 2
#include "q8_x86.h"
const int mlxserve_q8_built_avxvnni = 1;

#else /* not this architecture, or the compiler lacks the flags: never called */
const int mlxserve_q8_built_avxvnni = 0;
void mlxserve_q8_avxvnni(const q8_problem *q) { (void)q; }
#endif
