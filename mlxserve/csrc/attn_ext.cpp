// Paged attention of decode rows on the CPU, as one MLX primitive per layer.
//
// paged_attention(q, k_pool, v_pool, block_tables, context_lens, num_rows, scale, window,
// sinks) -> (q.shape[0], num_heads, v_head_dim), q's dtype. Query row r < num_rows is
// one token that attends to the keys at positions [lo, ctx[r]) of the sequence whose block
// table is block_tables[r] (lo = ctx[r] - window with a sliding window, else 0); rows from
// num_rows on are zeros (bucketing padding). A speculative verification is several such
// rows with one table and consecutive context lengths: each sees up to its own position.
// It computes what ops/fallback.py's decode attention computes (scores in float32, a sink
// logit per head in the softmax's denominator), reading the pool through the table:
//
//   pools (num_blocks, block_size, num_kv_heads, width), float32 / float16 / bfloat16, or
//   int8 rows of head_dim values followed by their float32 scale (ops/kv_quant.py).
//   GQA: the num_heads / num_kv_heads query heads of a KV head read its keys once.
//
// Work items are (tile, KV head) pairs (a tile: up to 16 consecutive rows of one table, each
// key loaded once for all of them, each row's sums the same as alone), spread over the
// kernels' thread pool (qmm.c) when there is enough of it. The whole-layer primitive
// (decoder_layer_ext.cpp) runs the same computation: paged_attention_rows (decode_ext.h).
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include <nanobind/stl/optional.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "attn_keys.h"
#include "decode_ext.h"
#include "qmm.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace mlxserve_decode {
namespace {

// Consecutive rows that read one table's keys together: key positions [lo, hi) are the
// union of the rows' own ranges, each key row is loaded (dequantized) once for the tile.
struct Tile {
  int64_t first;
  int count;
  int lo, hi;
};
constexpr int kMaxTile = 16;
constexpr int64_t kTileFloats = int64_t{1} << 20;  // a tile's scores (4 MB) at most

struct AttnProblem {
  const void* q;
  const char* k;  // pools as bytes: row i at i * k_row_bytes
  const char* v;
  const int32_t* tables;
  const int32_t* ctx;
  const float* sinks;  // (num_heads,) or null
  const Tile* tiles;
  void* out;
  int q_type, k_type, v_type;
  int64_t rows, out_rows, max_blocks, num_blocks;
  int heads, kv_heads, dk, dv, block_size, window;
  int64_t k_row_bytes, v_row_bytes;  // one (slot, KV head) row of each pool
  float scale;
};

// The work items are compiled for AVX-512, AVX2 and baseline x86-64 and the best the CPU
// has is picked at load time (GCC/clang function multiversioning on Linux) by feature, not
// CPU model (a virtual "Intel Xeon Processor" is no skylake-avx512: it ran baseline). No
// fused multiply-adds (build.py): every clone computes the same bits. The loops of
// attn_keys.h are written so the compiler vectorizes them (16 independent sums).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define MLXSERVE_CLONES \
  __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MLXSERVE_CLONES
#endif

// One pool row as float32 in `dst` (dequantized: int8 values times the row's scale).
inline const float* row_f32(const char* row, int type, int d, float* dst) {
  if (type == F32) return reinterpret_cast<const float*>(row);
  if (type == I8) {
    float s;
    std::memcpy(&s, row + d, sizeof(float));
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    for (int i = 0; i < d; i++) dst[i] = static_cast<float>(q[i]) * s;
    return dst;
  }
  for (int i = 0; i < d; i++) dst[i] = load(row, type, i);
  return dst;
}

// Floats of attend_tile's scratch for a tile of nq query heads and n keys.
size_t scratch_floats(const AttnProblem& p, int nq, int n) {
  return static_cast<size_t>(nq) * (p.dk + p.dv + n + 1) +
         static_cast<size_t>(kKeys) * (2 * p.dk + p.dv);
}

// One work item: a tile's rows on one KV head. No library types inside: clang (19) does not
// emit the inline library functions only target clones call (the library then failed to
// load: "undefined symbol: std::allocator<float>::allocator()"), so attend allocates.
MLXSERVE_CLONES void attend_tile(const AttnProblem& p, int64_t item, float* scratch) {
  const Tile& tile = p.tiles[item / p.kv_heads];
  const int kvh = static_cast<int>(item % p.kv_heads);
  const int group = p.heads / p.kv_heads;
  const int rows = tile.count;   // rows tile.first.. of one table
  const int nq = rows * group;   // query heads of the tile: (row, g) at t * group + g
  const int lo = tile.lo, n = tile.hi - tile.lo;
  // Every value is written before it is read (scores only over each row's keys): no zeroing.
  float* qf = scratch;                                   // (nq, dk)
  float* acc = qf + static_cast<size_t>(nq) * p.dk;      // (nq, dv)
  float* scores = acc + static_cast<size_t>(nq) * p.dv;  // (nq, n): keys lo.. of the tile
  float* denom = scores + static_cast<size_t>(nq) * n;   // (nq)
  float* kt = denom + nq;                                // (dk, kKeys): kKeys keys, transposed
  float* krows = kt + static_cast<size_t>(p.dk) * kKeys;  // (kKeys, dk): dequantized ones
  float* vb = krows + static_cast<size_t>(p.dk) * kKeys;  // (kKeys, dv)
  int row_lo[kMaxTile], row_hi[kMaxTile];  // each row's keys [row_lo, row_hi) - lo
  const int h0 = kvh * group;
  for (int t = 0; t < rows; t++) {
    const int64_t r = tile.first + t;
    const int c = p.ctx[r];
    row_lo[t] = (p.window > 0 ? std::max(0, c - p.window) : 0) - lo;
    row_hi[t] = std::max(row_lo[t], c - lo);
    for (int g = 0; g < group; g++)
      for (int d = 0; d < p.dk; d++)
        qf[(t * group + g) * p.dk + d] = load(p.q, p.q_type, ((r * p.heads) + h0 + g) * p.dk + d);
  }
  // Every row's keys are in the first row's table (make_tiles); each row's arithmetic is
  // the same sequence over its own keys as if it were alone: only the loads are shared.
  const int32_t* table = p.tables + tile.first * p.max_blocks;
  auto pool_row = [&](int pos) {  // (slot, KV head) row index of key position pos
    return (static_cast<int64_t>(table[pos / p.block_size]) * p.block_size +
            pos % p.block_size) * p.kv_heads + kvh;
  };
  const float* key_rows[kKeys];
  for (int j0 = 0; j0 < n; j0 += kKeys) {
    const int jn = std::min(kKeys, n - j0);
    for (int j = 0; j < kKeys; j++) {  // past jn: a copy of the last, never read
      const char* row = p.k + pool_row(lo + j0 + std::min(j, jn - 1)) * p.k_row_bytes;
      key_rows[j] = row_f32(row, p.k_type, p.dk, krows + static_cast<size_t>(j) * p.dk);
    }
    transpose_keys(key_rows, p.dk, kt);
    for (int t = 0; t < rows; t++) {
      if (j0 + jn <= row_lo[t] || j0 >= row_hi[t]) continue;
      for (int g = 0; g < group; g++) {
        const int i = t * group + g;
        float dot_out[kKeys];
        dots(qf + i * p.dk, kt, p.dk, p.scale, dot_out);
        float* s = scores + static_cast<size_t>(i) * n + j0;  // keys out of the row's range
        if (jn == kKeys)                                         // are never read
          std::memcpy(s, dot_out, sizeof dot_out);
        else
          for (int j = 0; j < jn; j++) s[j] = dot_out[j];
      }
    }
  }
  std::fill(acc, acc + static_cast<size_t>(nq) * p.dv, 0.0f);
  for (int i = 0; i < nq; i++) {
    const int t = i / group;
    float* s = scores + static_cast<size_t>(i) * n + row_lo[t];
    const float* sink = p.sinks ? p.sinks + h0 + i % group : nullptr;
    denom[i] = softmax_numerators(s, row_hi[t] - row_lo[t], sink);
  }
  // Values kKeys keys at a time: a row's accumulator stays in registers over the block
  // (64 elements at once), each element summing the keys in order as alone.
  for (int j0 = 0; j0 < n; j0 += kKeys) {
    const int jn = std::min(kKeys, n - j0);
    const float* value_rows[kKeys];  // float32 pools are read in place
    for (int j = 0; j < jn; j++) {
      float* dst = vb + static_cast<size_t>(j) * p.dv;
      value_rows[j] = row_f32(p.v + pool_row(lo + j0 + j) * p.v_row_bytes, p.v_type, p.dv, dst);
    }
    for (int t = 0; t < rows; t++) {
      const int ja = std::max(j0, row_lo[t]) - j0, jb = std::min(j0 + jn, row_hi[t]) - j0;
      for (int g = 0; ja < jb && g < group; g++) {
        const int i = t * group + g;
        const float* w = scores + static_cast<size_t>(i) * n + j0;
        float* a = acc + i * p.dv;
        int d = 0;
        for (; d + 4 * kKeys <= p.dv; d += 4 * kKeys)
          weighted_values<4>(w, ja, jb, value_rows, d, a + d);
        for (; d + kKeys <= p.dv; d += kKeys)
          weighted_values<1>(w, ja, jb, value_rows, d, a + d);
        for (; d < p.dv; d++)
          for (int j = ja; j < jb; j++) a[d] += w[j] * value_rows[j][d];
      }
    }
  }
  for (int t = 0; t < rows; t++) {
    const int64_t r = tile.first + t;
    for (int g = 0; g < group; g++) {
      const int i = t * group + g;
      const float inv = denom[i] > 0 ? 1.0f / denom[i] : 0.0f;
      for (int d = 0; d < p.dv; d++)
        store(p.out, p.q_type, ((r * p.heads) + h0 + g) * p.dv + d, acc[i * p.dv + d] * inv);
    }
  }
}

void attend(void* arg, int64_t item) {
  const AttnProblem& p = *static_cast<const AttnProblem*>(arg);
  const Tile& tile = p.tiles[item / p.kv_heads];
  const int nq = tile.count * (p.heads / p.kv_heads);
  std::unique_ptr<float[]> scratch(new float[scratch_floats(p, nq, tile.hi - tile.lo)]);
  attend_tile(p, item, scratch.get());
}

// Groups consecutive rows into tiles of at most max_rows: a row joins the tile when its
// keys are in the tile's first row's table (the same blocks: a verification or prefill
// run of one request) and touch the tile's keys (so every key the tile walks is some row's).
std::vector<Tile> make_tiles(const AttnProblem& p, int max_rows) {
  std::vector<Tile> tiles;
  const int group = p.heads / p.kv_heads;
  for (int64_t r = 0; r < p.rows; r++) {
    const int c = p.ctx[r];
    const int lo = p.window > 0 ? std::max(0, c - p.window) : 0;
    if (!tiles.empty()) {
      Tile& t = tiles.back();
      const int new_lo = std::min(t.lo, lo), new_hi = std::max(t.hi, c);
      bool joins = t.count < max_rows && lo <= t.hi && c >= t.lo &&
                   int64_t{t.count + 1} * group * (new_hi - new_lo) <= kTileFloats;
      const int32_t* first = p.tables + t.first * p.max_blocks;
      const int32_t* mine = p.tables + r * p.max_blocks;
      for (int b = lo / p.block_size; joins && b * p.block_size < c; b++)
        joins = mine[b] == first[b];
      if (joins) {
        t.count++, t.lo = new_lo, t.hi = new_hi;
        continue;
      }
    }
    tiles.push_back({r, 1, lo, std::max(lo, c)});
  }
  return tiles;
}

int head_dim_of(const mx::array& pool) {
  return pool.dtype() == mx::int8 ? pool.shape(3) - 4 : pool.shape(3);
}

// Checks every row's context length and blocks; returns how many keys the rows read.
int64_t check_rows(const AttnProblem& p) {
  int64_t keys = 0;
  const int64_t capacity = p.max_blocks * p.block_size;
  for (int64_t r = 0; r < p.rows; r++) {
    const int c = p.ctx[r];
    if (c < 0 || c > capacity)
      throw std::runtime_error("paged_attention: context length " + std::to_string(c) +
                               " of row " + std::to_string(r) + " is outside its table (" +
                               std::to_string(capacity) + " slots)");
    const int lo = p.window > 0 ? std::max(0, c - p.window) : 0;
    keys += c - lo;
    for (int b = lo / p.block_size; b * p.block_size < c; b++) {
      const int32_t blk = p.tables[r * p.max_blocks + b];
      if (blk < 0 || blk >= p.num_blocks)
        throw std::runtime_error("paged_attention: block " + std::to_string(blk) +
                                 " of row " + std::to_string(r) + " is outside the pool (" +
                                 std::to_string(p.num_blocks) + " blocks)");
    }
  }
  return keys;
}

}  // namespace

