// The rest of a decode layer's small ops on the CPU, one MLX primitive each:
//
//   rope_split(x, positions, inv_freqs, heads, head_dims, rotated, dims, traditional, scale)
//       x (tokens, sum heads_i * head_dims_i), e.g. a fused q|k|v projection, split into
//       (tokens, heads_i, head_dims_i) arrays; the first `rotated` of them get RoPE at
//       each token's position (models/base.RotaryEmbedding's arithmetic: angle =
//       position * scale * inv_freq in float32; cos and sin rounded to x's dtype; the
//       first `dims` of each head rotated, the rest copied). One op instead of a split,
//       reshapes and ~8 ops of rotation per array.
//   rms_norm(x, weight, eps)
//       models/compiled.rms_norm (the portable mx.fast.rms_norm): one op instead of 3.
//   write_rows(pool, block_ids, offsets, rows)
//       MLX's own scatter of rows into pool[block_ids[t], offsets[t]], built in C++ so the
//       update needs no squeeze/broadcast/reshape ops (Python's indexing adds them); it
//       is the same Scatter primitive, so it updates the pool in place when it can.
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

struct RopeSpec {
  std::vector<int> heads, head_dims;
  int rotated, dims;
  bool traditional;
  float scale;
  bool operator==(const RopeSpec& o) const {
    return heads == o.heads && head_dims == o.head_dims && rotated == o.rotated &&
           dims == o.dims && traditional == o.traditional && scale == o.scale;
  }
};

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
                      pos = mx::array::unsafe_weak_copy(inputs[1]),
                      freqs = mx::array::unsafe_weak_copy(inputs[2]), outs = std::move(outs),
                      spec = spec_]() mutable {
      std::vector<char> kx, kp, kf;
      const void* src = dense(x, kx);
      const int32_t* positions = static_cast<const int32_t*>(dense(pos, kp));
      const float* inv_freq = static_cast<const float*>(dense(freqs, kf));
      const int type = elem_of(x.dtype());
      const int64_t tokens = pos.size();
      const int half = spec.dims / 2;
      int64_t row = 0;
      for (size_t i = 0; i < spec.heads.size(); i++) row += int64_t{spec.heads[i]} * spec.head_dims[i];
      std::vector<float> cs(2 * static_cast<size_t>(half));
      for (int64_t t = 0; t < tokens; t++) {
        const float at = static_cast<float>(positions[t]) * spec.scale;
        for (int i = 0; i < half; i++) {
          const float theta = at * inv_freq[i];
          cs[i] = round_to(type, std::cos(theta));
          cs[half + i] = round_to(type, std::sin(theta));
        }
        int64_t in = t * row;
        for (size_t seg = 0; seg < spec.heads.size(); seg++) {
          const int hd = spec.head_dims[seg];
          void* dst = outs[seg].data<void>();
          for (int h = 0; h < spec.heads[seg]; h++, in += hd) {
            const int64_t out = (t * spec.heads[seg] + h) * int64_t{hd};
            int d0 = 0;
            if (static_cast<int>(seg) < spec.rotated) {
              for (int i = 0; i < half; i++) {
                const int a = spec.traditional ? 2 * i : i;
                const int b = spec.traditional ? 2 * i + 1 : i + half;
                const float x1 = load(src, type, in + a), x2 = load(src, type, in + b);
                const float c = cs[i], s = cs[half + i];
                // Each product rounded to the dtype, as MLX's elementwise ops round.
                store(dst, type, out + a, round_to(type, x1 * c) - round_to(type, x2 * s));
                store(dst, type, out + b, round_to(type, x1 * s) + round_to(type, x2 * c));
              }
              d0 = spec.dims;
            }
            for (int d = d0; d < hd; d++) store(dst, type, out + d, load(src, type, in + d));
          }
        }
      }
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

std::vector<mx::array> rope_split(const mx::array& x, const mx::array& positions,
                                  const mx::array& inv_freqs, std::vector<int> heads,
                                  std::vector<int> head_dims, int rotated, int dims,
                                  bool traditional, float scale) {
  const int type = elem_of(x.dtype());
  check(type >= 0 && type != I8, "rope_split: x must be float32, float16 or bfloat16");
  check(heads.size() == head_dims.size() && !heads.empty(), "rope_split: heads/head_dims");
  check(rotated >= 0 && rotated <= static_cast<int>(heads.size()), "rope_split: rotated");
  check(dims > 0 && dims % 2 == 0, "rope_split: dims must be even");
  for (int i = 0; i < rotated; i++) check(head_dims[i] >= dims, "rope_split: head_dim < dims");
  check(positions.ndim() == 1 && positions.dtype() == mx::int32, "rope_split: int32 positions");
  check(inv_freqs.dtype() == mx::float32 && inv_freqs.size() == static_cast<size_t>(dims / 2),
        "rope_split: inv_freqs must be float32 (dims / 2,)");
  int64_t row = 0;
  for (size_t i = 0; i < heads.size(); i++) row += int64_t{heads[i]} * head_dims[i];
  check(x.ndim() >= 1 && x.shape(0) == positions.shape(0) &&
            static_cast<int64_t>(x.size()) == row * positions.shape(0),
        "rope_split: x must be (tokens, " + std::to_string(row) + " values)");
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t i = 0; i < heads.size(); i++) {
    shapes.push_back({positions.shape(0), heads[i], head_dims[i]});
    dtypes.push_back(x.dtype());
  }
  RopeSpec spec{std::move(heads), std::move(head_dims), rotated, dims, traditional, scale};
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<CpuRopeSplit>(cpu_stream(), std::move(spec)),
                                {x, positions, inv_freqs});
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
      const int xt = elem_of(x.dtype()), wt = elem_of(w.dtype()), yt = elem_of(y.dtype());
      const int64_t d = x.shape(-1);
      const int64_t rows = d ? static_cast<int64_t>(x.size()) / d : 0;
      void* dst = y.data<void>();
      for (int64_t r = 0; r < rows; r++) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        if (xt == F32) {
          const float* v = static_cast<const float*>(src) + r * d;
          for (; i + 8 <= d; i += 8)
            for (int u = 0; u < 8; u++) acc[u] += v[i + u] * v[i + u];
        }
        float sum = 0;
        for (; i < d; i++) {
          const float v = load(src, xt, r * d + i);
          sum += v * v;
        }
        sum += ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
        for (i = 0; i < d; i++) {
          const float normed = round_to(xt, load(src, xt, r * d + i) * inv);
          store(dst, yt, r * d + i, normed * load(weight, wt, i));
        }
      }
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
  check(rows.ndim() == 3 && rows.shape(0) == block_ids.shape(0) &&
            rows.shape(1) == pool.shape(2) && rows.shape(2) == pool.shape(3),
        "write_rows: rows must be (tokens, heads, width) of the pool's heads and width");
  auto s = cpu_stream();
  auto update = mx::reshape(mx::astype(rows, pool.dtype(), s),
                            {rows.shape(0), 1, 1, rows.shape(1), rows.shape(2)}, s);
  return mx::scatter(pool, {block_ids, offsets}, update, {0, 1}, s);
}

}  // namespace

void register_rope_norm(nb::module_& m) {
  m.def("rope_split", &rope_split, "x"_a, "positions"_a, "inv_freqs"_a, "heads"_a,
        "head_dims"_a, "rotated"_a, "dims"_a, "traditional"_a, "scale"_a,
        "x split into (tokens, heads_i, head_dims_i) arrays, the first `rotated` with RoPE.");
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a, "eps"_a, "RMSNorm of x's rows (one op).");
  m.def("write_rows", &write_rows, "pool"_a, "block_ids"_a, "offsets"_a, "rows"_a,
        "pool with rows scattered to [block_ids[t], offsets[t]] (MLX's scatter).");
}

}  // namespace mlxserve_decode
