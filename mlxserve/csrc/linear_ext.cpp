// The quantized linear layers of the fused primitives (linear.h) and a quantized
// embedding's lookup as one primitive:
//
//   embed_rows(ids, w, scales, biases, group_size, bits)
//       -> rows ids of a quantized embedding table in float32, as mx.dequantize gives them
//       (one op instead of the ~30 of MLX's portable dequantize and the gathers).
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "linear.h"
#include "qmm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlxserve_decode {

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

LinearSpec linear_spec(const std::vector<mx::array>& arrays, const std::vector<int>& settings,
                       int64_t k, const std::string& name) {
  check(settings.size() == 3, name + ": settings must be (group_size, bits, act_bits)");
  check(arrays.size() == 3 || arrays.size() == 4, name + ": expected (w, scales, biases[, bias])");
  const LinearSpec spec{settings[0], settings[1], settings[2], arrays.size() == 4};
  const auto &w = arrays[0], &s = arrays[1], &b = arrays[2];
  check(spec.bits >= 2 && spec.bits <= 8 && spec.bits != 7, name + ": bits");
  check(spec.act_bits == 0 || spec.act_bits == 8, name + ": act_bits must be 0 or 8");
  check(spec.group_size >= 32 && spec.group_size % 32 == 0, name + ": group_size");
  check(w.dtype() == mx::uint32 && w.ndim() == 2, name + ": w must be a 2-D uint32 array");
  check(int64_t{w.shape(1)} * 32 == k * spec.bits,
        name + ": w holds rows of " + std::to_string(int64_t{w.shape(1)} * 32 / spec.bits) +
            " values, the input has " + std::to_string(k));
  check(k % spec.group_size == 0, name + ": K must be a multiple of group_size");
  const mx::Shape groups = {w.shape(0), static_cast<int>(k / spec.group_size)};
  check(qmm_scale_type(s.dtype()) >= 0 && b.dtype() == s.dtype() && s.shape() == groups &&
            b.shape() == groups,
        name + ": scales and biases must be (N, K / group_size), float32/float16/bfloat16");
  if (spec.has_bias) {
    const auto& bias = arrays[3];
    check(elem_of(bias.dtype()) >= 0 && elem_of(bias.dtype()) != I8 && bias.ndim() == 1 &&
              bias.shape(0) == w.shape(0),
          name + ": bias must be (N,) floating point");
  }
  return spec;
}

void linear(const float* x, int64_t m, const mx::array* in, const LinearSpec& spec, float* y) {
  std::vector<char> kw, ks, kb;
  qmm_problem p;
  p.x = x;
  p.w = static_cast<const uint32_t*>(dense(in[0], kw));
  p.scales = dense(in[1], ks);
  p.biases = dense(in[2], kb);
  p.y = y;
  p.M = m;
  p.N = in[0].shape(0);
  p.K = int64_t{in[0].shape(1)} * 32 / spec.bits;
  p.group_size = spec.group_size;
  p.bits = spec.bits;
  p.scale_type = qmm_scale_type(in[1].dtype());
  p.act_bits = spec.act_bits;
  const int err = mlxserve_qmm(&p);
  if (err == -2) throw std::bad_alloc();
  if (err != 0) throw std::runtime_error("mlxserve qmm: unsupported problem");
  if (!spec.has_bias) return;
  std::vector<char> keep;
  const void* bias = dense(in[3], keep);
  const int bt = elem_of(in[3].dtype());
  for (int64_t r = 0; r < m; r++)
    for (int64_t n = 0; n < p.N; n++) y[r * p.N + n] += load(bias, bt, n);
}


namespace {

// Rows ids[t] of a quantized embedding table, dequantized to float32 as MLX's
// mx.dequantize computes them on the CPU: q * scale, rounded, plus bias (no fused
// multiply-add). Values are a little-endian bit stream per row (any of MLX's widths).
class CpuEmbedRows : public mx::UnaryPrimitive {
 public:
  CpuEmbedRows(mx::Stream s, int group_size, int bits)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    std::vector<mx::array> outputs = {out};
    auto arrays = start(stream(), inputs, outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([a = std::move(arrays), gs = group_size_, bits = bits_]() mutable {
      std::vector<char> ki, kw, ks, kb;
      const mx::array &ids = a[0], &w = a[1], &sc = a[2];
      const auto* id = static_cast<const int32_t*>(dense(ids, ki));
      const auto* words = static_cast<const uint8_t*>(dense(w, kw));
      const void* scales = dense(sc, ks);
      const void* biases = dense(a[3], kb);
      const int st = elem_of(sc.dtype());
      const int64_t row_bytes = int64_t{w.shape(1)} * 4, vocab = w.shape(0);
      const int64_t d = row_bytes * 8 / bits, groups = d / gs;
      const uint32_t mask = (1u << bits) - 1;
      float* y = a.back().data<float>();
      for (int64_t t = 0; t < static_cast<int64_t>(ids.size()); t++) {
        const int64_t r = id[t];
        if (r < 0 || r >= vocab) {  // (the engine checks ids first) zeros, never a crash
          std::fill(y + t * d, y + (t + 1) * d, 0.0f);
          continue;
        }
        const uint8_t* row = words + r * row_bytes;
        for (int64_t k = 0; k < d; k++) {
          const int64_t bit = k * bits;
          uint32_t two = row[bit >> 3];  // a value spans at most two bytes (bits <= 8)
          if ((bit & 7) + bits > 8) two |= uint32_t{row[(bit >> 3) + 1]} << 8;
          const float q = static_cast<float>((two >> (bit & 7)) & mask);
          const float scaled = q * load(scales, st, r * groups + k / gs);
          y[t * d + k] = scaled + load(biases, st, r * groups + k / gs);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxserve's embed_rows primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuEmbedRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuEmbedRows&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.push_back(static_cast<int>(int64_t{inputs[1].shape(1)} * 32 / bits_));
    return {shape};
  }

 private:
  int group_size_, bits_;
};


mx::array embed_rows(const mx::array& ids, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group_size, int bits) {
  const std::string name = "embed_rows";
  check(ids.dtype() == mx::int32, name + ": ids must be int32");
  const int64_t k = int64_t{w.shape(1)} * 32 / std::max(bits, 1);
  linear_spec({w, scales, biases}, {group_size, bits, 0}, k, name);
  auto shape = ids.shape();
  shape.push_back(static_cast<int>(k));
  auto prim = std::make_shared<CpuEmbedRows>(cpu_stream(), group_size, bits);
  return mx::array(shape, mx::float32, std::move(prim), {ids, w, scales, biases});
}

}  // namespace

void register_linear(nb::module_& m) {
  m.def("embed_rows", &embed_rows, "ids"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, "Rows ids of a quantized table, dequantized to float32 (one op).");
}

}  // namespace mlxserve_decode
