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

// One work item's tile, KV head and rows' key ranges: a tile's query head i is (row t,
// group member g) at i = t * group + g; row t sees keys [row_lo[t], row_hi[t]) - tile.lo.
struct TileHead {
  const Tile* tile;
  int kvh, group, nq, lo, n, h0;
  int row_lo[kMaxTile], row_hi[kMaxTile];
  const int32_t* table;
};

inline TileHead tile_head(const AttnProblem& p, int64_t item) {
  TileHead th;
  th.tile = &p.tiles[item / p.kv_heads];
  th.kvh = static_cast<int>(item % p.kv_heads);
  th.group = p.heads / p.kv_heads;
  th.nq = th.tile->count * th.group;
  th.lo = th.tile->lo;
  th.n = th.tile->hi - th.tile->lo;
  th.h0 = th.kvh * th.group;
  for (int t = 0; t < th.tile->count; t++) {
    const int c = p.ctx[th.tile->first + t];
    th.row_lo[t] = (p.window > 0 ? std::max(0, c - p.window) : 0) - th.lo;
    th.row_hi[t] = std::max(th.row_lo[t], c - th.lo);
  }
  // Every row's keys are in the first row's table (make_tiles); each row's arithmetic is
  // the same sequence over its own keys as if it were alone: only the loads are shared.
  th.table = p.tables + th.tile->first * p.max_blocks;
  return th;
}

// (slot, KV head) row index of key position pos (from the tile's lo) in the pools.
inline int64_t pool_row(const AttnProblem& p, const TileHead& th, int pos) {
  pos += th.lo;
  return (static_cast<int64_t>(th.table[pos / p.block_size]) * p.block_size +
          pos % p.block_size) * p.kv_heads + th.kvh;
}

// Floats of scratch each phase needs for a tile of nq query heads.
size_t scores_scratch(const AttnProblem& p, int nq) {
  return static_cast<size_t>(nq) * p.dk + static_cast<size_t>(kKeys) * 2 * p.dk;
}
size_t values_scratch(const AttnProblem& p, int nq) {
  return static_cast<size_t>(nq) * p.dv + static_cast<size_t>(kKeys) * p.dv;
}

// The three phases of a work item, each over a part of it; run whole and in order they are
// the item (attend_tile), and any split gives the same bits: a score is one key's dot
// product, a row's softmax reads all its scores, a value sum runs over the keys in order.
// The scores of keys [a, b) of the tile (a a multiple of kKeys) for all its query heads:
// scores (nq, n), each row only over its own keys (the others are never read).
__attribute__((always_inline)) inline void scores_part(const AttnProblem& p, const TileHead& th,
                                                       int a, int b, float* scores,
                                                       float* scratch) {
  float* qf = scratch;                                     // (nq, dk)
  float* kt = qf + static_cast<size_t>(th.nq) * p.dk;      // (dk, kKeys): keys transposed
  float* krows = kt + static_cast<size_t>(p.dk) * kKeys;  // (kKeys, dk): dequantized ones
  const int rows = th.tile->count;
  for (int t = 0; t < rows; t++) {
    const int64_t r = th.tile->first + t;
    for (int g = 0; g < th.group; g++)
      for (int d = 0; d < p.dk; d++)
        qf[(t * th.group + g) * p.dk + d] =
            load(p.q, p.q_type, ((r * p.heads) + th.h0 + g) * p.dk + d);
  }
  const float* key_rows[kKeys];
  for (int j0 = a; j0 < b; j0 += kKeys) {
    const int jn = std::min(kKeys, b - j0);
    for (int j = 0; j < kKeys; j++) {  // past jn: a copy of the last, never read
      const char* row = p.k + pool_row(p, th, j0 + std::min(j, jn - 1)) * p.k_row_bytes;
      key_rows[j] = row_f32(row, p.k_type, p.dk, krows + static_cast<size_t>(j) * p.dk);
    }
    transpose_keys(key_rows, p.dk, kt);
    for (int t = 0; t < rows; t++) {
      if (j0 + jn <= th.row_lo[t] || j0 >= th.row_hi[t]) continue;
      for (int g = 0; g < th.group; g++) {
        const int i = t * th.group + g;
        float dot_out[kKeys];
        dots(qf + i * p.dk, kt, p.dk, p.scale, dot_out);
        float* s = scores + static_cast<size_t>(i) * th.n + j0;  // keys out of the row's
        if (jn == kKeys)                                           // range are never read
          std::memcpy(s, dot_out, sizeof dot_out);
        else
          for (int j = 0; j < jn; j++) s[j] = dot_out[j];
      }
    }
  }
}

