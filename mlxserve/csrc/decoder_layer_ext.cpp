// A whole llama-family decoder layer on the CPU as one MLX primitive:
//
//   decoder_layer(x, <attention_input's arguments>, k_pool, v_pool, slot_mapping,
//                 block_tables, context_lens, num_rows, scale, <output_mlp's arguments>)
//       -> h, k_pool, v_pool: attention_input (layer_ext.cpp), k and v written into the
//       pools' slots (int8 pools: quantized as ops/kv_quant.quantize does with MLX's ops),
//       the paged attention of attn_ext.cpp over rows [0, num_rows), output_mlp.
//
// The same functions as the separate primitives in the same order, so the same bits (the
// pools' bytes included) for any number of rows. The pools come out updated in place when
// the old ones can be donated (nothing but this op holds them), else as updated copies,
// the way MLX's scatter writes them in the 5-op layer.
#include <algorithm>
#include <cmath>
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

namespace nb = nanobind;
using namespace nb::literals;

namespace mlxserve_decode {
namespace {

// One (token, KV head) row of head_dim values as an int8 pool row stores it, as
// ops/kv_quant.quantize computes it with MLX's ops: scale = max |x| / 127, values
// rint(x / scale) clipped to [-127, 127] (an all-zero row: zeros, scale 0), then the
// scale's 4 bytes.
void quantize_row(const float* x, int d, int8_t* row) {
  float amax = 0;
  for (int i = 0; i < d; i++) amax = std::max(amax, std::abs(x[i]));
  const float scale = amax / 127.0f;
  const float safe = scale > 0 ? scale : 1.0f;
  for (int i = 0; i < d; i++) {
    const float q = std::min(std::max(std::rint(x[i] / safe), -127.0f), 127.0f);
    row[i] = static_cast<int8_t>(q);
  }
  std::memcpy(row + d, &scale, sizeof scale);
}

// rows (tokens, kv_heads, d) float32 written to pool[slots[t] / block_size][slots[t] %
// block_size] in token order (the scatter's: a repeated slot keeps the last row).
void write_pool_rows(const float* rows, int64_t tokens, const int32_t* slots, mx::array& pool) {
  const int64_t slots_total = int64_t{pool.shape(0)} * pool.shape(1);
  const int kv_heads = pool.shape(2), width = pool.shape(3);
  const bool quantized = pool.dtype() == mx::int8;
  const int d = quantized ? width - 4 : width;
  char* base = pool.data<char>();
  const int64_t row_bytes = int64_t{width} * pool.itemsize();
  for (int64_t t = 0; t < tokens; t++) {
    if (slots[t] < 0 || slots[t] >= slots_total)
      throw std::runtime_error("decoder_layer: slot " + std::to_string(slots[t]) +
                               " is outside the pool (" + std::to_string(slots_total) + ")");
    for (int h = 0; h < kv_heads; h++) {
      const float* src = rows + (t * kv_heads + h) * int64_t{d};
      char* dst = base + (int64_t{slots[t]} * kv_heads + h) * row_bytes;
      if (quantized)
        quantize_row(src, d, reinterpret_cast<int8_t*>(dst));
      else
        std::memcpy(dst, src, sizeof(float) * d);
    }
  }
}

}  // namespace

bool take_pool(const mx::array& old, mx::array& pool) {
  if (old.is_donatable() && old.flags().row_contiguous) {
    pool.copy_shared_buffer(old);  // written in place
    return false;
  }
  pool.set_data(mx::allocator::malloc(pool.nbytes()));
  return true;
}

void copy_pool(const mx::array& old, mx::array& pool) {
  std::vector<char> keep;
  std::memcpy(pool.data<char>(), dense(old, keep), old.nbytes());
}

void decoder_layer_rows(const AttentionInputSpec& in, int64_t num_rows, float scale,
                        const OutputMlpSpec& out, const float* x, int64_t tokens, int64_t d,
                        const mx::array* w, mx::array& k_pool, mx::array& v_pool, float* h) {
  std::vector<char> ks, kt, kc;
  const int pools = in.num_inputs() - 1;  // w's index of the old K pool
  const mx::array& tables = w[pools + 3];
  const RopeSpec& rope = in.rope;
  std::vector<float> qkv(static_cast<size_t>(tokens * rope.row()));
  void* parts[3];  // q (tokens, heads, head_dim), k, v (tokens, kv_heads, head_dim)
  float* next = qkv.data();
  for (int i = 0; i < 3; i++) {
    parts[i] = next;
    next += tokens * rope.heads[i] * int64_t{rope.head_dims[i]};
  }
  in.run(x, tokens, d, w, parts);
  const auto* slots = static_cast<const int32_t*>(dense(w[pools + 2], ks));
  write_pool_rows(static_cast<float*>(parts[1]), tokens, slots, k_pool);
  write_pool_rows(static_cast<float*>(parts[2]), tokens, slots, v_pool);
  std::vector<float> attn(static_cast<size_t>(tokens * rope.heads[0] * rope.head_dims[0]));
  PagedRows r;
  r.q = parts[0];
  r.q_type = F32;
  r.out_rows = tokens;
  r.heads = rope.heads[0];
  r.dk = rope.head_dims[0];
  r.k_pool = &k_pool;
  r.v_pool = &v_pool;
  r.tables = static_cast<const int32_t*>(dense(tables, kt));
  r.max_blocks = tables.shape(1);
  r.ctx = static_cast<const int32_t*>(dense(w[pools + 4], kc));
  r.rows = num_rows;
  r.scale = scale;
  r.window = 0;
  r.sinks = nullptr;
  r.out = attn.data();
  paged_attention_rows(r);
  out.run(x, attn.data(), tokens, d, &w[pools + 5], h);
}

namespace {

// Inputs: attention_input's, k_pool, v_pool, slot_mapping, block_tables, context_lens, then
// output_mlp's weights. Outputs: h, k_pool, v_pool.
class CpuDecoderLayer : public mx::Primitive {
 public:
  CpuDecoderLayer(mx::Stream s, AttentionInputSpec in, int64_t rows, float scale,
                  OutputMlpSpec out)
      : mx::Primitive(s), in_(std::move(in)), rows_(rows), scale_(scale), out_(out) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const size_t pools = in_.num_inputs();
    // Each output holds the inputs until MLX detaches them after this eval: the siblings of
    // the output evaluated here let go of theirs now, so the old pools are donatable when
    // nothing else holds them (not while tracing: a transform may read them again).
    if (!outputs[0].is_tracer())
      for (auto& o : outputs)
        if (&o.inputs() != &inputs) o.inputs().clear();
    const bool copy_k = take_pool(inputs[pools], outputs[1]);
    const bool copy_v = take_pool(inputs[pools + 1], outputs[2]);
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    auto a = start(stream(), inputs, outputs, /* allocate = */ false);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([a = std::move(a), pools, copy_k, copy_v, in = in_, rows = rows_,
                      scale = scale_, out = out_]() mutable {
      std::vector<char> kx;
      mx::array &h = a[a.size() - 3], &k_pool = a[a.size() - 2], &v_pool = a[a.size() - 1];
      if (copy_k) copy_pool(a[pools], k_pool);
      if (copy_v) copy_pool(a[pools + 1], v_pool);
      const mx::array& x = a[0];
      const auto* xs = static_cast<const float*>(dense(x, kx));
      decoder_layer_rows(in, rows, scale, out, xs, x.shape(0), x.shape(1), &a[1], k_pool,
                         v_pool, h.data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxserve's decoder_layer primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuDecoderLayer"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuDecoderLayer&>(other);
    return in_ == o.in_ && rows_ == o.rows_ && scale_ == o.scale_ && out_ == o.out_;
  }

 private:
  AttentionInputSpec in_;
  int64_t rows_;
  float scale_;
  OutputMlpSpec out_;
};

std::vector<mx::array> decoder_layer(
    const mx::array& x, const mx::array& norm_weight, float eps, const std::vector<mx::array>& qkv,
    const std::vector<int>& qkv_settings, const mx::array& cos, const mx::array& sin,
    int num_heads, int num_kv_heads, int head_dim, bool traditional,
    const std::vector<mx::array>& qk_norms, float qk_eps, const mx::array& k_pool,
    const mx::array& v_pool, const mx::array& slot_mapping, const mx::array& block_tables,
    const mx::array& context_lens, int64_t num_rows, float scale, const std::vector<mx::array>& o,
    const std::vector<int>& o_settings, const mx::array& post_norm_weight, float post_eps,
    const std::vector<mx::array>& gate_up, const std::vector<int>& gate_up_settings,
    const std::vector<mx::array>& down, const std::vector<int>& down_settings) {
  const std::string name = "decoder_layer";
  std::vector<mx::array> inputs;
  AttentionInputSpec in = attention_input_spec(
      name, x, norm_weight, eps, qkv, qkv_settings, cos, sin,
      {num_heads, num_kv_heads, num_kv_heads}, {head_dim, head_dim, head_dim}, 2, traditional,
      qk_norms, qk_eps, inputs);
  const int tokens = x.shape(0);
  check(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
        name + ": num_heads must be a multiple of num_kv_heads");
  for (const mx::array* pool : {&k_pool, &v_pool}) {
    const bool quantized = pool->dtype() == mx::int8;
    check((pool->dtype() == mx::float32 || quantized) && pool->ndim() == 4 &&
              pool->shape(2) == num_kv_heads && pool->shape(3) == head_dim + (quantized ? 4 : 0),
          name + ": pools must be (blocks, block_size, num_kv_heads, head_dim) float32 or int8 "
                 "rows of head_dim values and a float32 scale");
  }
  check(k_pool.shape() == v_pool.shape() && k_pool.dtype() == v_pool.dtype(),
        name + ": K and V pools must be alike");
  check(slot_mapping.dtype() == mx::int32 && slot_mapping.shape() == mx::Shape{tokens},
        name + ": slot_mapping must be (tokens,) int32");
  check(block_tables.ndim() == 2 && block_tables.dtype() == mx::int32 &&
            context_lens.ndim() == 1 && context_lens.dtype() == mx::int32,
        name + ": block_tables (rows, max_blocks) and context_lens (rows,) must be int32");
  check(num_rows >= 0 && num_rows <= tokens && num_rows <= block_tables.shape(0) &&
            num_rows <= context_lens.shape(0),
        name + ": num_rows exceeds x, block_tables or context_lens");
  inputs.insert(inputs.end(), {k_pool, v_pool, slot_mapping, block_tables, context_lens});
  OutputMlpSpec out = output_mlp_spec(name, x, int64_t{num_heads} * head_dim, o, o_settings,
                                      post_norm_weight, post_eps, gate_up, gate_up_settings, down,
                                      down_settings, inputs);
  auto prim = std::make_shared<CpuDecoderLayer>(cpu_stream(), std::move(in), num_rows, scale, out);
  return mx::array::make_arrays({x.shape(), k_pool.shape(), v_pool.shape()},
                                {mx::float32, k_pool.dtype(), v_pool.dtype()}, std::move(prim),
                                std::move(inputs));
}

}  // namespace

void register_decoder_layer(nb::module_& m) {
  m.def("decoder_layer", &decoder_layer, "x"_a, "norm_weight"_a, "eps"_a, "qkv"_a,
        "qkv_settings"_a, "cos"_a, "sin"_a, "num_heads"_a, "num_kv_heads"_a, "head_dim"_a,
        "traditional"_a, "qk_norms"_a, "qk_eps"_a, "k_pool"_a, "v_pool"_a, "slot_mapping"_a,
        "block_tables"_a, "context_lens"_a, "num_rows"_a, "scale"_a, "o"_a, "o_settings"_a,
        "post_norm_weight"_a, "post_eps"_a, "gate_up"_a, "gate_up_settings"_a, "down"_a,
        "down_settings"_a,
        "A whole layer (one op): attention_input, k and v written into the pools' slots, the "
        "paged attention of rows [0, num_rows), output_mlp. Returns [h, k_pool, v_pool]; the "
        "old pools are consumed (updated in place when nothing else holds them).");
}

}  // namespace mlxserve_decode
