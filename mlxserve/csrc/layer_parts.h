// The halves of a llama-family decoder layer on the CPU (layer_ext.cpp), shared by the
// whole-layer primitive (decoder_layer_ext.cpp): their settings, their arithmetic on a
// step's rows, and the checks of their arguments.
#pragma once

#include <string>
#include <vector>

#include "decode_ext.h"
#include "linear.h"

namespace mlxserve_decode {

// attention_input's settings. Its arrays, consecutive primitive inputs: x, norm weight,
// the qkv layer's arrays, cos, sin[, q_norm, k_norm].
struct AttentionInputSpec {
  float eps;
  LinearSpec qkv;
  RopeSpec rope;
  bool qk_norm;
  float qk_eps;
  int num_inputs() const { return 4 + qkv.num_inputs() + (qk_norm ? 2 : 0); }
  bool operator==(const AttentionInputSpec& o) const {
    return eps == o.eps && qkv == o.qkv && rope == o.rope && qk_norm == o.qk_norm &&
           qk_eps == o.qk_eps;
  }

  // The rope_split parts of x's rows (rows, d) into dst[i] (rows, heads_i, head_dims_i)
  // float32; w: the arrays after x (norm weight, qkv's, cos, sin[, q_norm, k_norm]).
  void run(const float* x, int64_t rows, int64_t d, const mx::array* w, void* const* dst) const;
};

// output_mlp's settings. Its weights, consecutive primitive inputs: o's arrays, the norm
// weight, gate_up's arrays, down's arrays.
struct OutputMlpSpec {
  float eps;
  LinearSpec o, gate_up, down;
  int num_inputs() const { return o.num_inputs() + 1 + gate_up.num_inputs() + down.num_inputs(); }
  bool operator==(const OutputMlpSpec& s) const {
    return eps == s.eps && o == s.o && gate_up == s.gate_up && down == s.down;
  }

  // y (rows, d) = x + a + down(silu(gate) * up), a = o(attn), gate | up = gate_up(norm(x + a)).
  void run(const float* x, const float* attn, int64_t rows, int64_t d, const mx::array* w,
           float* y) const;
};

// attention_input's arguments checked; `inputs` gets its arrays appended.
AttentionInputSpec attention_input_spec(
    const std::string& name, const mx::array& x, const mx::array& norm_weight, float eps,
    const std::vector<mx::array>& qkv, const std::vector<int>& qkv_settings,
    const mx::array& cos, const mx::array& sin, std::vector<int> heads,
    std::vector<int> head_dims, int rotated, bool traditional,
    const std::vector<mx::array>& qk_norms, float qk_eps, std::vector<mx::array>& inputs);

// output_mlp's weights checked against x and the attention's output width; `inputs` gets
// them appended.
OutputMlpSpec output_mlp_spec(const std::string& name, const mx::array& x, int64_t attn_width,
                              const std::vector<mx::array>& o, const std::vector<int>& o_settings,
                              const mx::array& norm_weight, float eps,
                              const std::vector<mx::array>& gate_up,
                              const std::vector<int>& gate_up_settings,
                              const std::vector<mx::array>& down,
                              const std::vector<int>& down_settings,
                              std::vector<mx::array>& inputs);

// A whole layer (decoder_layer_ext.cpp) on `tokens` rows of x (tokens, d) float32 into h:
// attention_input, k and v written into the pools' slots, the paged attention of rows
// [0, num_rows), output_mlp. w: decoder_layer's inputs after x (attention_input's arrays,
// the old pools, slot_mapping, block_tables, context_lens, output_mlp's weights); k_pool and
// v_pool: the pools written (evaluated outputs holding the old pools' contents).
void decoder_layer_rows(const AttentionInputSpec& in, int64_t num_rows, float scale,
                        const OutputMlpSpec& out, const float* x, int64_t tokens, int64_t d,
                        const mx::array* w, mx::array& k_pool, mx::array& v_pool, float* h);

// The buffer of `pool`, a layer's written pool: the old pool's when it can be donated
// (nothing else holds it: written in place), else a new one; true when the old contents
// must be copied into it first (copy_pool, in the task).
bool take_pool(const mx::array& old, mx::array& pool);
void copy_pool(const mx::array& old, mx::array& pool);

}  // namespace mlxserve_decode