// Query heads [i0, i1) of the tile: their scores become softmax numerators, denom[i] their sum.
__attribute__((always_inline)) inline void softmax_part(const AttnProblem& p, const TileHead& th,
                                                        int i0, int i1, float* scores,
                                                        float* denom) {
  for (int i = i0; i < i1; i++) {
    const int t = i / th.group;
    float* s = scores + static_cast<size_t>(i) * th.n + th.row_lo[t];
    const float* sink = p.sinks ? p.sinks + th.h0 + i % th.group : nullptr;
    denom[i] = softmax_numerators(s, th.row_hi[t] - th.row_lo[t], sink);
  }
}

// Value elements [d0, d1) (d0 a multiple of kKeys) of every query head of the tile: the
// numerators' weighted sums over the keys in order, times 1 / denom, into the output.
__attribute__((always_inline)) inline void values_part(const AttnProblem& p, const TileHead& th,
                                                       int d0, int d1, const float* scores,
                                                       const float* denom, float* scratch) {
  const int width = d1 - d0;
  float* acc = scratch;                                    // (nq, width)
  float* vb = acc + static_cast<size_t>(th.nq) * width;  // (kKeys, dv): dequantized rows
  std::fill(acc, acc + static_cast<size_t>(th.nq) * width, 0.0f);
  const int rows = th.tile->count;
  // kKeys keys at a time: a row's accumulator stays in registers over the block (up to 64
  // elements at once), each element summing the keys in order as alone.
  for (int j0 = 0; j0 < th.n; j0 += kKeys) {
    const int jn = std::min(kKeys, th.n - j0);
    const float* value_rows[kKeys];  // float32 pools are read in place
    for (int j = 0; j < jn; j++) {
      float* dst = vb + static_cast<size_t>(j) * p.dv;
      value_rows[j] = row_f32(p.v + pool_row(p, th, j0 + j) * p.v_row_bytes, p.v_type, p.dv, dst);
    }
    for (int t = 0; t < rows; t++) {
      const int ja = std::max(j0, th.row_lo[t]) - j0;
      const int jb = std::min(j0 + jn, th.row_hi[t]) - j0;
      for (int g = 0; ja < jb && g < th.group; g++) {
        const int i = t * th.group + g;
        const float* w = scores + static_cast<size_t>(i) * th.n + j0;
        float* out = acc + static_cast<size_t>(i) * width;
        int d = 0;
        for (; d + 4 * kKeys <= width; d += 4 * kKeys)
          weighted_values<4>(w, ja, jb, value_rows, d0 + d, out + d);
        for (; d + kKeys <= width; d += kKeys)
          weighted_values<1>(w, ja, jb, value_rows, d0 + d, out + d);
        for (; d < width; d++)
          for (int j = ja; j < jb; j++) out[d] += w[j] * value_rows[j][d0 + d];
      }
    }
  }
  for (int t = 0; t < rows; t++) {
    const int64_t r = th.tile->first + t;
    for (int g = 0; g < th.group; g++) {
      const int i = t * th.group + g;
      const float inv = denom[i] > 0 ? 1.0f / denom[i] : 0.0f;
      for (int d = 0; d < width; d++)
        store(p.out, p.q_type, ((r * p.heads) + th.h0 + g) * p.dv + d0 + d,
              acc[static_cast<size_t>(i) * width + d] * inv);
    }
  }
}

// One work item whole: a tile's rows on one KV head. No library types inside: clang (19)
// does not emit the inline library functions only target clones call (the library then
// failed to load: "undefined symbol: std::allocator<float>::allocator()"), so callers
// allocate. scratch: scores (nq, n), denom (nq), then the larger phase's scratch.
MLXSERVE_CLONES void attend_tile(const AttnProblem& p, int64_t item, float* scratch) {
  const TileHead th = tile_head(p, item);
  float* scores = scratch;
  float* denom = scores + static_cast<size_t>(th.nq) * th.n;
  float* rest = denom + th.nq;
  scores_part(p, th, 0, th.n, scores, rest);
  softmax_part(p, th, 0, th.nq, scores, denom);
  values_part(p, th, 0, p.dv, scores, denom, rest);
}

size_t attend_scratch(const AttnProblem& p, int nq, int n) {
  return static_cast<size_t>(nq) * (n + 1) +
         std::max(scores_scratch(p, nq), values_scratch(p, nq));
}

void attend(void* arg, int64_t item) {
  const AttnProblem& p = *static_cast<const AttnProblem*>(arg);
  const Tile& tile = p.tiles[item / p.kv_heads];
  const int nq = tile.count * (p.heads / p.kv_heads);
  std::unique_ptr<float[]> scratch(new float[attend_scratch(p, nq, tile.hi - tile.lo)]);
  attend_tile(p, item, scratch.get());
}

