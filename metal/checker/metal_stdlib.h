// metal_stdlib.h -- a stand-in for Metal's <metal_stdlib> so kernel bodies compile as C++.
//
// Two modes, chosen by the checker:
//   MLXS_EMULATE   g++ -std=c++20: address spaces vanish, vector types are structs, and the
//                  simd/barrier builtins call into the fiber emulator (emu_runtime.cpp).
//   MLXS_AS_CHECK  clang -cc1 -fsyntax-only -std=c++14 (MSL is C++14-based): device/constant/
//                  threadgroup become __attribute__((address_space(N))) so a pointer that
//                  crosses address spaces is a compile error, as it is for Apple's compiler.
// Only what mlxserve's kernels use is provided; anything else is a compile error on purpose.
// The header includes no system headers: compiler builtins only.
#pragma once

#if !defined(MLXS_EMULATE) && !defined(MLXS_AS_CHECK)
#error "define MLXS_EMULATE or MLXS_AS_CHECK"
#endif

// ---- fixed-width integers (no <cstdint>) ------------------------------------------------
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __SIZE_TYPE__ size_t;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

// ---- emulator entry points (emu_runtime.cpp) -------------------------------------------
#if defined(MLXS_EMULATE)
extern "C" {
// Blocks until the simdgroup's active lanes arrive; returns every lane's value (32 slots of
// nbytes, valid until this lane's next collective), the active lanes in `mask`, this
// thread's lane in `lane`, and a 64-byte scratch slot shared by the lanes of this collective
// (`*fresh` is 1 for the first lane to ask) so a reduction is computed once, not per lane.
const void* mlxs_simd_exchange(const void* value, unsigned nbytes, unsigned* mask,
                               unsigned* lane, void** shared, int* fresh, const char* what,
                               const char* file, int line);
void mlxs_barrier(int simd_only, const char* file, int line);
unsigned mlxs_lane_id(void);  // the running thread's lane, without waiting for the others
void* mlxs_tg_alloc(const char* name, unsigned long nbytes, const char* file, int line);
}
#endif

// ---- address spaces ----------------------------------------------------------------------
#if defined(MLXS_AS_CHECK)
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#else
#define device
#define constant
#define threadgroup
#define thread
#endif
// Apple GPUs have no double; make any use of it a compile error.
#define double mlxs_metal_has_no_double_type

// Threadgroup arrays: the checker rewrites `threadgroup T name[N];` in a kernel body into this.
#if defined(MLXS_EMULATE)
#define MLXS_TG_VAR(T, name, dims)                                                       \
  typedef T mlxs_tg_type_##name dims;                                                    \
  mlxs_tg_type_##name& name = *reinterpret_cast<mlxs_tg_type_##name*>(                   \
      mlxs_tg_alloc(#name, sizeof(mlxs_tg_type_##name), __builtin_FILE(), __builtin_LINE()))
#else
#define MLXS_TG_VAR(T, name, dims) static threadgroup T name dims
#endif

// ---- half / bfloat -----------------------------------------------------------------------
typedef _Float16 half;

#if defined(MLXS_AS_CHECK)
typedef __bf16 bfloat;  // a builtin scalar, as in Metal, so it lives in any address space
#else
struct bfloat {  // g++ 12 has no __bf16 arithmetic: a storage type with float conversions
  uint16_t bits;
  bfloat() = default;
  explicit bfloat(float f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);  // quiet NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
      bits = uint16_t(u >> 16);
    }
  }
  explicit bfloat(int i) : bfloat(float(i)) {}
  explicit operator float() const { return __builtin_bit_cast(float, uint32_t(bits) << 16); }
};
#endif

typedef half float16_t;  // what MLX's generated signatures call these
typedef bfloat bfloat16_t;

// ---- vector types (subset: construction and .x .y .z .w) -------------------------------
#if defined(MLXS_AS_CHECK)
#define MLXS_VEC(T, name)                                         \
  typedef T name##2 __attribute__((ext_vector_type(2)));          \
  typedef T name##3 __attribute__((ext_vector_type(3)));          \
  typedef T name##4 __attribute__((ext_vector_type(4)));
