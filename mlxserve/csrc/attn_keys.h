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
// No function here takes or returns a vector by value: clang refuses such a call in the
// target clones without AVX-512 ("changes the ABI"), even always inlined. Loads are
// macros, results are written through references or pointers.
// Half of the keys: 8 lanes, one 256-bit register on AVX2. GCC lowers 16-lane vector
// arithmetic and element access on AVX2 through the stack (each scalar broadcast as 16
// stores and a reload): every loop here runs on halves.
typedef float Half __attribute__((vector_size(8 * sizeof(float))));
#define MLXSERVE_HALF(x)                   \
  __extension__({                          \
    Half half_;                            \
    std::memcpy(&half_, (x), sizeof half_); \
    half_;                                 \
  })
// out[j] = (the dot product of q and key j) * scale, for the kKeys keys.
__attribute__((always_inline)) inline void dots(const float* q, const float* kt, int n,
                                                float scale, float* out) {
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
    const Half r = (c[0] + tail) * scale;
    std::memcpy(out + h * 8, &r, sizeof r);
  }
}

// exp(x) for x <= 0 (a score minus its row's maximum), lane by lane, each one fixed sequence
// of rounded float32 operations on every instruction set (no fused multiply-add, no libm):
// x = n ln2 + r with n = x log2(e) rounded to nearest (by adding and subtracting 1.5 * 2^23)
// and r = x - n * C1 - n * C2 (C1 + C2 = ln2, C1 short enough that n * C1 is exact), then
// Cephes' expf polynomial 1 + r + r^2 P(r) times 2^n built in the exponent bits: within 1
// ulp of exp (tests/test_paged_attention_tiles.py). Below -87 it is 0 (the float32 exp
// there is under 2^-125 of the row's maximum term); NaN stays NaN; x is taken as at most 88.
// On 8-lane halves, one AVX2 register (16-lane arithmetic went through the stack there).
typedef int32_t HalfInts __attribute__((vector_size(8 * sizeof(int32_t))));
// Lane by lane, a where mask (a comparison's all-ones lanes), else b: bit selects, as GCC
// and clang both compile vector comparisons and casts (no vector ?: needed).
#define MLXSERVE_PICK(mask, a, b) \
  ((Half)(((mask) & (HalfInts)(a)) | (~(mask) & (HalfInts)(b))))
// x replaced by exp(x), lane by lane.
__attribute__((always_inline)) inline void exp_half(Half& x) {
  const Half lo = MLXSERVE_PICK(x < -87.0f, Half{} - 87.0f, x);
  const Half xc = MLXSERVE_PICK(lo > 88.0f, Half{} + 88.0f, lo);
  const Half n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;
  Half r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  Half poly = r * 1.9875691500e-4f + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const Half y = (poly * (r * r) + r) + 1.0f;
  const HalfInts bits = (__builtin_convertvector(n, HalfInts) + 127) << 23;
  Half two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  const Half e = MLXSERVE_PICK(x < -87.0f, Half{}, y * two_n);
  x = MLXSERVE_PICK(x != x, x, e);
}

// One row's softmax numerators in place over s[0, n) (its keys), and their sum plus the
// sink's: the maximum (any order gives the same value), then exp_half of s - max, summed
// in kKeys partial sums (key k into sum k % kKeys, in order: keys 0-7 of each sixteen in
// one half, 8-15 in the other; a short last group padded with zeros), halved 8/4/2/1. The
// same sequence alone or in any tile.
__attribute__((always_inline)) inline float softmax_numerators(float* s, int n, const float* sink) {
  Half mlo = Half{} - INFINITY, mhi = mlo;
  int j = 0;
  for (; j + kKeys <= n; j += kKeys) {
    const Half lo = MLXSERVE_HALF(s + j), hi = MLXSERVE_HALF(s + j + 8);
    mlo = MLXSERVE_PICK(lo > mlo, lo, mlo);  // a NaN score is skipped, as std::max(m, s)
    mhi = MLXSERVE_PICK(hi > mhi, hi, mhi);  // skips it
  }
  float lanes[kKeys];
  std::memcpy(lanes, &mlo, sizeof mlo);
  std::memcpy(lanes + 8, &mhi, sizeof mhi);
  float m = -INFINITY;
  for (int u = 0; u < kKeys; u++) m = std::max(m, lanes[u]);
  for (int t = j; t < n; t++) m = std::max(m, s[t]);
  if (sink) m = std::max(m, *sink);
  Half slo = {}, shi = {};
  for (j = 0; j + kKeys <= n; j += kKeys) {
    Half elo = MLXSERVE_HALF(s + j) - m, ehi = MLXSERVE_HALF(s + j + 8) - m;
    exp_half(elo);
    exp_half(ehi);
    std::memcpy(s + j, &elo, sizeof elo);
    std::memcpy(s + j + 8, &ehi, sizeof ehi);
    slo += elo;
    shi += ehi;
  }
  if (j < n) {  // the last keys, padded with zeros that add nothing
    const int jn = n - j;
    float x[kKeys] = {};
    std::memcpy(x, s + j, sizeof(float) * jn);
    Half elo = MLXSERVE_HALF(x) - m, ehi = MLXSERVE_HALF(x + 8) - m;
    exp_half(elo);
    exp_half(ehi);
    const HalfInts lane = {0, 1, 2, 3, 4, 5, 6, 7};
    slo += MLXSERVE_PICK(lane < jn, elo, Half{});
    shi += MLXSERVE_PICK(lane + 8 < jn, ehi, Half{});
    std::memcpy(x, &elo, sizeof elo);
    std::memcpy(x + 8, &ehi, sizeof ehi);
    std::memcpy(s + j, x, sizeof(float) * jn);
  }
  const Half sum8 = slo + shi;
  float sum[8];
  std::memcpy(sum, &sum8, sizeof sum);
  for (int w = 4; w >= 1; w /= 2)
    for (int u = 0; u < w; u++) sum[u] += sum[u + w];
  if (sink) {
    Half e = Half{} + (*sink - m);
    exp_half(e);
    float e0;
    std::memcpy(&e0, &e, sizeof e0);
    sum[0] += e0;
  }
  return sum[0];
}

