// An MLX primitive for the CPU quantized matmul kernels (qmm.h), and its Python module.
//
// quantized_matmul(x, w, scales, biases, group_size, bits) returns a lazy mx.array, like
// mx.quantized_matmul(..., transpose=True): evaluation runs the kernel as a task on the
// CPU stream, in order with MLX's own tasks. Built on first use by mlxserve/cpu/build.py.
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

#include "decode_ext.h"
#include "qmm.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

// Elements of `a` in row-major order, read through its strides (views, broadcasts).
void gather(const mx::array& a, char* dst) {
  const size_t item = a.itemsize();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const char* src = a.data<char>();
  const int nd = static_cast<int>(shape.size());
  std::vector<int64_t> idx(nd, 0);
  for (size_t i = 0; i < a.size(); i++) {
    int64_t off = 0;
    for (int d = 0; d < nd; d++) off += idx[d] * strides[d];
    std::memcpy(dst + i * item, src + off * static_cast<int64_t>(item), item);
    for (int d = nd - 1; d >= 0; d--) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

// A pointer to `a`'s elements in row-major order: its own buffer, or a copy in `keep`.
const void* dense(const mx::array& a, std::vector<char>& keep) {
  if (a.flags().row_contiguous) return a.data<void>();
  keep.resize(a.nbytes());
  gather(a, keep.data());
  return keep.data();
}

class CpuQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  CpuQuantizedMatmul(mx::Stream stream, int group_size, int bits, int act_bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), act_bits_(act_bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                      w = mx::array::unsafe_weak_copy(inputs[1]),
                      s = mx::array::unsafe_weak_copy(inputs[2]),
                      b = mx::array::unsafe_weak_copy(inputs[3]),
                      y = mx::array::unsafe_weak_copy(out), gs = group_size_, bits = bits_,
                      act_bits = act_bits_]() mutable {
      std::vector<char> kx, kw, ks, kb;
      qmm_problem p;
      p.x = static_cast<const float*>(dense(x, kx));
      p.w = static_cast<const uint32_t*>(dense(w, kw));
      p.scales = dense(s, ks);
      p.biases = dense(b, kb);
      p.y = y.data<float>();
      p.K = x.shape(-1);
      p.M = p.K ? static_cast<int64_t>(x.size()) / p.K : 0;
      p.N = w.shape(0);
      p.group_size = gs;
      p.bits = bits;
      p.scale_type = mlxserve_decode::qmm_scale_type(s.dtype());
      p.act_bits = act_bits;
      const int err = mlxserve_qmm(&p);
      if (err == -2) throw std::bad_alloc();
      if (err != 0) throw std::runtime_error("mlxserve qmm: unsupported problem");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxserve's quantized matmul kernels run on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuQuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && act_bits_ == o.act_bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_, bits_, act_bits_;
};

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("quantized_matmul: " + what);
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, int act_bits) {
  check(bits >= 2 && bits <= 8 && bits != 7,
        "bits must be 2, 3, 4, 5, 6 or 8, got " + std::to_string(bits));
  check(act_bits == 0 || act_bits == 8,
        "act_bits must be 0 (float activations) or 8, got " + std::to_string(act_bits));
  check(group_size >= 32 && group_size % 32 == 0,
        "group_size must be a multiple of 32, got " + std::to_string(group_size));
  check(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be a 2-D uint32 array");
  check(static_cast<int64_t>(w.shape(1)) * 32 % bits == 0,
        "w's row of " + std::to_string(w.shape(1)) + " words is not whole " +
            std::to_string(bits) + "-bit values");
  const int64_t k = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  check(x.ndim() >= 1 && x.shape(-1) == k,
        "x's last dimension must be " + std::to_string(k) + " (w holds that many values)");
  check(k % group_size == 0, "K must be a multiple of group_size");
  check(mlxserve_decode::qmm_scale_type(scales.dtype()) >= 0 && scales.dtype() == biases.dtype(),
        "scales and biases must share a float32/float16/bfloat16 dtype");
  const mx::Shape groups = {w.shape(0), static_cast<int>(k / group_size)};
  check(scales.shape() == groups && biases.shape() == groups,
        "scales and biases must have shape (N, K / group_size)");
  check(mx::issubdtype(x.dtype(), mx::floating), "x must be floating point");
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  auto x32 = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, s);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  auto y = mx::array(shape, mx::float32, std::make_shared<CpuQuantizedMatmul>(s, group_size, bits, act_bits),
                     {x32, w, scales, biases});
  return x.dtype() == mx::float32 ? y : mx::astype(y, x.dtype(), s);
}

int q8_isa_by_name(const std::string& name) {
  for (int i = 0; i < Q8_NUM_ISAS; i++)
    if (name == mlxserve_q8_isa_name(i)) return i;
  if (name == "auto") return Q8_NUM_ISAS;
  throw std::invalid_argument("unknown int8 instruction set '" + name + "'");
}

int isa_by_name(const std::string& name) {
  for (int i = 0; i < QMM_NUM_ISAS; i++)
    if (name == mlxserve_qmm_isa_name(i)) return i;
  if (name == "auto") return QMM_NUM_ISAS;
  throw std::invalid_argument("unknown instruction set '" + name + "'");
}

}  // namespace

