// paged_prefill_tiled.metal -- varlen attention for a batch with prefill chunks, on
// simdgroup matrices: each new token attends over its request's cached prefix in the block
// pool plus the causal part of its own chunk (whose K/V are already written to the pool).
//
// Query tiles: a threadgroup owns one KV head, a head group of it (all GQA heads unless
// GQA > 32) and TQ consecutive query tokens of one request: 32 rows (token x head), 8 per
// simdgroup, held as 8x8 simdgroup matrices across head_dim. Keys and values come in tiles
// of BK tokens, gathered through the block table into threadgroup memory (K transposed,
// then V in the same buffer) and shared by the 4 simdgroups: S = Q K^T and O += P V are
// simdgroup_multiply_accumulate over 8x8 tiles, with an online softmax per row in between.
// The kernel never relies on how a simdgroup matrix is spread over lanes: scores go
// through threadgroup memory for the softmax, and the rescaling of O by each row's
// correction is a product with a diagonal matrix.
// Tiles are numbered as in paged_prefill.metal (requests from req_begin on, then padding).
//
// Template: T, HEAD_DIM (a multiple of 8), BLOCK_SIZE, GQA, WINDOW, USE_SINKS, KV_QUANT (as
//   paged_decode.metal), TQ (query tokens per tile: 32 / heads per group).
// Inputs: as paged_prefill.metal.
// Output: out (num_tokens, num_heads, HEAD_DIM).
// Grid: (128 * num_kv_heads * head groups, num_tiles, 1) with head groups
//   ceil(GQA / 32) and num_tiles at least num_reqs + ceil(num_tokens / TQ); threadgroup
//   (128, 1, 1).
constexpr int NUM_SIMD = 4;
constexpr int BQ = 8 * NUM_SIMD;  // rows per tile
constexpr int BK = 16;            // keys per K/V tile
constexpr int D8 = HEAD_DIM / 8;  // 8-wide column tiles of head_dim
constexpr int HG = (GQA + BQ - 1) / BQ;
constexpr int GH = (GQA + HG - 1) / HG;  // heads per group
static_assert(HEAD_DIM % 8 == 0, "head_dim in 8x8 tiles");
static_assert(TQ * GH <= BQ, "a tile holds at most 32 rows");
threadgroup float kv[BK * HEAD_DIM];           // K^T (HEAD_DIM x BK), then V (BK x HEAD_DIM)
threadgroup int64_t kv_row[BK];                // pool row of each key of the tile, -1: none
threadgroup float scores[NUM_SIMD * 8 * BK];   // per simdgroup: S, then P (8 x BK)
threadgroup float diag[NUM_SIMD * 64];         // per simdgroup: diag(correction)
threadgroup float stage[NUM_SIMD * 64];        // per simdgroup: an 8x8 tile of q or out
threadgroup float row_stats[NUM_SIMD * 16];    // per simdgroup: max, then sum of each row

const int kv_head = int(threadgroup_position_in_grid.x) / HG;
const int head0 = (int(threadgroup_position_in_grid.x) % HG) * GH;
const int heads = metal::min(GH, GQA - head0);
const int tile = int(threadgroup_position_in_grid.y);
const uint simd = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;
const int num_kv_heads = k_cache_shape[2];
const int num_heads = num_kv_heads * GQA;
const int num_reqs = block_tables_shape[0];
const int max_blocks = block_tables_shape[1];
const int num_tokens = q_shape[0];

int req = -1;
int first = 0;
int count = 0;
int seen = 0;
for (int i = req_begin; i < num_reqs; ++i) {
  const int q_begin = query_start_loc[i];
  const int q_len = query_start_loc[i + 1] - q_begin;
  const int n = (q_len + TQ - 1) / TQ;
  if (tile < seen + n) {
    req = i;
    first = q_begin + (tile - seen) * TQ;
    count = metal::min(TQ, q_begin + q_len - first);
    break;
  }
  seen += n;
}
if (req < 0) {  // padding rows after the last request, TQ per tile
  const int pad_first = query_start_loc[num_reqs] + (tile - seen) * TQ;
  const int pad_end = metal::min(pad_first + TQ, num_tokens);
  for (int t = pad_first; t < pad_end; ++t) {
    device T* o = out + (int64_t(t) * num_heads + kv_head * GQA + head0) * HEAD_DIM;
    for (int i = int(tid); i < heads * HEAD_DIM; i += NUM_SIMD * 32) {
      o[i] = T(0.0f);
    }
  }
  return;
}

const int ctx = context_lens[req];
const int req_q_begin = query_start_loc[req];
const int req_q_len = query_start_loc[req + 1] - req_q_begin;
const int first_pos = ctx - req_q_len + (first - req_q_begin);
device const int* table = block_tables + int64_t(req) * max_blocks;

// Row r of this simdgroup is tile row 8 * simd + r: token j = row / GH, head head0 + row % GH.
threadgroup float* my_scores = scores + simd * 8 * BK;
threadgroup float* my_diag = diag + simd * 64;
threadgroup float* my_stage = stage + simd * 64;