// a[0, B * 16) += w[j] * v[j][same] for keys j in [ja, jb) in order (v[j]: key j's values
// from the same offset): 2B independent sums of 8 elements per key, each element's the same
// sequence as one at a time.
template <int B>
__attribute__((always_inline)) inline void weighted_values(const float* w, int ja, int jb,
                                                           const float* const* v, int offset,
                                                           float* a) {
  Half sum[2 * B];
  for (int b = 0; b < 2 * B; b++) sum[b] = MLXSERVE_HALF(a + b * 8);
  for (int j = ja; j < jb; j++) {
    const float wj = w[j];
    const float* vj = v[j] + offset;
    for (int b = 0; b < 2 * B; b++) sum[b] += wj * MLXSERVE_HALF(vj + b * 8);
  }
  std::memcpy(a, sum, sizeof sum);
}

#if defined(__clang__)
#define MLXSERVE_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MLXSERVE_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, HalfInts{__VA_ARGS__})
#endif

// 8 rows of 8 floats (r[j], from rows[j] + i) into out[m * stride + j] = rows[j][i + m]:
// AVX2's three rounds (interleave pairs within 128-bit lanes, pick pairs of pairs, swap
// lane halves), one instruction each there.
__attribute__((always_inline)) inline void transpose8(const float* const* rows, int i,
                                                      float* out, int stride) {
  Half r[8], t[8];
  for (int j = 0; j < 8; j++) r[j] = MLXSERVE_HALF(rows[j] + i);
  for (int j = 0; j < 8; j += 2) {
    t[j] = MLXSERVE_SHUFFLE(r[j], r[j + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[j + 1] = MLXSERVE_SHUFFLE(r[j], r[j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int j = 0; j < 8; j += 4) {
    r[j] = MLXSERVE_SHUFFLE(t[j], t[j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    r[j + 1] = MLXSERVE_SHUFFLE(t[j], t[j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    r[j + 2] = MLXSERVE_SHUFFLE(t[j + 1], t[j + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    r[j + 3] = MLXSERVE_SHUFFLE(t[j + 1], t[j + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int m = 0; m < 4; m++) {
    t[m] = MLXSERVE_SHUFFLE(r[m], r[m + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    t[m + 4] = MLXSERVE_SHUFFLE(r[m], r[m + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int m = 0; m < 8; m++) std::memcpy(out + static_cast<size_t>(m) * stride, &t[m], sizeof t[m]);
}
#undef MLXSERVE_SHUFFLE

// kKeys rows of d floats (rows[j]) into kt[i * kKeys + j]: 8 x 8 blocks transposed in
// registers, the rest one value at a time.
__attribute__((always_inline)) inline void transpose_keys(const float* const* rows, int d,
                                                          float* kt) {
  int i = 0;
  for (; i + 8 <= d; i += 8)
    for (int h = 0; h < kKeys; h += 8)
      transpose8(rows + h, i, kt + static_cast<size_t>(i) * kKeys + h, kKeys);
  for (; i < d; i++)
    for (int j = 0; j < kKeys; j++) kt[i * kKeys + j] = rows[j][i];
}

}  // namespace mlxserve_decode
