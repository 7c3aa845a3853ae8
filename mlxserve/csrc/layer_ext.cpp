// A llama-family decoder layer's dense parts on the CPU as two MLX primitives, so a layer
// is ~5 ops instead of ~19 (each op costs MLX ~11 us of dispatch on top of its work):
//
//   attention_input(x, norm_weight, eps, qkv, cos, sin, heads, head_dims, rotated, trad.,
//                   kv_rows, qk_norms, qk_eps)
//       -> q, k, v: RMSNorm of x, the fused q|k|v projection (+ bias), [each q and k
//       head's RMSNorm (qwen3's q_norm / k_norm),] then rope_split's split and rotation
//       (rope_norm_ext.cpp); kv_rows: k and v come out as
//       (tokens, 1, 1, heads, head_dim), the update shape of write_rows' scatter, so the
//       K/V writes need no Reshape ops.
//   output_mlp(x, attn, o, norm_weight, eps, gate_up, down)
//       -> x + a + down(silu(gate) * up), where a = o(attn), gate | up = gate_up(RMSNorm(x + a)):
//       the attention's output projection, both residual adds, the MLP and its norm.
//   embed_rows(ids, w, scales, biases, group_size, bits)
//       -> rows ids of a quantized embedding table in float32, as mx.dequantize gives them
//       (one op instead of the ~30 of MLX's portable dequantize and the gathers).
//
// A linear layer is (w, scales, biases[, bias]) with (group_size, bits, act_bits): the
// quantized matmul kernels (qmm.h), exactly as CpuQuantizedMatmul calls them (same rows,
// same problem), then the bias added in float32 as MLX's add does. The norms and the
// rotation are decode_ext.h's, the SiLU is MLX's own Sigmoid from its CPU headers, and
// nothing is fused into a multiply-add (built with -ffp-contract=off): each layer gives the
// bits the separate primitives give, for any number of rows (decode, verification rows,
// prefill chunks). The K/V writes and the attention stay separate ops (ops/cpu.py).
// Activations are float32 (the CPU path's); intermediates live in scratch buffers.
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "decode_ext.h"
#include "qmm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlxserve_decode {
namespace {

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

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

int scale_type(mx::Dtype t) {
  if (t == mx::float32) return QMM_F32;
  if (t == mx::float16) return QMM_F16;
  if (t == mx::bfloat16) return QMM_BF16;
  return -1;
}

// arrays = (w, scales, biases[, bias]) of a layer given from Python; checked against K.
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
  check(scale_type(s.dtype()) >= 0 && b.dtype() == s.dtype() && s.shape() == groups &&
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

// y (M, N) = x (M, K) @ dequantize(w).T (+ bias), with the layer's arrays at in[0..].
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
  p.scale_type = scale_type(in[1].dtype());
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

int64_t out_features(const mx::array& w) { return w.shape(0); }

// Inputs: x, norm weight, the qkv layer's arrays, cos, sin. Outputs: the rope_split parts.
class CpuAttentionInput : public mx::Primitive {
 public:
  CpuAttentionInput(mx::Stream s, float eps, LinearSpec qkv, RopeSpec rope, bool qk_norm,
                    float qk_eps)
      : mx::Primitive(s),
        eps_(eps),
        qkv_(qkv),
        rope_(std::move(rope)),
        qk_norm_(qk_norm),
        qk_eps_(qk_eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto arrays = start(stream(), inputs, outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([a = std::move(arrays), n_in = inputs.size(), eps = eps_, qkv = qkv_,
                      rope = rope_, qk_norm = qk_norm_, qk_eps = qk_eps_]() mutable {
      std::vector<char> kx, kn, kc, ks, kq, kk;
      const mx::array &x = a[0], &norm = a[1];
      const int64_t d = x.shape(-1), rows = x.shape(0);
      std::vector<float> normed(static_cast<size_t>(rows * d));
      rms_norm_rows(dense(x, kx), F32, dense(norm, kn), elem_of(norm.dtype()), normed.data(), F32,
                    rows, d, eps);
      const int64_t n = out_features(a[2]);
      std::vector<float> y(static_cast<size_t>(rows * n));
      linear(normed.data(), rows, &a[2], qkv, y.data());
      const mx::array &cos_t = a[2 + qkv.num_inputs()], &sin_t = a[3 + qkv.num_inputs()];
      if (qk_norm) {  // per-head RMSNorm of q's and k's heads (qwen3), in place, before RoPE
        const mx::array &qn = a[4 + qkv.num_inputs()], &kn_w = a[5 + qkv.num_inputs()];
        const void* weights[2] = {dense(qn, kq), dense(kn_w, kk)};
        const int types[2] = {elem_of(qn.dtype()), elem_of(kn_w.dtype())};
        const int64_t row = rope.row();
        for (int64_t t = 0; t < rows; t++) {
          float* head = y.data() + t * row;
          for (int seg = 0; seg < 2; seg++) {
            const int64_t hd = rope.head_dims[seg], heads = rope.heads[seg];
            rms_norm_rows(head, F32, weights[seg], types[seg], head, F32, heads, hd, qk_eps);
            head += heads * hd;
          }
        }
      }
      std::vector<void*> dst;
      for (size_t i = n_in; i < a.size(); i++) dst.push_back(a[i].data<void>());
      rope_split_rows(y.data(), F32, dense(cos_t, kc), dense(sin_t, ks), rows, rope, dst.data());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxserve's attention_input primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuAttentionInput"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuAttentionInput&>(other);
    return eps_ == o.eps_ && qkv_ == o.qkv_ && rope_ == o.rope_ && qk_norm_ == o.qk_norm_ &&
           qk_eps_ == o.qk_eps_;
  }

 private:
  float eps_;
  LinearSpec qkv_;
  RopeSpec rope_;
  bool qk_norm_;
  float qk_eps_;
};

// Inputs: x, attn, o's arrays, norm weight, gate_up's arrays, down's arrays. One output.
class CpuOutputMlp : public mx::UnaryPrimitive {
 public:
  CpuOutputMlp(mx::Stream s, float eps, LinearSpec o, LinearSpec gate_up, LinearSpec down)
      : mx::UnaryPrimitive(s), eps_(eps), o_(o), gate_up_(gate_up), down_(down) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    std::vector<mx::array> outputs = {out};
    auto arrays = start(stream(), inputs, outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([a = std::move(arrays), eps = eps_, o = o_, gu = gate_up_,
                      down = down_]() mutable {
      std::vector<char> kx, ka, kn;
      const mx::array& x = a[0];
      const int64_t d = x.shape(-1), rows = x.shape(0);
      const float* xs = static_cast<const float*>(dense(x, kx));
      const float* attn = static_cast<const float*>(dense(a[1], ka));
      const mx::array* gate_up = &a[2 + o.num_inputs() + 1];
      const mx::array* down_in = gate_up + gu.num_inputs();
      const mx::array& norm = a[2 + o.num_inputs()];
      float* y = a.back().data<float>();
      // h = x + o(attn): y holds o's product, then the sum (MLX: x + a).
      linear(attn, rows, &a[2], o, y);
      for (int64_t i = 0; i < rows * d; i++) y[i] = xs[i] + y[i];
      std::vector<float> normed(static_cast<size_t>(rows * d));
      rms_norm_rows(y, F32, dense(norm, kn), elem_of(norm.dtype()), normed.data(), F32, rows, d,
                    eps);
      const int64_t width = out_features(gate_up[0]), hidden = width / 2;
      std::vector<float> gu_out(static_cast<size_t>(rows * width));
      linear(normed.data(), rows, gate_up, gu, gu_out.data());
      // silu(gate) * up as MLX computes it (models/compiled.swiglu): (g * sigmoid(g)) * up.
      std::vector<float> act(static_cast<size_t>(rows * hidden));
      mx::detail::Sigmoid sigmoid;
      for (int64_t r = 0; r < rows; r++) {
        const float* g = gu_out.data() + r * width;
        for (int64_t i = 0; i < hidden; i++) {
          const float silu = g[i] * sigmoid(g[i]);
          act[r * hidden + i] = silu * g[hidden + i];
        }
      }
      std::vector<float> mlp(static_cast<size_t>(rows * d));
      linear(act.data(), rows, down_in, down, mlp.data());
      for (int64_t i = 0; i < rows * d; i++) y[i] = y[i] + mlp[i];
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxserve's output_mlp primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuOutputMlp"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuOutputMlp&>(other);
    return eps_ == o.eps_ && o_ == o.o_ && gate_up_ == o.gate_up_ && down_ == o.down_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
  LinearSpec o_, gate_up_, down_;
};

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

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

void check_activations(const mx::array& x, const mx::array& norm_weight, const std::string& name) {
  check(x.dtype() == mx::float32 && x.ndim() == 2, name + ": x must be (tokens, hidden) float32");
  const int nt = elem_of(norm_weight.dtype());
  check(nt >= 0 && nt != I8 && norm_weight.ndim() == 1 && norm_weight.shape(0) == x.shape(1),
        name + ": norm_weight must be (hidden,) floating point");
}

std::vector<mx::array> attention_input(const mx::array& x, const mx::array& norm_weight, float eps,
                                       const std::vector<mx::array>& qkv,
                                       const std::vector<int>& qkv_settings, const mx::array& cos,
                                       const mx::array& sin, std::vector<int> heads,
                                       std::vector<int> head_dims, int rotated, bool traditional,
                                       bool kv_rows, const std::vector<mx::array>& qk_norms,
                                       float qk_eps) {
  const std::string name = "attention_input";
  check_activations(x, norm_weight, name);
  const LinearSpec spec = linear_spec(qkv, qkv_settings, x.shape(1), name + " (qkv)");
  check(heads.size() == head_dims.size() && !heads.empty(), name + ": heads/head_dims");
  check(rotated >= 0 && rotated <= static_cast<int>(heads.size()), name + ": rotated");
  const int tokens = x.shape(0);
  check(cos.dtype() == mx::float32 && sin.dtype() == mx::float32 && cos.shape() == sin.shape() &&
            cos.ndim() >= 2 && cos.shape(0) == tokens && cos.shape(-1) > 0 &&
            static_cast<int64_t>(cos.size()) == int64_t{tokens} * cos.shape(-1),
        name + ": cos and sin must be (tokens, ..., dims / 2) float32");
  const int dims = 2 * cos.shape(-1);
  for (int i = 0; i < rotated; i++) check(head_dims[i] >= dims, name + ": head_dim < dims");
  RopeSpec rope{std::move(heads), std::move(head_dims), rotated, dims, traditional};
  check(qk_norms.empty() || qk_norms.size() == 2, name + ": qk_norms must be [] or [q, k]");
  for (size_t i = 0; i < qk_norms.size(); i++) {
    const int t = elem_of(qk_norms[i].dtype());
    check(rope.heads.size() >= 2 && t >= 0 && t != I8 && qk_norms[i].ndim() == 1 &&
              qk_norms[i].shape(0) == rope.head_dims[i],
          name + ": qk_norms must be (head_dim,) floating point for q and k");
  }
  check(rope.row() == out_features(qkv[0]),
        name + ": heads * head_dims must add up to the projection's " +
            std::to_string(out_features(qkv[0])) + " outputs");
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t i = 0; i < rope.heads.size(); i++) {
    if (i > 0 && kv_rows)  // k and v as write_rows' scatter takes them: no Reshape op
      shapes.push_back({tokens, 1, 1, rope.heads[i], rope.head_dims[i]});
    else
      shapes.push_back({tokens, rope.heads[i], rope.head_dims[i]});
    dtypes.push_back(mx::float32);
  }
  std::vector<mx::array> inputs = {x, norm_weight};
  inputs.insert(inputs.end(), qkv.begin(), qkv.end());
  inputs.push_back(cos);
  inputs.push_back(sin);
  inputs.insert(inputs.end(), qk_norms.begin(), qk_norms.end());
  auto prim = std::make_shared<CpuAttentionInput>(cpu_stream(), eps, spec, std::move(rope),
                                                  !qk_norms.empty(), qk_eps);
  return mx::array::make_arrays(std::move(shapes), dtypes, std::move(prim), std::move(inputs));
}

mx::array output_mlp(const mx::array& x, const mx::array& attn, const std::vector<mx::array>& o,
                     const std::vector<int>& o_settings, const mx::array& norm_weight, float eps,
                     const std::vector<mx::array>& gate_up, const std::vector<int>& gate_up_settings,
                     const std::vector<mx::array>& down, const std::vector<int>& down_settings) {
  const std::string name = "output_mlp";
  check_activations(x, norm_weight, name);
  check(attn.dtype() == mx::float32 && attn.ndim() >= 2 && attn.shape(0) == x.shape(0),
        name + ": attn must be (tokens, ...) float32");
  const int64_t attn_width = static_cast<int64_t>(attn.size()) / std::max(1, attn.shape(0));
  const int hidden = x.shape(1);
  const LinearSpec os = linear_spec(o, o_settings, attn_width, name + " (o)");
  check(out_features(o[0]) == hidden, name + ": o's outputs must be x's width");
  const LinearSpec gs = linear_spec(gate_up, gate_up_settings, hidden, name + " (gate_up)");
  const int64_t width = out_features(gate_up[0]);
  check(width % 2 == 0, name + ": gate_up's outputs must be gate | up (an even count)");
  const LinearSpec ds = linear_spec(down, down_settings, width / 2, name + " (down)");
  check(out_features(down[0]) == hidden, name + ": down's outputs must be x's width");
  std::vector<mx::array> inputs = {x, attn};
  inputs.insert(inputs.end(), o.begin(), o.end());
  inputs.push_back(norm_weight);
  inputs.insert(inputs.end(), gate_up.begin(), gate_up.end());
  inputs.insert(inputs.end(), down.begin(), down.end());
  auto prim = std::make_shared<CpuOutputMlp>(cpu_stream(), eps, os, gs, ds);
  return mx::array(x.shape(), mx::float32, std::move(prim), std::move(inputs));
}

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

void register_layer(nb::module_& m) {
  m.def("attention_input", &attention_input, "x"_a, "norm_weight"_a, "eps"_a, "qkv"_a,
        "qkv_settings"_a, "cos"_a, "sin"_a, "heads"_a, "head_dims"_a, "rotated"_a,
        "traditional"_a, "kv_rows"_a = false, "qk_norms"_a = std::vector<mx::array>{},
        "qk_eps"_a = 0.0f,
        "RMSNorm, the q|k|v projection and rope_split of a layer's input rows (one op); "
        "kv_rows: outputs after the first as (tokens, 1, 1, heads, head_dim), write_rows' "
        "update shape; qk_norms: [q_norm, k_norm] weights, each head's RMSNorm before RoPE.");
  m.def("output_mlp", &output_mlp, "x"_a, "attn"_a, "o"_a, "o_settings"_a, "norm_weight"_a,
        "eps"_a, "gate_up"_a, "gate_up_settings"_a, "down"_a, "down_settings"_a,
        "x + o(attn) + the SwiGLU MLP of its RMSNorm (one op).");
  m.def("embed_rows", &embed_rows, "ids"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, "Rows ids of a quantized table, dequantized to float32 (one op).");
}

}  // namespace mlxserve_decode