#else
template <typename T, int N>
struct mlxs_vec;
template <typename T>
struct mlxs_vec<T, 2> {
  T x, y;
};
template <typename T>
struct alignas(4 * sizeof(T)) mlxs_vec<T, 3> {  // Metal's 3-vectors are padded to 4
  T x, y, z;
};
template <typename T>
struct mlxs_vec<T, 4> {
  T x, y, z, w;
};
#define MLXS_VEC(T, name)                 \
  typedef mlxs_vec<T, 2> name##2;          \
  typedef mlxs_vec<T, 3> name##3;          \
  typedef mlxs_vec<T, 4> name##4;
#endif
MLXS_VEC(float, float)
MLXS_VEC(half, half)
MLXS_VEC(int, int)
MLXS_VEC(uint, uint)
MLXS_VEC(short, short)
MLXS_VEC(ushort, ushort)
#undef MLXS_VEC

namespace metal {

// ---- math (float; half/bfloat go through float) -----------------------------------------
template <typename T>
inline T exp(T x) { return T(__builtin_expf(float(x))); }
template <typename T>
inline T exp2(T x) { return T(__builtin_exp2f(float(x))); }
template <typename T>
inline T log(T x) { return T(__builtin_logf(float(x))); }
template <typename T>
inline T sqrt(T x) { return T(__builtin_sqrtf(float(x))); }
template <typename T>
inline T rsqrt(T x) { return T(1.0f / __builtin_sqrtf(float(x))); }
template <typename T>
inline T abs(T x) { return x < T(0) ? -x : x; }
template <typename T>
inline T max(T a, T b) { return a < b ? b : a; }
template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float rint(float x) { return __builtin_rintf(x); }  // to nearest, ties to even

// fast:: variants (MSL's metal::fast namespace; float only on Apple GPUs). fast::exp is
// libm's exp moved by the error bound we take for fast-math exp -- (3 + floor(|2x|)) ulp,
// our reading of the MSL specification's fast-math accuracy table -- up or down depending
// on x's bits, so a kernel tested here must tolerate that worst case, not a correctly
// rounded exp (tests/test_metal_shim.py checks the model).
namespace fast {
inline float exp(float x) {
  float y = __builtin_expf(x);
  if (y > 0.0f && y <= __FLT_MAX__ && y >= __FLT_MIN__) {
    int e;
    __builtin_frexpf(y, &e);  // y in [2^(e-1), 2^e): one ulp is 2^(e-24)
    const float ulp = __builtin_ldexpf(1.0f, e - 24);
    const float ax = x < 0.0f ? -x : x;
    const float n = 3.0f + __builtin_floorf(ax < 1.0e6f ? 2.0f * ax : 2.0e6f);
    const unsigned bits = __builtin_bit_cast(unsigned, x) * 2654435761u;  // a hash of x
    y += ((bits >> 31) ? n : -n) * ulp;
  }
  return y;
}
}  // namespace fast

template <typename T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float infinity() { return __builtin_inff(); }
};
template <>
struct numeric_limits<int> {
  static constexpr int max() { return __INT_MAX__; }
  static constexpr int lowest() { return -__INT_MAX__ - 1; }
};

// ---- barriers ----------------------------------------------------------------------------
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

#if defined(MLXS_EMULATE)
inline void threadgroup_barrier(mem_flags, const char* file = __builtin_FILE(),
                                int line = __builtin_LINE()) {
  mlxs_barrier(0, file, line);
}
inline void simdgroup_barrier(mem_flags, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  mlxs_barrier(1, file, line);
}
#else
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
#endif

