// The paged attention's per-row arithmetic on 16 keys at a time (attn_ext.cpp): the dot
// products of a query with transposed keys, the softmax's numerators and sum, the values'
// weighted sums, the keys' transpose. GCC/clang vector extensions, so every instruction
// set the work items are compiled for runs the same float32 operations in the same order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace mlxserve_decode {

// Dot products of one query with kKeys keys at once, keys transposed (kt[d * kKeys + j]),
// vectorized across the keys. Per key it is one fixed sequence of rounded operations (16
// partial sums over d, halved 8/4/2/1, plus the tail), the one a single row always used.
constexpr int kKeys = 16;
typedef float Keys __attribute__((vector_size(kKeys * sizeof(float))));  // one per key
// No function here takes or returns a Keys by value: clang refuses such a call in the
// target clones without AVX-512 ("changes the ABI"), even always inlined. Loads are
// macros, results are written through references.
// 16 floats from x (unaligned).
#define MLXSERVE_LANES(x)                   \
  __extension__({                           \
    Keys lanes_;                            \
    std::memcpy(&lanes_, (x), sizeof lanes_); \
    lanes_;                                 \
  })
#define MLXSERVE_KEY_LANES(kt, d) MLXSERVE_LANES((kt) + static_cast<size_t>(d) * kKeys)
// Half of the keys: 8 lanes, one 256-bit register on AVX2. GCC lowers the 16-lane Keys
// arithmetic on AVX2 through the stack (each scalar broadcast as 16 stores and a reload):
// the loops below run on halves, every lane the same operations in the same order.
typedef float Half __attribute__((vector_size(8 * sizeof(float))));
#define MLXSERVE_HALF(x)                   \
  __extension__({                          \
    Half half_;                            \
    std::memcpy(&half_, (x), sizeof half_); \
    half_;                                 \
  })
__attribute__((always_inline)) inline void dots(const float* q, const float* kt, int n,
                                                Keys& out) {
  const int n16 = n >= 16 ? n / 16 * 16 : 0;
  for (int h = 0; h < 2; h++) {  // keys 0-7, then 8-15
    const float* k = kt + h * 8;
    // Partial sum u: 0 + q[u] k[u] + q[u + 16] k[u + 16] + ... over the whole sixteens,
    // then halved 8/4/2/1 (c[u] = sum u + sum u + 8, ...): summed pairwise as made, so
    // at most 8 are alive (no spills), each the sequence a 16-lane loop did.
    Half c[8];
    for (int u = 0; u < 8; u++) {
      Half lo = {}, hi = {};
      if (n16) {
        lo = Half{} + q[u] * MLXSERVE_HALF(k + static_cast<size_t>(u) * kKeys);
        hi = Half{} + q[u + 8] * MLXSERVE_HALF(k + static_cast<size_t>(u + 8) * kKeys);
        for (int i = 16; i < n16; i += 16) {
          lo += q[i + u] * MLXSERVE_HALF(k + static_cast<size_t>(i + u) * kKeys);
          hi += q[i + u + 8] * MLXSERVE_HALF(k + static_cast<size_t>(i + u + 8) * kKeys);
        }
      }
      c[u] = lo + hi;
    }
    Half tail = {};
    for (int i = n16; i < n; i++) tail += q[i] * MLXSERVE_HALF(k + static_cast<size_t>(i) * kKeys);
    for (int w = 4; w >= 1; w /= 2)
      for (int u = 0; u < w; u++) c[u] += c[u + w];
    const Half r = c[0] + tail;
    std::memcpy(reinterpret_cast<float*>(&out) + h * 8, &r, sizeof r);
  }
}

// exp(x) for x <= 0 (a score minus its row's maximum), kKeys lanes, each one fixed sequence
// of rounded float32 operations on every instruction set (no fused multiply-add, no libm):
// x = n ln2 + r with n = x log2(e) rounded to nearest (by adding and subtracting 1.5 * 2^23)
// and r = x - n * C1 - n * C2 (C1 + C2 = ln2, C1 short enough that n * C1 is exact), then
// Cephes' expf polynomial 1 + r + r^2 P(r) times 2^n built in the exponent bits: within 1
// ulp of exp (tests/test_paged_attention_tiles.py). Below -87 it is 0 (the float32 exp
// there is under 2^-125 of the row's maximum term); NaN stays NaN; x is taken as at most 88.
typedef int32_t KeyInts __attribute__((vector_size(kKeys * sizeof(int32_t))));
// Lane by lane, a where mask (a comparison's all-ones lanes), else b: bit selects, as GCC
// and clang both compile vector comparisons and casts (no vector ?: needed).
#define MLXSERVE_PICK(mask, a, b) \
  ((Keys)(((mask) & (KeyInts)(a)) | (~(mask) & (KeyInts)(b))))