// Q, scaled, into simdgroup matrices: 8x8 tiles staged through threadgroup memory.
simdgroup_float8x8 qf[D8];
for (int c = 0; c < D8; ++c) {
  for (int e = 0; e < 2; ++e) {
    const int idx = int(lane) * 2 + e;
    const int row = int(simd) * 8 + idx / 8;
    const int j = row / GH;
    const int g = head0 + row % GH;
    const int64_t q_off = (int64_t(first + j) * num_heads + kv_head * GQA + g) * HEAD_DIM;
    const bool used = row < TQ * GH && j < count && g < GQA;
    my_stage[idx] = used ? static_cast<float>(q[q_off + c * 8 + idx % 8]) * scale : 0.0f;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_load(qf[c], my_stage);
  simdgroup_barrier(mem_flags::mem_threadgroup);  // loaded before the next tile overwrites
}
for (int e = 0; e < 2; ++e) {
  my_diag[int(lane) * 2 + e] = 0.0f;
}

// Lanes 0-7 keep the online softmax of row `lane` of their simdgroup.
const int my_row = int(simd) * 8 + int(lane);
const int my_j = my_row / GH;
const bool my_used = lane < 8 && my_row < TQ * GH && my_j < count && head0 + my_row % GH < GQA;
const int my_limit = my_used ? first_pos + my_j + 1 : 0;  // keys [my_start, my_limit)
const int my_start = window_first<WINDOW>(first_pos + my_j);
float m = MLXS_NEG_BIG;
float l = 0.0f;

simdgroup_float8x8 of[D8];
for (int c = 0; c < D8; ++c) {
  of[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

const int kv_end = first_pos + count;
for (int kb = window_first<WINDOW>(first_pos); kb < kv_end; kb += BK) {
  // No barrier needed here: the last tile's kv_row reads all precede its barrier after V.
  if (tid < uint(BK)) {
    const int t = kb + int(tid);
    kv_row[tid] = t < kv_end
        ? ((int64_t(table[t / BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE) * num_kv_heads +
           kv_head) * MLXS_KV_ROW(HEAD_DIM, KV_QUANT)
        : int64_t(-1);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = int(tid); i < BK * HEAD_DIM; i += NUM_SIMD * 32) {
    const int key = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    const int64_t at = kv_row[key];
    kv[d * BK + key] = at >= 0 ? static_cast<float>(k_cache[at + d]) *
                                     kv_row_scale<KV_QUANT, HEAD_DIM>(k_cache + at)
                               : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // S = Q K^T, 8 rows x BK keys of this simdgroup.
  for (int n = 0; n < BK / 8; ++n) {
    simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int c = 0; c < D8; ++c) {
      simdgroup_float8x8 kt;
      simdgroup_load(kt, kv + c * 8 * BK + n * 8, BK);
      simdgroup_multiply_accumulate(s, qf[c], kt, s);
    }
    simdgroup_store(s, my_scores + n * 8, BK);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  // Online softmax of each row over this tile: P replaces S, the correction goes on diag.
  if (lane < 8) {
    float tile_max = MLXS_NEG_BIG;
    for (int k = 0; k < BK; ++k) {
      const int t = kb + k;
      if (t >= my_start && t < my_limit) {
        tile_max = metal::max(tile_max, my_scores[lane * BK + k]);
      }
    }
    const float m_new = metal::max(m, tile_max);
    const float correction = metal::fast::exp(m - m_new);
    float sum = 0.0f;
    for (int k = 0; k < BK; ++k) {
      const int t = kb + k;
      const float p = (t >= my_start && t < my_limit)
                          ? metal::fast::exp(my_scores[lane * BK + k] - m_new)
                          : 0.0f;
      my_scores[lane * BK + k] = p;
      sum += p;
    }
    l = l * correction + sum;
    m = m_new;
    my_diag[lane * 9] = correction;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 rescale;
  simdgroup_load(rescale, my_diag);
  for (int c = 0; c < D8; ++c) {
    simdgroup_multiply(of[c], rescale, of[c]);
  }

  threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with K^T
  for (int i = int(tid); i < BK * HEAD_DIM; i += NUM_SIMD * 32) {
    const int key = i / HEAD_DIM;
    const int64_t at = kv_row[key];
    kv[i] = at >= 0 ? static_cast<float>(v_cache[at + i % HEAD_DIM]) *
                          kv_row_scale<KV_QUANT, HEAD_DIM>(v_cache + at)
                    : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // O += P V.
  for (int n = 0; n < BK / 8; ++n) {
    simdgroup_float8x8 p;
    simdgroup_load(p, my_scores + n * 8, BK);
    for (int c = 0; c < D8; ++c) {
      simdgroup_float8x8 v;
      simdgroup_load(v, kv + n * 8 * HEAD_DIM + c * 8, HEAD_DIM);
      simdgroup_multiply_accumulate(of[c], p, v, of[c]);
    }
  }
}

// Normalize and write each used row.
if (lane < 8) {
  row_stats[simd * 16 + lane] = m;
  row_stats[simd * 16 + 8 + lane] = l;
}
simdgroup_barrier(mem_flags::mem_threadgroup);
for (int c = 0; c < D8; ++c) {
  simdgroup_store(of[c], my_stage);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = 0; e < 2; ++e) {
    const int idx = int(lane) * 2 + e;
    const int r = idx / 8;
    const int row = int(simd) * 8 + r;
    const int j = row / GH;
    const int g = head0 + row % GH;
    if (row < TQ * GH && j < count && g < GQA) {
      const float o = my_stage[idx];
      const float row_max = row_stats[simd * 16 + r];
      const float row_sum = row_stats[simd * 16 + 8 + r];
      const float y = USE_SINKS ? with_sink(o, row_max, row_sum, sinks[kv_head * GQA + g])
                                : o / row_sum;
      out[(int64_t(first + j) * num_heads + kv_head * GQA + g) * HEAD_DIM + c * 8 + idx % 8] =
          static_cast<T>(y);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // read before the next store
}
