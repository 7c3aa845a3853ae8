// Shared pieces of the decode-step primitives (attn_ext.cpp, rope_norm_ext.cpp, the layer
// files): element loads in float32 from MLX's float dtypes, row-major views of inputs, the
// norm and RoPE row loops, the paged attention's entry point, registration.
#pragma once

#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

#include "qmm.h"

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

// The quantized matmul kernels' code for a dtype of scales and biases (qmm.h), or -1.
inline int qmm_scale_type(mx::Dtype t) {
  if (t == mx::float32) return QMM_F32;
  if (t == mx::float16) return QMM_F16;
  if (t == mx::bfloat16) return QMM_BF16;
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

// The portable mx.fast.rms_norm's arithmetic in its order, over `rows` rows of d values: a
// sequential float32 sum of squares, times 1 / d, plus eps, 1 / sqrt; each value times
// that rounded to x's type, times the weight, stored in y's type. (CpuRmsNorm, and the
// fused layer parts of layer_ext.cpp: one definition, so they give the same bits.)
inline void rms_norm_rows(const void* x, int xt, const void* weight, int wt, void* y, int yt,
                          int64_t rows, int64_t d, float eps) {
  const float inv_d = 1.0f / static_cast<float>(d);
  for (int64_t r = 0; r < rows; r++) {
    float sum = 0;  // in order, as MLX's CPU reduction adds them
    for (int64_t i = 0; i < d; i++) {
      const float v = load(x, xt, r * d + i);
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum * inv_d + eps);
    for (int64_t i = 0; i < d; i++) {
      const float normed = round_to(xt, load(x, xt, r * d + i) * inv);
      store(y, yt, r * d + i, normed * load(weight, wt, i));
    }
  }
}

// How rows of concatenated heads are split and rotated (rope_split's arguments).
struct RopeSpec {
  std::vector<int> heads, head_dims;  // per output: heads and values per head
  int rotated, dims;                  // the first `rotated` outputs: first `dims` of a head
  bool traditional;                   // pairs (2i, 2i + 1), else (i, i + dims / 2)
  bool operator==(const RopeSpec& o) const {
    return heads == o.heads && head_dims == o.head_dims && rotated == o.rotated &&
           dims == o.dims && traditional == o.traditional;
  }
  int64_t row() const {  // values per token
    int64_t n = 0;
    for (size_t i = 0; i < heads.size(); i++) n += int64_t{heads[i]} * head_dims[i];
    return n;
  }
};

// `tokens` rows of src (type `type`) split into dst[i] (tokens, heads_i, head_dims_i), the
// first `rotated` with RoPE by each token's cos and sin (dims / 2 values each, same type):
// x1 * cos - x2 * sin, x1 * sin + x2 * cos, each product rounded as MLX's ops round.
inline void rope_split_rows(const void* src, int type, const void* cos_p, const void* sin_p,
                            int64_t tokens, const RopeSpec& spec, void* const* dst) {
  const int half = spec.dims / 2;
  const int64_t row = spec.row();
  std::vector<float> cs(2 * static_cast<size_t>(half));
  for (int64_t t = 0; t < tokens; t++) {
    for (int i = 0; i < half; i++) {
      cs[i] = load(cos_p, type, t * half + i);
      cs[half + i] = load(sin_p, type, t * half + i);
    }
    int64_t in = t * row;
    for (size_t seg = 0; seg < spec.heads.size(); seg++) {
      const int hd = spec.head_dims[seg];
      for (int h = 0; h < spec.heads[seg]; h++, in += hd) {
        const int64_t out = (t * spec.heads[seg] + h) * int64_t{hd};
        int d0 = 0;
        if (static_cast<int>(seg) < spec.rotated) {
          for (int i = 0; i < half; i++) {
            const int a = spec.traditional ? 2 * i : i;
            const int b = spec.traditional ? 2 * i + 1 : i + half;
            const float x1 = load(src, type, in + a), x2 = load(src, type, in + b);
            const float c = cs[i], s = cs[half + i];
            store(dst[seg], type, out + a, round_to(type, x1 * c) - round_to(type, x2 * s));
            store(dst[seg], type, out + b, round_to(type, x1 * s) + round_to(type, x2 * c));
          }
          d0 = spec.dims;
        }
        for (int d = d0; d < hd; d++) store(dst[seg], type, out + d, load(src, type, in + d));
      }
    }
  }
}

// The paged attention of rows 0..rows of q over the pools (attn_ext.cpp's primitive, also
// run inside the fused layer): each row attends to the keys of its table up to ctx[row]
// (a sliding window: the last `window`), rows from `rows` to out_rows get zeros.
struct PagedRows {
  const void* q;  // (out_rows, heads, dk) of q_type
  int q_type;
  int64_t out_rows;
  int heads, dk;
  const mx::array *k_pool, *v_pool;  // evaluated (num_blocks, block_size, kv_heads, width)
  const int32_t* tables;             // (>= rows, max_blocks)
  int64_t max_blocks;
  const int32_t* ctx;  // (>= rows,)
  int64_t rows;
  float scale;
  int window;          // 0: none
  const float* sinks;  // (heads,) or null
  void* out;           // (out_rows, heads, dv) of q_type
};
void paged_attention_rows(const PagedRows& r);

void register_attention(nanobind::module_& m);
void register_rope_norm(nanobind::module_& m);
void register_layer(nanobind::module_& m);
void register_linear(nanobind::module_& m);
void register_decoder_layer(nanobind::module_& m);
void register_decoder_stack(nanobind::module_& m);

// A primitive's eval_cpu: its outputs allocated, every array in the encoder, and weak
// copies of the inputs then the outputs for the task (MLX keeps the arrays alive).
// allocate = false: the outputs have their buffers already (e.g. shared with an input).
template <typename Outs>
std::vector<mx::array> start(mx::Stream s, const std::vector<mx::array>& inputs, Outs& outputs,
                             bool allocate = true) {
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) encoder.set_input_array(a);
  for (auto& o : outputs) {
    if (allocate) o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  std::vector<mx::array> all;
  for (auto& a : inputs) all.push_back(mx::array::unsafe_weak_copy(a));
  for (auto& o : outputs) all.push_back(mx::array::unsafe_weak_copy(o));
  return all;
}

}  // namespace mlxserve_decode
