// A llama-family model's decoder layers on the CPU as ONE MLX primitive:
//
//   DecoderStackLayers([stack_layer(<a layer's weights and settings>), ...])   (once)
//   decoder_stack(layers, x, cos, sin, slot_mapping, block_tables, context_lens, num_rows,
//                 k_pools, v_pools)                                           (each step)
//       -> h, k_pools..., v_pools...: each layer as decoder_layer_ext.cpp computes it, in
//       order, the hidden states passed from one to the next inside the op.
//
// A layer costs Python ~30 us to describe and MLX ~7-9 us to dispatch as its own op; here
// the layers' weights and settings are checked and kept once, and a step is one call and
// one op whatever the number of layers. The layers run decoder_layer_rows, the whole-layer
// primitive's own function, so h and the pools' bytes are that primitive's, layer by layer.
// Each pool comes out in place when the old one can be donated, else as an updated copy.
//
// The weights are kept by the op, not its inputs: MLX gives each output its own copy of
// the inputs (and each its siblings), so 2 * layers + 1 outputs of ~16 * layers inputs
// would cost more than the per-layer ops did. The inputs are the step's arrays and pools.
#include <memory>
#include <stdexcept>
#include <string>

#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

#include "layer_parts.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlxserve_decode {
namespace {

// One layer's settings and weights. `inputs` holds decoder_layer's inputs after x
// (attention_input's arrays, the old pools, slot_mapping, block_tables, context_lens,
// output_mlp's weights): the weights (evaluated), and placeholders for the step's arrays
// (cos, sin, the pools, the slots and rows), filled in at the positions below.
struct StackLayer {
  AttentionInputSpec in;
  OutputMlpSpec out;
  float scale;
  int num_kv_heads, head_dim;
  std::vector<mx::array> inputs;
  int cos_at() const { return 1 + in.qkv.num_inputs(); }
  int pools_at() const { return in.num_inputs() - 1; }
};

using StackLayers = std::shared_ptr<const std::vector<StackLayer>>;

// The layers of a decoder_stack, made once (Python keeps it), shared by the steps' ops.
struct DecoderStackLayers {
  StackLayers layers;
};

StackLayer stack_layer(const mx::array& norm_weight, float eps, const std::vector<mx::array>& qkv,
                       const std::vector<int>& qkv_settings, int num_heads, int num_kv_heads,
                       int head_dim, int rope_dims, bool traditional,
                       const std::vector<mx::array>& qk_norms, float qk_eps, float scale,
                       const std::vector<mx::array>& o, const std::vector<int>& o_settings,
                       const mx::array& post_norm_weight, float post_eps,
                       const std::vector<mx::array>& gate_up,
                       const std::vector<int>& gate_up_settings,
                       const std::vector<mx::array>& down, const std::vector<int>& down_settings) {
  const std::string name = "stack_layer";
  check(norm_weight.ndim() == 1, name + ": norm_weight must be (hidden,)");
  check(rope_dims > 0 && rope_dims % 2 == 0, name + ": rope_dims must be even");
  check(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
        name + ": num_heads must be a multiple of num_kv_heads");
  // decoder_layer's checks on a one-token step of this layer's shapes (never evaluated).
  const mx::array x = mx::zeros({1, norm_weight.shape(0)}, mx::float32);
  const mx::array angles = mx::zeros({1, 1, rope_dims / 2}, mx::float32);
  std::vector<mx::array> inputs;
  AttentionInputSpec in = attention_input_spec(
      name, x, norm_weight, eps, qkv, qkv_settings, angles, angles,
      {num_heads, num_kv_heads, num_kv_heads}, {head_dim, head_dim, head_dim}, 2, traditional,
      qk_norms, qk_eps, inputs);
  inputs.erase(inputs.begin());  // x: the step's, or the previous layer's h
  inputs.insert(inputs.end(), 5, angles);  // the pools, slots, tables, context lengths
  OutputMlpSpec out = output_mlp_spec(name, x, int64_t{num_heads} * head_dim, o, o_settings,
                                      post_norm_weight, post_eps, gate_up, gate_up_settings,
                                      down, down_settings, inputs);
  // The op reads the weights' buffers: a model's weights are evaluated when it is loaded;
  // any still lazy are evaluated now, once.
  std::vector<mx::array> lazy;
  for (const mx::array& a : inputs)
    if (!a.is_available() && a.id() != angles.id()) lazy.push_back(a);
  if (!lazy.empty()) mx::eval(lazy);
  return {std::move(in), out, scale, num_kv_heads, head_dim, std::move(inputs)};
}

// Inputs: x, cos, sin, slot_mapping, block_tables, context_lens, the layers' K pools, their
// V pools. Outputs: h, the K pools, the V pools.
class CpuDecoderStack : public mx::Primitive {
 public:
  CpuDecoderStack(mx::Stream s, StackLayers layers, int64_t rows)
      : mx::Primitive(s), layers_(std::move(layers)), rows_(rows) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const size_t n = layers_->size();
    // As decoder_layer: the siblings let go of the inputs now, so the old pools are
    // donatable when nothing else holds them (not while tracing).
    if (!outputs[0].is_tracer())
      for (auto& o : outputs)
        if (&o.inputs() != &inputs) o.inputs().clear();
    std::vector<char> copies(2 * n);  // per pool: the old contents to copy first
    for (size_t i = 0; i < 2 * n; i++) copies[i] = take_pool(inputs[6 + i], outputs[1 + i]);
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    auto a = start(stream(), inputs, outputs, /* allocate = */ false);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([a = std::move(a), copies = std::move(copies), layers = layers_,
                      rows = rows_]() mutable {
      const size_t n = layers->size();
      const mx::array* old = &a[6];  // the old K pools, then the V pools
      mx::array& h = a[6 + 2 * n];
      mx::array* pools = &a[6 + 2 * n + 1];  // the written ones
      for (size_t i = 0; i < 2 * n; i++)
        if (copies[i]) copy_pool(old[i], pools[i]);
      std::vector<char> kx;
      const mx::array& x = a[0];
      const int64_t tokens = x.shape(0), d = x.shape(1);
      const float* h_in = static_cast<const float*>(dense(x, kx));
      // Hidden states between layers, alternately; the last layer writes the output.
      std::vector<float> between[2];
      for (size_t l = 0; l < n; l++) {
        const StackLayer& layer = (*layers)[l];
        std::vector<mx::array> w = layer.inputs;  // decoder_layer's inputs after x
        w[layer.cos_at()] = a[1];
        w[layer.cos_at() + 1] = a[2];
        const int at = layer.pools_at();
        w[at] = old[l];
        w[at + 1] = old[n + l];
        for (int i = 0; i < 3; i++) w[at + 2 + i] = a[3 + i];  // slots, tables, context lens
        float* h_out = h.data<float>();
        if (l + 1 < n) {
          between[l % 2].resize(static_cast<size_t>(tokens * d));
          h_out = between[l % 2].data();
        }
        decoder_layer_rows(layer.in, rows, layer.scale, layer.out, h_in, tokens, d, w.data(),
                           pools[l], pools[n + l], h_out);
        h_in = h_out;
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxserve's decoder_stack primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuDecoderStack"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuDecoderStack&>(other);
    return rows_ == o.rows_ && layers_ == o.layers_;  // (the same weights)
  }

 private:
  StackLayers layers_;
  int64_t rows_;
};

void fail(const std::string& what) { throw std::invalid_argument("decoder_stack: " + what); }

DecoderStackLayers decoder_stack_layers(const std::vector<StackLayer>& layers) {
  check(!layers.empty(), "decoder_stack_layers: no layers");
  for (const StackLayer& layer : layers)
    check(layer.inputs[0].shape() == layers[0].inputs[0].shape() &&
              layer.in.rope.dims == layers[0].in.rope.dims,
          "decoder_stack_layers: the layers' hidden sizes and rope_dims must be alike");
  return {std::make_shared<const std::vector<StackLayer>>(layers)};
}

std::vector<mx::array> decoder_stack(const DecoderStackLayers& stack, const mx::array& x,
                                     const mx::array& cos, const mx::array& sin,
                                     const mx::array& slot_mapping,
                                     const mx::array& block_tables,
                                     const mx::array& context_lens, int64_t num_rows,
                                     const std::vector<mx::array>& k_pools,
                                     const std::vector<mx::array>& v_pools) {
  const auto& layers = *stack.layers;
  const size_t n = layers.size();
  // The checks decoder_layer makes each step (the weights' were made once).
  if (n == 0 || k_pools.size() != n || v_pools.size() != n)
    fail("one K and one V pool per layer, and at least one layer");
  const mx::array& norm = layers[0].inputs[0];
  if (x.dtype() != mx::float32 || x.ndim() != 2 || x.shape(1) != norm.shape(0))
    fail("x must be (tokens, " + std::to_string(norm.shape(0)) + ") float32");
  const int tokens = x.shape(0), half = layers[0].in.rope.dims / 2;
  if (cos.dtype() != mx::float32 || sin.dtype() != mx::float32 || cos.shape() != sin.shape() ||
      cos.ndim() < 2 || cos.shape(0) != tokens || cos.shape(-1) != half ||
      static_cast<int64_t>(cos.size()) != int64_t{tokens} * half)
    fail("cos and sin must be (tokens, ..., " + std::to_string(half) + ") float32");
  if (slot_mapping.dtype() != mx::int32 || slot_mapping.shape() != mx::Shape{tokens})
    fail("slot_mapping must be (tokens,) int32");
  if (block_tables.ndim() != 2 || block_tables.dtype() != mx::int32 ||
      context_lens.ndim() != 1 || context_lens.dtype() != mx::int32)
    fail("block_tables (rows, max_blocks) and context_lens (rows,) must be int32");
  if (num_rows < 0 || num_rows > tokens || num_rows > block_tables.shape(0) ||
      num_rows > context_lens.shape(0))
    fail("num_rows exceeds x, block_tables or context_lens");
  std::vector<mx::array> inputs = {x, cos, sin, slot_mapping, block_tables, context_lens};
  inputs.insert(inputs.end(), k_pools.begin(), k_pools.end());
  inputs.insert(inputs.end(), v_pools.begin(), v_pools.end());
  std::vector<mx::Shape> shapes = {x.shape()};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  for (size_t l = 0; l < n; l++) {
    const StackLayer& layer = layers[l];
    const mx::array &k = k_pools[l], &v = v_pools[l];
    const bool quantized = k.dtype() == mx::int8;
    if ((k.dtype() != mx::float32 && !quantized) || k.ndim() != 4 ||
        k.shape(2) != layer.num_kv_heads || k.shape(3) != layer.head_dim + (quantized ? 4 : 0) ||
        k.shape() != v.shape() || k.dtype() != v.dtype())
      fail("layer " + std::to_string(l) + "'s pools must be alike (blocks, block_size, " +
           std::to_string(layer.num_kv_heads) + ", " + std::to_string(layer.head_dim) +
           ") float32, or int8 rows of head_dim values and a float32 scale");
  }
  for (const auto* pools : {&k_pools, &v_pools})
    for (const mx::array& p : *pools) {
      shapes.push_back(p.shape());
      dtypes.push_back(p.dtype());
    }
  auto prim = std::make_shared<CpuDecoderStack>(cpu_stream(), stack.layers, num_rows);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), std::move(prim),
                                std::move(inputs));
}

}  // namespace

