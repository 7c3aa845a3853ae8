// Shared pieces of the decode-step primitives (attn_ext.cpp, rope_norm_ext.cpp): element
// loads in float32 from MLX's float dtypes, row-major views of inputs, registration.
#pragma once

#include <cstring>
#include <cstdint>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/array.h"

namespace mlxserve_decode {

namespace mx = mlx::core;

// Float element types the kernels read and write (the activations' and pools' dtypes).
enum Elem { F32 = 0, F16 = 1, BF16 = 2, I8 = 3 };

inline int elem_of(mx::Dtype t) {
  if (t == mx::float32) return F32;
  if (t == mx::float16) return F16;
  if (t == mx::bfloat16) return BF16;
  if (t == mx::int8) return I8;
  return -1;
}

inline float load(const void* p, int type, int64_t i) {
  switch (type) {
    case F16: return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
    case BF16: return static_cast<float>(static_cast<const mx::bfloat16_t*>(p)[i]);
    case I8: return static_cast<float>(static_cast<const int8_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// float32 -> the element type, rounded to nearest (as MLX's astype).
inline void store(void* p, int type, int64_t i, float v) {
  switch (type) {
    case F16: static_cast<mx::float16_t*>(p)[i] = mx::float16_t(v); break;
    case BF16: static_cast<mx::bfloat16_t*>(p)[i] = mx::bfloat16_t(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// v rounded to the element type and back: what storing then loading gives.
inline float round_to(int type, float v) {
  switch (type) {
    case F16: return static_cast<float>(mx::float16_t(v));
    case BF16: return static_cast<float>(mx::bfloat16_t(v));
    default: return v;
  }
}

// `a`'s elements in row-major order: its own buffer when row-contiguous, else a copy in
// `keep` read through its strides (views, broadcasts).
inline const void* dense(const mx::array& a, std::vector<char>& keep) {
  if (a.flags().row_contiguous) return a.data<void>();
  const size_t item = a.itemsize();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const char* src = a.data<char>();
  const int nd = static_cast<int>(shape.size());
  keep.resize(a.nbytes());
  std::vector<int64_t> idx(nd, 0);
  for (size_t i = 0; i < a.size(); i++) {
    int64_t off = 0;
    for (int d = 0; d < nd; d++) off += idx[d] * strides[d];
    std::memcpy(keep.data() + i * item, src + off * static_cast<int64_t>(item), item);
    for (int d = nd - 1; d >= 0; d--) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  return keep.data();
}

void register_attention(nanobind::module_& m);
void register_rope_norm(nanobind::module_& m);

}  // namespace mlxserve_decode