void paged_attention_rows(const PagedRows& r) {
  std::vector<char> kk, kv;
  const mx::array &k = *r.k_pool, &v = *r.v_pool;
  AttnProblem p;
  p.q = r.q;
  p.k = static_cast<const char*>(dense(k, kk));
  p.v = static_cast<const char*>(dense(v, kv));
  p.tables = r.tables;
  p.ctx = r.ctx;
  p.sinks = r.sinks;
  p.out = r.out;
  p.q_type = r.q_type;
  p.k_type = elem_of(k.dtype());
  p.v_type = elem_of(v.dtype());
  p.rows = r.rows;
  p.out_rows = r.out_rows;
  p.max_blocks = r.max_blocks;
  p.num_blocks = k.shape(0);
  p.heads = r.heads;
  p.kv_heads = k.shape(2);
  p.dk = r.dk;
  p.dv = head_dim_of(v);
  p.block_size = k.shape(1);
  p.window = r.window;
  p.k_row_bytes = static_cast<int64_t>(k.shape(3)) * k.itemsize();
  p.v_row_bytes = static_cast<int64_t>(v.shape(3)) * v.itemsize();
  p.scale = r.scale;
  const int64_t rows = r.rows;
  const int64_t keys = check_rows(p);
  const bool parallel = keys * p.heads * (p.dk + p.dv) >= (int64_t{1} << 17);  // ~MACs
  // Tiles as large as leave every thread about two work items (a tile's result is the
  // same at any size: only how often keys are loaded changes).
  const int64_t threads = parallel ? std::max(1, mlxserve_qmm_threads()) : 1;
  const int64_t fit = rows * p.kv_heads / (2 * threads);
  const int max_rows =
      static_cast<int>(threads == 1 ? kMaxTile : std::clamp<int64_t>(fit, 1, kMaxTile));
  const std::vector<Tile> tiles = make_tiles(p, max_rows);
  p.tiles = tiles.data();
  const int64_t items = static_cast<int64_t>(tiles.size()) * p.kv_heads;
  if (parallel) {
    mlxserve_qmm_parallel_for(items, attend, &p);
  } else {
    for (int64_t i = 0; i < items; i++) attend(&p, i);
  }
  const int64_t row_elems = static_cast<int64_t>(p.heads) * p.dv;
  for (int64_t i = rows * row_elems; i < p.out_rows * row_elems; i++)
    store(p.out, p.q_type, i, 0.0f);
}

