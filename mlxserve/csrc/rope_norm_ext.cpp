// The rest of a decode layer's small ops on the CPU, one MLX primitive each:
//
//   rope_split(x, cos, sin, heads, head_dims, rotated, traditional)
//       x (tokens, sum heads_i * head_dims_i), e.g. a fused q|k|v projection, split into
//       (tokens, heads_i, head_dims_i) arrays; the first `rotated` of them get RoPE with
//       each token's cos and sin (tokens, dims / 2) in x's dtype (the step's tables,
//       models/base.RotaryEmbedding._tables: made once per step by MLX, so the angles are
//       MLX's own): the first `dims` of each head rotated as x1 * cos - x2 * sin,
//       x1 * sin + x2 * cos (each product rounded, as MLX's ops), the rest copied. One op
//       instead of a split, reshapes and ~8 ops of rotation per array.
//   rms_norm(x, weight, eps)
//       the portable mx.fast.rms_norm's arithmetic in its order (a sequential float32 sum
//       of squares, times 1 / D, plus eps, 1 / sqrt; rounded to x's dtype, times weight):
//       one op instead of 3 (models/compiled.rms_norm) or 11.
//   write_rows(pool, block_ids, offsets, rows)
//       MLX's own scatter of rows into pool[block_ids[t], offsets[t]], built in C++ so the
//       update needs no squeeze/broadcast ops (Python's indexing adds them) and, for rows
//       given as (tokens, 1, 1, heads, width), no reshape; it is the same Scatter
//       primitive, so it updates the pool in place when it can.
#include <cmath>
#include <stdexcept>
#include <string>

#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "decode_ext.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlxserve_decode {
namespace {

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

class CpuRopeSplit : public mx::Primitive {
 public:
  CpuRopeSplit(mx::Stream s, RopeSpec spec) : mx::Primitive(s), spec_(std::move(spec)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    std::vector<mx::array> outs;
    for (auto& o : outputs) {
      encoder.set_output_array(o);
      outs.push_back(mx::array::unsafe_weak_copy(o));
    }
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                      cos_t = mx::array::unsafe_weak_copy(inputs[1]),
                      sin_t = mx::array::unsafe_weak_copy(inputs[2]), outs = std::move(outs),
                      spec = spec_]() mutable {
      std::vector<char> kx, kc, ks;
      const void* src = dense(x, kx);
      const void* cos_p = dense(cos_t, kc);
      const void* sin_p = dense(sin_t, ks);
      std::vector<void*> dst;
      for (auto& o : outs) dst.push_back(o.data<void>());
      const int64_t tokens = static_cast<int64_t>(cos_t.size()) / (spec.dims / 2);
      rope_split_rows(src, elem_of(x.dtype()), cos_p, sin_p, tokens, spec, dst.data());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxserve's rope_split primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuRopeSplit"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return spec_ == static_cast<const CpuRopeSplit&>(other).spec_;
  }

 private:
  RopeSpec spec_;
};

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

std::vector<mx::array> rope_split(const mx::array& x, const mx::array& cos,
                                  const mx::array& sin, std::vector<int> heads,
                                  std::vector<int> head_dims, int rotated, bool traditional) {
  const int type = elem_of(x.dtype());
  check(type >= 0 && type != I8, "rope_split: x must be float32, float16 or bfloat16");
  check(heads.size() == head_dims.size() && !heads.empty(), "rope_split: heads/head_dims");
  check(rotated >= 0 && rotated <= static_cast<int>(heads.size()), "rope_split: rotated");
  check(cos.dtype() == x.dtype() && sin.dtype() == x.dtype() && cos.shape() == sin.shape() &&
            cos.ndim() >= 2 && cos.shape(0) == x.shape(0),
        "rope_split: cos and sin must be (tokens, ..., dims / 2) in x's dtype");
  const int tokens = x.shape(0);
  const int dims = 2 * cos.shape(-1);
  check(dims > 0 && static_cast<int64_t>(cos.size()) == int64_t{tokens} * (dims / 2),
        "rope_split: cos and sin must hold dims / 2 values per token");
  for (int i = 0; i < rotated; i++) check(head_dims[i] >= dims, "rope_split: head_dim < dims");
  int64_t row = 0;
  for (size_t i = 0; i < heads.size(); i++) row += int64_t{heads[i]} * head_dims[i];
  check(x.ndim() >= 1 && static_cast<int64_t>(x.size()) == row * tokens,
        "rope_split: x must be (tokens, " + std::to_string(row) + " values)");
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t i = 0; i < heads.size(); i++) {
    shapes.push_back({tokens, heads[i], head_dims[i]});
    dtypes.push_back(x.dtype());
  }
  RopeSpec spec{std::move(heads), std::move(head_dims), rotated, dims, traditional};
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<CpuRopeSplit>(cpu_stream(), std::move(spec)),
                                {x, cos, sin});
}

