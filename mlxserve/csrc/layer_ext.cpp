// The dense halves of a llama-family decoder layer on the CPU, one MLX primitive each
// (a layer is one op where decoder_layer_ext.cpp applies, else these two around the K/V
// write and the attention: 5 ops; each op costs MLX ~11 us of dispatch):
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
//
// The linear layers are linear.h's (the quantized matmul kernels), the norms and the
// rotation decode_ext.h's, the SiLU MLX's sigmoid operation by operation (swiglu.c,
// vectorized, on the thread pool), and nothing is fused into a multiply-add (built with
// -ffp-contract=off): each op gives the bits the separate primitives give, for any number
// of rows (decode, verification rows, prefill chunks). Activations are float32 (the CPU path's); intermediates live in scratch buffers.
#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "layer_parts.h"
#include "qmm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlxserve_decode {

void AttentionInputSpec::run(const float* x, int64_t rows, int64_t d, const mx::array* w,
                             void* const* dst) const {
  std::vector<char> kn, kc, ks, kq, kk;
  const mx::array& norm = w[0];
  std::vector<float> normed(static_cast<size_t>(rows * d));
  rms_norm_rows(x, F32, dense(norm, kn), elem_of(norm.dtype()), normed.data(), F32, rows, d,
                eps);
  const int64_t n = out_features(w[1]);
  std::vector<float> y(static_cast<size_t>(rows * n));
  linear(normed.data(), rows, &w[1], qkv, y.data());
  const mx::array &cos_t = w[1 + qkv.num_inputs()], &sin_t = w[2 + qkv.num_inputs()];
  if (qk_norm) {  // per-head RMSNorm of q's and k's heads (qwen3), in place, before RoPE
    const mx::array &qn = w[3 + qkv.num_inputs()], &kn_w = w[4 + qkv.num_inputs()];
    const void* weights[2] = {dense(qn, kq), dense(kn_w, kk)};
    const int types[2] = {elem_of(qn.dtype()), elem_of(kn_w.dtype())};
    for (int64_t t = 0; t < rows; t++) {
      float* head = y.data() + t * rope.row();
      for (int seg = 0; seg < 2; seg++) {
        const int64_t hd = rope.head_dims[seg], heads = rope.heads[seg];
        rms_norm_rows(head, F32, weights[seg], types[seg], head, F32, heads, hd, qk_eps);
        head += heads * hd;
      }
    }
  }
  rope_split_rows(y.data(), F32, dense(cos_t, kc), dense(sin_t, ks), rows, rope, dst);
}

void OutputMlpSpec::run(const float* x, const float* attn, int64_t rows, int64_t d,
                        const mx::array* w, float* y) const {
  std::vector<char> kn;
  const mx::array& norm = w[o.num_inputs()];
  const mx::array* gu = w + o.num_inputs() + 1;
  const mx::array* down_in = gu + gate_up.num_inputs();
  // h = x + o(attn): y holds o's product, then the sum (MLX: x + a).
  linear(attn, rows, w, o, y);
  for (int64_t i = 0; i < rows * d; i++) y[i] = x[i] + y[i];
  std::vector<float> normed(static_cast<size_t>(rows * d));
  rms_norm_rows(y, F32, dense(norm, kn), elem_of(norm.dtype()), normed.data(), F32, rows, d,
                eps);
  const int64_t width = out_features(gu[0]), hidden = width / 2;
  std::vector<float> gu_out(static_cast<size_t>(rows * width));
  linear(normed.data(), rows, gu, gate_up, gu_out.data());
  // silu(gate) * up as MLX computes it (models/compiled.swiglu): (g * sigmoid(g)) * up.
  std::vector<float> act(static_cast<size_t>(rows * hidden));
  mlxserve_swiglu(gu_out.data(), rows, hidden, act.data());
  std::vector<float> mlp(static_cast<size_t>(rows * d));
  linear(act.data(), rows, down_in, down, mlp.data());
  for (int64_t i = 0; i < rows * d; i++) y[i] = y[i] + mlp[i];
}