namespace {

class CpuPagedAttention : public mx::UnaryPrimitive {
 public:
  CpuPagedAttention(mx::Stream s, int64_t rows, float scale, int window, bool sinks)
      : mx::UnaryPrimitive(s), rows_(rows), scale_(scale), window_(window), sinks_(sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    std::vector<mx::array> outputs = {out};
    auto in = start(stream(), inputs, outputs);  // inputs, then the output
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([in = std::move(in), rows = rows_, scale = scale_, window = window_,
                      sinks = sinks_]() mutable {
      std::vector<char> kq, kt, kc, ks;
      const mx::array& q = in[0];
      PagedRows r;
      r.q = dense(q, kq);
      r.q_type = elem_of(q.dtype());
      r.out_rows = q.shape(0);
      r.heads = q.shape(1);
      r.dk = q.shape(2);
      r.k_pool = &in[1];
      r.v_pool = &in[2];
      r.tables = static_cast<const int32_t*>(dense(in[3], kt));
      r.max_blocks = in[3].shape(1);
      r.ctx = static_cast<const int32_t*>(dense(in[4], kc));
      r.rows = rows;
      r.scale = scale;
      r.window = window;
      r.sinks = sinks ? static_cast<const float*>(dense(in[5], ks)) : nullptr;
      r.out = in.back().data<void>();
      paged_attention_rows(r);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxserve's paged attention primitive runs on the CPU only");
  }

  const char* name() const override { return "MlxserveCpuPagedAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuPagedAttention&>(other);
    return rows_ == o.rows_ && scale_ == o.scale_ && window_ == o.window_ && sinks_ == o.sinks_;
  }

 private:
  int64_t rows_;
  float scale_;
  int window_;
  bool sinks_;
};

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("paged_attention: " + what);
}

mx::array paged_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                          const mx::array& block_tables, const mx::array& context_lens,
                          int64_t num_rows, float scale, int window,
                          std::optional<mx::array> sinks) {
  check(q.ndim() == 3 && elem_of(q.dtype()) >= 0 && q.dtype() != mx::int8,
        "q must be (tokens, heads, head_dim) float32/float16/bfloat16");
  check(k_pool.ndim() == 4 && v_pool.ndim() == 4, "pools must be 4-D");
  check(elem_of(k_pool.dtype()) >= 0 && elem_of(v_pool.dtype()) >= 0,
        "pools must be float32, float16, bfloat16 or int8");
  check(k_pool.shape(0) == v_pool.shape(0) && k_pool.shape(1) == v_pool.shape(1) &&
            k_pool.shape(2) == v_pool.shape(2),
        "K and V pools must share blocks, block size and KV heads");
  const int kv_heads = k_pool.shape(2);
  check(q.shape(1) % kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  check(head_dim_of(k_pool) == q.shape(2), "q's head size differs from the K pool's");
  check(head_dim_of(v_pool) > 0 && head_dim_of(k_pool) > 0, "empty head size");
  check(block_tables.ndim() == 2 && block_tables.dtype() == mx::int32, "block_tables: int32 2-D");
  check(context_lens.ndim() == 1 && context_lens.dtype() == mx::int32, "context_lens: int32 1-D");
  check(num_rows >= 0 && num_rows <= q.shape(0) && num_rows <= block_tables.shape(0) &&
            num_rows <= context_lens.shape(0),
        "num_rows exceeds q, block_tables or context_lens");
  check(window >= 0, "window must be >= 0 (0: none)");
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  std::vector<mx::array> inputs = {q, k_pool, v_pool, block_tables, context_lens};
  if (sinks) {
    check(sinks->ndim() == 1 && sinks->shape(0) == q.shape(1), "sinks must be (num_heads,)");
    inputs.push_back(mx::astype(*sinks, mx::float32, s));
  }
  mx::Shape shape = {q.shape(0), q.shape(1), head_dim_of(v_pool)};
  return mx::array(shape, q.dtype(),
                   std::make_shared<CpuPagedAttention>(s, num_rows, scale, window,
                                                       sinks.has_value()),
                   std::move(inputs));
}

}  // namespace

void register_attention(nb::module_& m) {
  m.def("paged_attention", &paged_attention, "q"_a, "k_pool"_a, "v_pool"_a, "block_tables"_a,
        "context_lens"_a, "num_rows"_a, "scale"_a, "window"_a = 0, "sinks"_a = nb::none(),
        "Decode rows' attention over the block pool (one lazy op); rows from num_rows on "
        "are zeros.");
}

}  // namespace mlxserve_decode