class CpuRmsNorm : public mx::UnaryPrimitive {
 public:
  CpuRmsNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                      w = mx::array::unsafe_weak_copy(inputs[1]),
                      y = mx::array::unsafe_weak_copy(out), eps = eps_]() mutable {
      std::vector<char> kx, kw;
      const void* src = dense(x, kx);
      const void* weight = dense(w, kw);
      const int64_t d = x.shape(-1);
      const int64_t rows = d ? static_cast<int64_t>(x.size()) / d : 0;
      rms_norm_rows(src, elem_of(x.dtype()), weight, elem_of(w.dtype()), y.data<void>(),
                    elem_of(y.dtype()), rows, d, eps);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxserve's rms_norm primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const CpuRmsNorm&>(other).eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  const int xt = elem_of(x.dtype()), wt = elem_of(weight.dtype());
  check(xt >= 0 && xt != I8 && wt >= 0 && wt != I8,
        "rms_norm: x and weight must be float32, float16 or bfloat16");
  check(x.ndim() >= 1 && weight.ndim() == 1 && weight.shape(0) == x.shape(-1),
        "rms_norm: weight must be (x.shape[-1],)");
  const mx::Dtype out = mx::promote_types(x.dtype(), weight.dtype());
  return mx::array(x.shape(), out, std::make_shared<CpuRmsNorm>(cpu_stream(), eps), {x, weight});
}

mx::array write_rows(const mx::array& pool, const mx::array& block_ids, const mx::array& offsets,
                     const mx::array& rows) {
  check(pool.ndim() == 4, "write_rows: pool must be (blocks, block_size, heads, width)");
  check(block_ids.ndim() == 1 && offsets.shape() == block_ids.shape(),
        "write_rows: block_ids and offsets must be (tokens,)");
  const int tokens = block_ids.shape(0), heads = pool.shape(2), width = pool.shape(3);
  // The scatter's update is (tokens, 1, 1, heads, width): rows in that shape already (the
  // fused layer's k and v, layer_ext.cpp) need no Reshape op.
  const mx::Shape update_shape = {tokens, 1, 1, heads, width};
  check((rows.ndim() == 3 && rows.shape() == mx::Shape{tokens, heads, width}) ||
            rows.shape() == update_shape,
        "write_rows: rows must be (tokens, heads, width) or (tokens, 1, 1, heads, width) of "
        "the pool's heads and width");
  auto s = cpu_stream();
  auto update = mx::astype(rows, pool.dtype(), s);
  if (rows.ndim() == 3) update = mx::reshape(update, update_shape, s);
  return mx::scatter(pool, {block_ids, offsets}, update, {0, 1}, s);
}

}  // namespace

void register_rope_norm(nb::module_& m) {
  m.def("rope_split", &rope_split, "x"_a, "cos"_a, "sin"_a, "heads"_a, "head_dims"_a,
        "rotated"_a, "traditional"_a,
        "x split into (tokens, heads_i, head_dims_i) arrays, the first `rotated` with RoPE.");
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a, "eps"_a, "RMSNorm of x's rows (one op).");
  m.def("write_rows", &write_rows, "pool"_a, "block_ids"_a, "offsets"_a, "rows"_a,
        "pool with rows scattered to [block_ids[t], offsets[t]] (MLX's scatter).");
}

}  // namespace mlxserve_decode