// ---- simdgroup collectives (32 lanes) ----------------------------------------------------
#if defined(MLXS_EMULATE)
namespace mlxs_detail {
template <typename T>
struct Lanes {
  const T* v;
  unsigned mask;
  unsigned me;
  T* shared;  // the collective's result, computed by the first lane that resumes
  int fresh;
};
template <typename T>
inline Lanes<T> exchange(T x, const char* what, const char* file, int line) {
  static_assert(sizeof(T) <= 64, "simd value too large");
  Lanes<T> l;
  void* shared;
  l.v = static_cast<const T*>(mlxs_simd_exchange(&x, sizeof(T), &l.mask, &l.me, &shared,
                                                 &l.fresh, what, file, line));
  l.shared = static_cast<T*>(shared);
  return l;
}
inline bool active(unsigned mask, unsigned lane) { return lane < 32 && ((mask >> lane) & 1u); }
template <typename T>
inline T poison() {
  T t;
  __builtin_memset(&t, 0xff, sizeof(T));  // NaN for floating types
  return t;
}
// Reading an inactive (or out-of-range) lane is undefined on the GPU: the emulator gives NaN.
template <typename T>
inline T lane_or_poison(const Lanes<T>& l, unsigned src) {
  return active(l.mask, src) ? l.v[src] : poison<T>();
}
// op folded over the active lanes in lane order from the first one, by the first lane to
// resume; every lane returns that one result.
template <typename T, typename Op>
inline T fold_active(T x, const char* what, const char* file, int line, Op op) {
  auto l = exchange(x, what, file, line);
  if (l.fresh) {
    T acc = l.v[__builtin_ctz(l.mask)];
    for (unsigned i = 0; i < 32; ++i)
      if (active(l.mask, i)) acc = op(acc, l.v[i]);
    *l.shared = acc;
  }
  return *l.shared;
}
}  // namespace mlxs_detail

#define MLXS_SITE const char *file = __builtin_FILE(), int line = __builtin_LINE()
// Reductions run in lane order, whichever lane computes them, so results are deterministic.
template <typename T>
inline T simd_sum(T x, MLXS_SITE) {
  auto l = mlxs_detail::exchange(x, "simd_sum", file, line);
  if (l.fresh) {
    T acc = T(0);
    for (unsigned i = 0; i < 32; ++i)
      if (mlxs_detail::active(l.mask, i)) acc = acc + l.v[i];
    *l.shared = acc;
  }
  return *l.shared;
}
template <typename T>
inline T simd_max(T x, MLXS_SITE) {
  return mlxs_detail::fold_active(x, "simd_max", file, line, [](T a, T b) { return max(a, b); });
}
template <typename T>
inline T simd_min(T x, MLXS_SITE) {
  return mlxs_detail::fold_active(x, "simd_min", file, line, [](T a, T b) { return min(a, b); });
}
template <typename T>
inline T simd_prefix_exclusive_sum(T x, MLXS_SITE) {
  auto l = mlxs_detail::exchange(x, "simd_prefix_exclusive_sum", file, line);
  T acc = T(0);
  for (unsigned i = 0; i < l.me; ++i)
    if (mlxs_detail::active(l.mask, i)) acc = acc + l.v[i];
  return acc;
}
template <typename T>
inline T simd_shuffle(T x, ushort lane, MLXS_SITE) {
  return mlxs_detail::lane_or_poison(mlxs_detail::exchange(x, "simd_shuffle", file, line), lane);
}
template <typename T>
inline T simd_broadcast(T x, ushort lane, MLXS_SITE) {
  return mlxs_detail::lane_or_poison(mlxs_detail::exchange(x, "simd_broadcast", file, line), lane);
}
template <typename T>
inline T simd_shuffle_down(T x, ushort delta, MLXS_SITE) {
  auto l = mlxs_detail::exchange(x, "simd_shuffle_down", file, line);
  unsigned src = l.me + delta;
  return src < 32 ? mlxs_detail::lane_or_poison(l, src) : x;
}
template <typename T>
inline T simd_shuffle_up(T x, ushort delta, MLXS_SITE) {
  auto l = mlxs_detail::exchange(x, "simd_shuffle_up", file, line);
  if (delta > l.me) return x;
  return mlxs_detail::lane_or_poison(l, l.me - delta);
}
template <typename T>
inline T simd_shuffle_xor(T x, ushort m, MLXS_SITE) {
  auto l = mlxs_detail::exchange(x, "simd_shuffle_xor", file, line);
  return mlxs_detail::lane_or_poison(l, l.me ^ m);
}
template <typename T>
inline T simd_broadcast_first(T x, MLXS_SITE) {
  auto l = mlxs_detail::exchange(x, "simd_broadcast_first", file, line);
  for (unsigned i = 0; i < 32; ++i)
    if (mlxs_detail::active(l.mask, i)) return l.v[i];
  return x;
}
inline bool simd_all(bool x, MLXS_SITE) {
  auto l = mlxs_detail::exchange(x, "simd_all", file, line);
  for (unsigned i = 0; i < 32; ++i)
    if (mlxs_detail::active(l.mask, i) && !l.v[i]) return false;
  return true;
}
inline bool simd_any(bool x, MLXS_SITE) {
  auto l = mlxs_detail::exchange(x, "simd_any", file, line);
  for (unsigned i = 0; i < 32; ++i)
    if (mlxs_detail::active(l.mask, i) && l.v[i]) return true;
  return false;
}
#undef MLXS_SITE
#else
template <typename T>
T simd_sum(T x);
template <typename T>
T simd_max(T x);
template <typename T>
T simd_min(T x);
template <typename T>
T simd_prefix_exclusive_sum(T x);
template <typename T>
T simd_shuffle(T x, ushort lane);
template <typename T>
T simd_broadcast(T x, ushort lane);
template <typename T>
T simd_shuffle_down(T x, ushort delta);
template <typename T>
T simd_shuffle_up(T x, ushort delta);
template <typename T>
T simd_shuffle_xor(T x, ushort mask);
template <typename T>
T simd_broadcast_first(T x);
bool simd_all(bool x);
bool simd_any(bool x);
#endif