// x replaced by exp(x), lane by lane.
__attribute__((always_inline)) inline void exp_keys(Keys& x) {
  const Keys lo = MLXSERVE_PICK(x < -87.0f, Keys{} - 87.0f, x);
  const Keys xc = MLXSERVE_PICK(lo > 88.0f, Keys{} + 88.0f, lo);
  const Keys n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;
  Keys r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  Keys poly = r * 1.9875691500e-4f + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const Keys y = (poly * (r * r) + r) + 1.0f;
  const KeyInts bits = (__builtin_convertvector(n, KeyInts) + 127) << 23;
  Keys two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  const Keys e = MLXSERVE_PICK(x < -87.0f, Keys{}, y * two_n);
  x = MLXSERVE_PICK(x != x, x, e);
}

// One row's softmax numerators in place over s[0, n) (its keys), and their sum plus the
// sink's: the maximum (any order gives the same value), then exp_keys of s - max, summed
// in kKeys partial sums (key k into sum k % kKeys, in order; a short last group padded with
// zeros), halved 8/4/2/1. The same sequence alone or in any tile.
__attribute__((always_inline)) inline float softmax_numerators(float* s, int n, const float* sink) {
  Keys mv = Keys{} - INFINITY;
  int j = 0;
  for (; j + kKeys <= n; j += kKeys) {
    const Keys v = MLXSERVE_LANES(s + j);
    mv = MLXSERVE_PICK(v > mv, v, mv);  // a NaN score is skipped, as std::max(m, s) skips it
  }
  float m = -INFINITY;
  for (int u = 0; u < kKeys; u++) m = std::max(m, mv[u]);
  for (; j < n; j++) m = std::max(m, s[j]);
  if (sink) m = std::max(m, *sink);
  const KeyInts lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Keys sum = {};
  for (j = 0; j + kKeys <= n; j += kKeys) {
    Keys e = MLXSERVE_LANES(s + j) - m;
    exp_keys(e);
    std::memcpy(s + j, &e, sizeof e);
    sum += e;
  }
  if (j < n) {  // the last keys, padded
    const int jn = n - j;
    Keys x = {};
    for (int u = 0; u < jn; u++) x[u] = s[j + u];
    Keys e = x - m;
    exp_keys(e);
    for (int u = 0; u < jn; u++) s[j + u] = e[u];
    sum += MLXSERVE_PICK(lane < jn, e, Keys{});
  }
  for (int w = kKeys / 2; w >= 1; w /= 2)
    for (int u = 0; u < w; u++) sum[u] += sum[u + w];
  if (sink) {
    Keys e = Keys{} + (*sink - m);
    exp_keys(e);
    sum[0] += e[0];
  }
  return sum[0];
}

// a[0, B * kKeys) += w[j] * v[j][same] for keys j in [ja, jb) in order (v rows dv apart):
// 2B independent sums of 8 elements per key, each element's the same sequence as one at a time.
template <int B>
__attribute__((always_inline)) inline void weighted_values(const float* w, int ja, int jb,
                                                           const float* v, int dv, float* a) {
  Half sum[2 * B];
  for (int b = 0; b < 2 * B; b++) sum[b] = MLXSERVE_HALF(a + b * 8);
  for (int j = ja; j < jb; j++) {
    const float wj = w[j];
    const float* vj = v + static_cast<size_t>(j) * dv;
    for (int b = 0; b < 2 * B; b++) sum[b] += wj * MLXSERVE_HALF(vj + b * 8);
  }
  std::memcpy(a, sum, sizeof sum);
}

// Lanes 0-7 (lo) or 8-15 (hi) of a and b interleaved: a0 b0 a1 b1 ...
#if defined(__clang__)
#define MLXSERVE_LO(a, b) \
  __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
#define MLXSERVE_HI(a, b) \
  __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31)
#else
#define MLXSERVE_LO(a, b) \
  __builtin_shuffle(a, b, KeyInts{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23})
#define MLXSERVE_HI(a, b) \
  __builtin_shuffle(a, b, KeyInts{8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31})
#endif

// kKeys rows of d floats (rows[j]) into kt[i * kKeys + j]: 16 x 16 blocks transposed in
// registers (four rounds of interleaving rows i and i + 8), the rest one value at a time.
__attribute__((always_inline)) inline void transpose_keys(const float* const* rows, int d,
                                                          float* kt) {
  int i = 0;
  for (; i + kKeys <= d; i += kKeys) {
    Keys r[kKeys], next[kKeys];
    for (int j = 0; j < kKeys; j++) r[j] = MLXSERVE_LANES(rows[j] + i);
    for (int round = 0; round < 4; round++) {
      for (int j = 0; j < kKeys / 2; j++) {
        next[2 * j] = MLXSERVE_LO(r[j], r[j + kKeys / 2]);
        next[2 * j + 1] = MLXSERVE_HI(r[j], r[j + kKeys / 2]);
      }
      std::memcpy(r, next, sizeof r);
    }
    std::memcpy(kt + static_cast<size_t>(i) * kKeys, r, sizeof r);
  }
  for (; i < d; i++)
    for (int j = 0; j < kKeys; j++) kt[i * kKeys + j] = rows[j][i];
}
#undef MLXSERVE_LO
#undef MLXSERVE_HI

}  // namespace mlxserve_decode