NB_MODULE(MLXSERVE_EXT_NAME, m) {
  m.doc() = "mlxserve's CPU quantized matmul kernels as an MLX primitive";
  m.def("quantized_matmul", &quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "act_bits"_a = 0,
        "x @ dequantize(w, scales, biases).T, lazily, with mlxserve's CPU kernels; act_bits=8 "
        "rounds x to int8 per block of 32 first (integer dot products).");
  m.def("isa", []() { return std::string(mlxserve_qmm_isa_name(mlxserve_qmm_isa())); },
        "The instruction set the kernels use now.");
  m.def("isa_supported", [](const std::string& n) { return mlxserve_qmm_isa_supported(isa_by_name(n)) != 0; },
        "Whether this CPU and build can run instruction set n.");
  m.def("force_isa", [](const std::string& n) { return mlxserve_qmm_force_isa(isa_by_name(n)) == 0; },
        "Use instruction set n ('auto': the best); False if unsupported.");
  m.def("q8_isa", []() { return std::string(mlxserve_q8_isa_name(mlxserve_q8_isa())); },
        "The instruction set of the int8-activation GEMV now.");
  m.def("q8_isa_supported",
        [](const std::string& n) { return mlxserve_q8_isa_supported(q8_isa_by_name(n)) != 0; },
        "Whether this CPU and build can run int8 instruction set n.");
  m.def("q8_force_isa",
        [](const std::string& n) { return mlxserve_q8_force_isa(q8_isa_by_name(n)) == 0; },
        "Use int8 instruction set n ('auto': the best); False if unsupported.");
  m.def("set_threads", &mlxserve_qmm_set_threads, "n"_a, "Threads per call (0: default).");
  m.def("threads", &mlxserve_qmm_threads, "Threads per call now.");
  m.def("set_claim_div", &mlxserve_qmm_set_claim_div, "div"_a,
        "Pool claims take (items left) / (div * threads) items (0: one); returns the previous.");
  m.def("set_spin_us", [](long us) { return mlxserve_qmm_set_spin_ns(us * 1000) / 1000; }, "us"_a,
        "How long pool workers spin for the next call before sleeping; returns the previous.");
  m.def("spin_us", []() { return mlxserve_qmm_set_spin_ns(-1) / 1000; }, "The pool's spin window.");
  mlxserve_decode::register_attention(m);  // attn_ext.cpp
  mlxserve_decode::register_rope_norm(m);  // rope_norm_ext.cpp
  mlxserve_decode::register_layer(m);  // layer_ext.cpp
  mlxserve_decode::register_linear(m);  // linear_ext.cpp
  mlxserve_decode::register_decoder_layer(m);  // decoder_layer_ext.cpp
  mlxserve_decode::register_decoder_stack(m);  // decoder_stack_ext.cpp
}
