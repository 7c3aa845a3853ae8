// Quantized linear layers inside mlxserve's CPU primitives (linear_ext.cpp): a layer is
// (w, scales, biases[, bias]) with (group_size, bits, act_bits), run by the quantized
// matmul kernels (qmm.h) exactly as CpuQuantizedMatmul calls them (same rows, same
// problem), then the bias added in float32 as MLX's add does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "decode_ext.h"

namespace mlxserve_decode {

// One quantized linear layer's settings; its arrays are consecutive primitive inputs.
struct LinearSpec {
  int group_size, bits, act_bits;
  bool has_bias;
  int num_inputs() const { return has_bias ? 4 : 3; }
  bool operator==(const LinearSpec& o) const {
    return group_size == o.group_size && bits == o.bits && act_bits == o.act_bits &&
           has_bias == o.has_bias;
  }
};

// std::invalid_argument(what) unless ok.
void check(bool ok, const std::string& what);

// arrays = (w, scales, biases[, bias]) of a layer given from Python; checked against K.
LinearSpec linear_spec(const std::vector<mx::array>& arrays, const std::vector<int>& settings,
                       int64_t k, const std::string& name);

// y (M, N) = x (M, K) @ dequantize(w).T (+ bias), with the layer's arrays at in[0..].
void linear(const float* x, int64_t m, const mx::array* in, const LinearSpec& spec, float* y);

inline int64_t out_features(const mx::array& w) { return w.shape(0); }

inline mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }


}  // namespace mlxserve_decode