// ---- simdgroup matrices (8x8 float, the subset our kernels use) ---------------------------
// An 8x8 matrix is spread over the 32 lanes of a simdgroup, two consecutive elements of one
// row per lane, in the layout MLX's kernels rely on (steel/gemm/mma.h): lane l holds row
// (l / 16) * 4 + (l / 2) % 4, columns ((l / 8) % 2) * 4 + (l % 2) * 2 and the next one.
// Every operation is a simdgroup collective: all 32 lanes must reach it together (a lane
// that exited makes every lane's result NaN, as the GPU's is undefined). A load reads
// memory when its lane arrives, a store writes when the lanes leave, so threadgroup data
// another lane wrote (or reads) needs a simdgroup_barrier in between, as on the GPU.
template <typename T, int COLS, int ROWS>
struct simdgroup_matrix {
#if defined(MLXS_EMULATE)
  T e[2] = {mlxs_detail::poison<T>(), mlxs_detail::poison<T>()};  // uninitialized: NaN
#else
  T e[2];
#endif
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

template <typename T, int COLS, int ROWS>
inline simdgroup_matrix<T, COLS, ROWS> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, COLS, ROWS> m;
  m.e[0] = value;
  m.e[1] = value;
  return m;
}

#if defined(MLXS_EMULATE)
namespace mlxs_detail {
inline int frag_row(unsigned lane) { return int((lane / 16) * 4 + (lane / 2) % 4); }
inline int frag_col(unsigned lane) { return int(((lane / 8) % 2) * 4 + (lane % 2) * 2); }
inline unsigned frag_lane(int row, int col) {  // the lane holding (row, col)
  return unsigned(((row & 4) << 2) | ((row & 3) << 1) | ((col & 4) << 1) | ((col >> 1) & 1));
}
struct FragPair {
  float a[2];
  float b[2];
  float c[2];
};
// Joins the collective; false when some lane of the simdgroup is missing.
inline bool frag_sync(Lanes<FragPair>& l, const FragPair& mine, const char* what,
                      const char* file, int line) {
  l = exchange(mine, what, file, line);
  return l.mask == 0xffffffffu;
}
}  // namespace mlxs_detail