// Too few work items for the threads (one decode row has as many as KV heads): each phase
// is its own parallel loop over parts of the items, the scores and sums kept between them.
struct SplitWork {
  const AttnProblem* p;
  const size_t* offset;  // item -> its scores (nq, n) then denom (nq) in buf
  float* buf;
  int key_parts, key_step;  // keys per part: a multiple of kKeys
  int value_parts, value_step;
};

MLXSERVE_CLONES void split_scores(const SplitWork& w, int64_t part, float* scratch) {
  const AttnProblem& p = *w.p;
  const int64_t item = part / w.key_parts;
  const TileHead th = tile_head(p, item);
  const int a = static_cast<int>(part % w.key_parts) * w.key_step;
  const int b = std::min(th.n, a + w.key_step);
  if (a < b) scores_part(p, th, a, b, w.buf + w.offset[item], scratch);
}

MLXSERVE_CLONES void split_softmax(const SplitWork& w, int64_t item) {
  const AttnProblem& p = *w.p;
  const TileHead th = tile_head(p, item);
  float* scores = w.buf + w.offset[item];
  softmax_part(p, th, 0, th.nq, scores, scores + static_cast<size_t>(th.nq) * th.n);
}

MLXSERVE_CLONES void split_values(const SplitWork& w, int64_t part, float* scratch) {
  const AttnProblem& p = *w.p;
  const int64_t item = part / w.value_parts;
  const TileHead th = tile_head(p, item);
  const int d0 = static_cast<int>(part % w.value_parts) * w.value_step;
  const int d1 = std::min(p.dv, d0 + w.value_step);
  const float* scores = w.buf + w.offset[item];
  if (d0 < d1)
    values_part(p, th, d0, d1, scores, scores + static_cast<size_t>(th.nq) * th.n, scratch);
}

int tile_nq(const SplitWork& w, int64_t item) {
  return w.p->tiles[item / w.p->kv_heads].count * (w.p->heads / w.p->kv_heads);
}

void split_scores_fn(void* arg, int64_t part) {
  const SplitWork& w = *static_cast<const SplitWork*>(arg);
  std::unique_ptr<float[]> scratch(
      new float[scores_scratch(*w.p, tile_nq(w, part / w.key_parts))]);
  split_scores(w, part, scratch.get());
}

void split_softmax_fn(void* arg, int64_t item) {
  split_softmax(*static_cast<const SplitWork*>(arg), item);
}

void split_values_fn(void* arg, int64_t part) {
  const SplitWork& w = *static_cast<const SplitWork*>(arg);
  std::unique_ptr<float[]> scratch(
      new float[values_scratch(*w.p, tile_nq(w, part / w.value_parts))]);
  split_values(w, part, scratch.get());
}

// The items of p in three parallel loops, each with at least `want` parts.
void attend_split(const AttnProblem& p, int64_t items, int64_t want) {
  SplitWork w;
  w.p = &p;
  std::vector<size_t> offset;
  size_t total = 0;
  int longest = 0;
  for (int64_t item = 0; item < items; item++) {
    const Tile& tile = p.tiles[item / p.kv_heads];
    const int nq = tile.count * (p.heads / p.kv_heads);
    offset.push_back(total);
    total += static_cast<size_t>(nq) * (tile.hi - tile.lo + 1);
    longest = std::max(longest, tile.hi - tile.lo);
  }
  std::unique_ptr<float[]> buf(new float[total]);
  w.offset = offset.data();
  w.buf = buf.get();
  const int64_t per_item = (want + items - 1) / items;
  const int blocks = (longest + kKeys - 1) / kKeys;
  w.key_parts = static_cast<int>(std::clamp<int64_t>(per_item, 1, std::max(1, blocks)));
  w.key_step = (blocks + w.key_parts - 1) / w.key_parts * kKeys;
  const int chunks = (p.dv + kKeys - 1) / kKeys;
  w.value_parts = static_cast<int>(std::clamp<int64_t>(per_item, 1, chunks));
  w.value_step = (chunks + w.value_parts - 1) / w.value_parts * kKeys;
  mlxserve_qmm_parallel_for(items * w.key_parts, split_scores_fn, &w);
  mlxserve_qmm_parallel_for(items, split_softmax_fn, &w);
  mlxserve_qmm_parallel_for(items * w.value_parts, split_values_fn, &w);
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
  if (parallel && items < 2 * threads) {
    attend_split(p, items, 4 * threads);
  } else if (parallel) {
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