void register_decoder_stack(nb::module_& m) {
  nb::class_<StackLayer>(m, "StackLayer", "One decoder layer's weights and settings, checked.");
  m.def("stack_layer", &stack_layer, "norm_weight"_a, "eps"_a, "qkv"_a, "qkv_settings"_a,
        "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "rope_dims"_a, "traditional"_a,
        "qk_norms"_a, "qk_eps"_a, "scale"_a, "o"_a, "o_settings"_a, "post_norm_weight"_a,
        "post_eps"_a, "gate_up"_a, "gate_up_settings"_a, "down"_a, "down_settings"_a,
        "A layer of decoder_stack: decoder_layer's weights and settings (rope_dims: the "
        "rotated values per head), checked once.");
  nb::class_<DecoderStackLayers>(m, "DecoderStackLayers", "A decoder_stack's layers.");
  m.def("decoder_stack_layers", &decoder_stack_layers, "layers"_a,
        "The layers of a decoder_stack, in order (kept: made once, used each step).");
  m.def("decoder_stack", &decoder_stack, "layers"_a, "x"_a, "cos"_a, "sin"_a, "slot_mapping"_a,
        "block_tables"_a, "context_lens"_a, "num_rows"_a, "k_pools"_a, "v_pools"_a,
        "Every layer (one op): each as decoder_layer, in order. Returns [h, *k_pools, "
        "*v_pools]; the old pools are consumed (updated in place when nothing else holds them).");
}

}  // namespace mlxserve_decode