#define MLXS_SITE const char *file = __builtin_FILE(), int line = __builtin_LINE()
template <typename P>
inline void mlxs_frag_load(simdgroup_float8x8& d, P src, ulong elements_per_row,
                           const char* file, int line) {
  using namespace mlxs_detail;
  const unsigned lane = mlxs_lane_id();
  const int r = frag_row(lane), c = frag_col(lane);
  const float x0 = float(src[r * elements_per_row + c]);  // read on arrival
  const float x1 = float(src[r * elements_per_row + c + 1]);
  const bool full = exchange(0.0f, "simdgroup_load", file, line).mask == 0xffffffffu;
  d.e[0] = full ? x0 : poison<float>();
  d.e[1] = full ? x1 : poison<float>();
}
// (Address spaces vanish here: one overload serves threadgroup and device pointers.)
inline void simdgroup_load(simdgroup_float8x8& d, const float* src, ulong elements_per_row = 8,
                           MLXS_SITE) {
  mlxs_frag_load(d, src, elements_per_row, file, line);
}
template <typename P>
inline void mlxs_frag_store(const simdgroup_float8x8& m, P dst, ulong elements_per_row,
                            const char* file, int line) {
  using namespace mlxs_detail;
  const float e0 = m.e[0], e1 = m.e[1];
  auto l = exchange(0.0f, "simdgroup_store", file, line);
  const bool full = l.mask == 0xffffffffu;
  const int r = frag_row(l.me), c = frag_col(l.me);
  dst[r * elements_per_row + c] = full ? e0 : poison<float>();  // written on leaving
  dst[r * elements_per_row + c + 1] = full ? e1 : poison<float>();
}
inline void simdgroup_store(const simdgroup_float8x8& m, float* dst, ulong elements_per_row = 8,
                            MLXS_SITE) {
  mlxs_frag_store(m, dst, elements_per_row, file, line);
}
// d = a * b + c: each lane computes its two elements from the lanes holding row r of a and
// columns of b, summing k = 0..7 in order (float multiply-add, as an Apple GPU rounds).
inline void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_float8x8& a,
                                          const simdgroup_float8x8& b,
                                          const simdgroup_float8x8& c, MLXS_SITE) {
  using namespace mlxs_detail;
  FragPair mine = {{a.e[0], a.e[1]}, {b.e[0], b.e[1]}, {c.e[0], c.e[1]}};
  Lanes<FragPair> l;
  const bool full = frag_sync(l, mine, "simdgroup_multiply_accumulate", file, line);
  const int r = frag_row(l.me), c0 = frag_col(l.me);
  float out[2];
  for (int j = 0; j < 2; ++j) {
    float acc = 0.0f;
    for (int k = 0; k < 8; ++k) {
      const float x = l.v[frag_lane(r, k)].a[k & 1];
      const float y = l.v[frag_lane(k, c0 + j)].b[(c0 + j) & 1];
      acc = __builtin_fmaf(x, y, acc);
    }
    out[j] = full ? acc + mine.c[j] : poison<float>();
  }
  d.e[0] = out[0];
  d.e[1] = out[1];
}
inline void simdgroup_multiply(simdgroup_float8x8& d, const simdgroup_float8x8& a,
                               const simdgroup_float8x8& b, MLXS_SITE) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<float, 8, 8>(0.0f), file,
                                line);
}
#undef MLXS_SITE
#else
void simdgroup_load(thread simdgroup_float8x8& d, const threadgroup float* src,
                    ulong elements_per_row = 8);
void simdgroup_load(thread simdgroup_float8x8& d, const device float* src,
                    ulong elements_per_row = 8);
void simdgroup_store(thread const simdgroup_float8x8& m, threadgroup float* dst,
                     ulong elements_per_row = 8);
void simdgroup_store(thread const simdgroup_float8x8& m, device float* dst,
                     ulong elements_per_row = 8);
void simdgroup_multiply_accumulate(thread simdgroup_float8x8& d,
                                   thread const simdgroup_float8x8& a,
                                   thread const simdgroup_float8x8& b,
                                   thread const simdgroup_float8x8& c);
void simdgroup_multiply(thread simdgroup_float8x8& d, thread const simdgroup_float8x8& a,
                        thread const simdgroup_float8x8& b);
#endif

}  // namespace metal

// MLX's prelude (bf16.h) does this, so kernel bodies may use the names unqualified.
using namespace metal;