namespace {

void check_activations(const mx::array& x, const mx::array& norm_weight, const std::string& name) {
  check(x.dtype() == mx::float32 && x.ndim() == 2, name + ": x must be (tokens, hidden) float32");
  const int nt = elem_of(norm_weight.dtype());
  check(nt >= 0 && nt != I8 && norm_weight.ndim() == 1 && norm_weight.shape(0) == x.shape(1),
        name + ": norm_weight must be (hidden,) floating point");
}

class CpuAttentionInput : public mx::Primitive {
 public:
  CpuAttentionInput(mx::Stream s, AttentionInputSpec spec)
      : mx::Primitive(s), spec_(std::move(spec)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto arrays = start(stream(), inputs, outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([a = std::move(arrays), n_in = inputs.size(), spec = spec_]() mutable {
      std::vector<void*> dst;
      for (size_t i = n_in; i < a.size(); i++) dst.push_back(a[i].data<void>());
      std::vector<char> kx;
      const mx::array& x = a[0];
      const auto* xs = static_cast<const float*>(dense(x, kx));
      spec.run(xs, x.shape(0), x.shape(1), &a[1], dst.data());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxserve's attention_input primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuAttentionInput"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return spec_ == static_cast<const CpuAttentionInput&>(other).spec_;
  }

 private:
  AttentionInputSpec spec_;
};

// Inputs: x, attn, then output_mlp's weights. One output.
class CpuOutputMlp : public mx::UnaryPrimitive {
 public:
  CpuOutputMlp(mx::Stream s, OutputMlpSpec spec) : mx::UnaryPrimitive(s), spec_(spec) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    std::vector<mx::array> outputs = {out};
    auto arrays = start(stream(), inputs, outputs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([a = std::move(arrays), spec = spec_]() mutable {
      std::vector<char> kx, ka;
      const mx::array& x = a[0];
      const auto* xs = static_cast<const float*>(dense(x, kx));
      const auto* attn = static_cast<const float*>(dense(a[1], ka));
      spec.run(xs, attn, x.shape(0), x.shape(1), &a[2], a.back().data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxserve's output_mlp primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuOutputMlp"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return spec_ == static_cast<const CpuOutputMlp&>(other).spec_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  OutputMlpSpec spec_;
};

}  // namespace

AttentionInputSpec attention_input_spec(
    const std::string& name, const mx::array& x, const mx::array& norm_weight, float eps,
    const std::vector<mx::array>& qkv, const std::vector<int>& qkv_settings,
    const mx::array& cos, const mx::array& sin, std::vector<int> heads,
    std::vector<int> head_dims, int rotated, bool traditional,
    const std::vector<mx::array>& qk_norms, float qk_eps, std::vector<mx::array>& inputs) {
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
  inputs.insert(inputs.end(), {x, norm_weight});
  inputs.insert(inputs.end(), qkv.begin(), qkv.end());
  inputs.insert(inputs.end(), {cos, sin});
  inputs.insert(inputs.end(), qk_norms.begin(), qk_norms.end());
  return {eps, spec, std::move(rope), !qk_norms.empty(), qk_eps};
}

OutputMlpSpec output_mlp_spec(const std::string& name, const mx::array& x, int64_t attn_width,
                              const std::vector<mx::array>& o, const std::vector<int>& o_settings,
                              const mx::array& norm_weight, float eps,
                              const std::vector<mx::array>& gate_up,
                              const std::vector<int>& gate_up_settings,
                              const std::vector<mx::array>& down,
                              const std::vector<int>& down_settings,
                              std::vector<mx::array>& inputs) {
  check_activations(x, norm_weight, name);
  const int hidden = x.shape(1);
  const LinearSpec os = linear_spec(o, o_settings, attn_width, name + " (o)");
  check(out_features(o[0]) == hidden, name + ": o's outputs must be x's width");
  const LinearSpec gs = linear_spec(gate_up, gate_up_settings, hidden, name + " (gate_up)");
  const int64_t width = out_features(gate_up[0]);
  check(width % 2 == 0, name + ": gate_up's outputs must be gate | up (an even count)");
  const LinearSpec ds = linear_spec(down, down_settings, width / 2, name + " (down)");
  check(out_features(down[0]) == hidden, name + ": down's outputs must be x's width");
  inputs.insert(inputs.end(), o.begin(), o.end());
  inputs.push_back(norm_weight);
  inputs.insert(inputs.end(), gate_up.begin(), gate_up.end());
  inputs.insert(inputs.end(), down.begin(), down.end());
  return {eps, os, gs, ds};
}

namespace {

std::vector<mx::array> attention_input(const mx::array& x, const mx::array& norm_weight, float eps,
                                       const std::vector<mx::array>& qkv,
                                       const std::vector<int>& qkv_settings, const mx::array& cos,
                                       const mx::array& sin, std::vector<int> heads,
                                       std::vector<int> head_dims, int rotated, bool traditional,
                                       bool kv_rows, const std::vector<mx::array>& qk_norms,
                                       float qk_eps) {
  std::vector<mx::array> inputs;
  AttentionInputSpec spec = attention_input_spec(
      "attention_input", x, norm_weight, eps, qkv, qkv_settings, cos, sin, std::move(heads),
      std::move(head_dims), rotated, traditional, qk_norms, qk_eps, inputs);
  const int tokens = x.shape(0);
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t i = 0; i < spec.rope.heads.size(); i++) {
    const int heads_i = spec.rope.heads[i], dim = spec.rope.head_dims[i];
    if (i > 0 && kv_rows)  // k and v as write_rows' scatter takes them: no Reshape op
      shapes.push_back({tokens, 1, 1, heads_i, dim});
    else
      shapes.push_back({tokens, heads_i, dim});
    dtypes.push_back(mx::float32);
  }
  auto prim = std::make_shared<CpuAttentionInput>(cpu_stream(), std::move(spec));
  return mx::array::make_arrays(std::move(shapes), dtypes, std::move(prim), std::move(inputs));
}

mx::array output_mlp(const mx::array& x, const mx::array& attn, const std::vector<mx::array>& o,
                     const std::vector<int>& o_settings, const mx::array& norm_weight, float eps,
                     const std::vector<mx::array>& gate_up, const std::vector<int>& gate_up_settings,
                     const std::vector<mx::array>& down, const std::vector<int>& down_settings) {
  const std::string name = "output_mlp";
  check(attn.dtype() == mx::float32 && attn.ndim() >= 2 && attn.shape(0) == x.shape(0),
        name + ": attn must be (tokens, ...) float32");
  const int64_t attn_width = static_cast<int64_t>(attn.size()) / std::max(1, attn.shape(0));
  std::vector<mx::array> inputs = {x, attn};
  auto spec = output_mlp_spec(name, x, attn_width, o, o_settings, norm_weight, eps, gate_up,
                              gate_up_settings, down, down_settings, inputs);
  auto prim = std::make_shared<CpuOutputMlp>(cpu_stream(), spec);
  return mx::array(x.shape(), mx::float32, std::move(prim), std::move(inputs));
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
}

}  // namespace mlxserve_decode
