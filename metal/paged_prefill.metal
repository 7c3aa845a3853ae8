// paged_prefill.metal -- varlen attention for a batch that mixes prefill chunks and decodes:
// each new token attends over its request's cached prefix in the block pool plus the causal
// part of its own chunk (whose K/V are already written to the pool).
//
// Query tiles: a threadgroup owns one KV head, a head group of it (MLXS_GROUP_HEADS(GQA)
// query heads; one group unless GQA > MLXS_MAX_ROWS) and TQ consecutive query tokens of one
// request (ROWS = TQ x group heads <= MLXS_MAX_ROWS), so every K/V row it reads serves all
// of them. Requests from req_begin on have ceil(query_len_i / TQ) tiles each, numbered in
// request order (the requests before req_begin, decodes attended by the split-K kernels,
// get none and their rows are not written); tiles past the last request zero the padding
// rows (bucketing) after the real tokens.
//
// Template: T, HEAD_DIM, BLOCK_SIZE, GQA, NUM_SIMD, WINDOW, USE_SINKS, KV_QUANT (as
//   paged_decode.metal), TQ.
// Inputs: q (num_tokens, num_heads, HEAD_DIM); k_cache, v_cache (num_blocks, BLOCK_SIZE,
//   num_kv_heads, HEAD_DIM); block_tables (num_reqs, max_blocks) int32; context_lens
//   (num_reqs,) int32, cached + new tokens; query_start_loc (num_reqs + 1,) int32;
//   req_begin () int32; scale () float32; sinks (num_heads,) float32, read only with
//   USE_SINKS.
// Output: out (num_tokens, num_heads, HEAD_DIM).
// Grid: (NUM_SIMD * 32 * num_kv_heads * MLXS_HEAD_GROUPS(GQA), num_tiles, 1) with num_tiles
//   at least num_reqs + ceil(num_tokens / TQ); threadgroup (NUM_SIMD * 32, 1, 1).
static_assert(NUM_SIMD * 32 >= HEAD_DIM, "one thread per head dim when merging");
constexpr int DPL = MLXS_DIMS_PER_LANE(HEAD_DIM);
constexpr int HG = MLXS_HEAD_GROUPS(GQA);
constexpr int GH = MLXS_GROUP_HEADS(GQA);
constexpr int ROWS = TQ * GH;
static_assert(ROWS <= MLXS_MAX_ROWS, "row registers are capped");
threadgroup float tg_stats[2 * NUM_SIMD * ROWS];
threadgroup float tg_acc[NUM_SIMD * HEAD_DIM];

const int kv_head = int(threadgroup_position_in_grid.x) / HG;
const int head0 = (int(threadgroup_position_in_grid.x) % HG) * GH;  // first head in group
const int heads = metal::min(GH, GQA - head0);  // heads of this group (the last may be short)
const int tile = int(threadgroup_position_in_grid.y);
const uint simd = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;
const int num_kv_heads = k_cache_shape[2];
const int num_heads = num_kv_heads * GQA;
const int num_reqs = block_tables_shape[0];  // context_lens may be padded
const int max_blocks = block_tables_shape[1];
const int num_tokens = q_shape[0];

// Which request and which of its query tokens this tile covers.
int req = -1;
int first = 0;  // first query token (row of q) of the tile
int count = 0;  // query tokens in the tile
int seen = 0;   // tiles of the requests before
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
// Query token `first + j` sits at sequence position ctx - req_q_len + (first + j - req_q_begin).
const int first_pos = ctx - req_q_len + (first - req_q_begin);
float qr[ROWS][DPL];
int start[ROWS];
int limit[ROWS];
for (int r = 0; r < ROWS; ++r) {
  const int j = r / GH;
  const int g = head0 + r % GH;
  const bool used = j < count && g < GQA;
  limit[r] = used ? first_pos + j + 1 : 0;
  start[r] = window_first<WINDOW>(first_pos + j);
  const int64_t q_off = (int64_t(first + j) * num_heads + kv_head * GQA + g) * HEAD_DIM;
  for (int i = 0; i < DPL; ++i) {
    const int d = int(lane) + 32 * i;
    qr[r][i] = (used && d < HEAD_DIM) ? static_cast<float>(q[q_off + d]) * scale : 0.0f;
  }
}

float m[ROWS];
float l[ROWS];
float acc[ROWS][DPL];
paged_attend<T, HEAD_DIM, BLOCK_SIZE, ROWS, NUM_SIMD, KV_QUANT>(
    qr, start, limit, k_cache, v_cache, block_tables + int64_t(req) * max_blocks, kv_head,
    num_kv_heads, window_first<WINDOW>(first_pos), first_pos + count, simd, lane, m, l, acc);

publish_stats<ROWS, NUM_SIMD>(m, l, tg_stats, simd, lane);
for (int r = 0; r < count * GH; ++r) {
  const int j = r / GH;
  const int g = head0 + r % GH;
  if (g >= GQA) {  // a short last head group: uniform in the threadgroup
    continue;
  }
  float row_max;
  float row_sum;
  const float o = merge_row<HEAD_DIM, ROWS, NUM_SIMD>(
      r, m, acc, tg_stats, tg_acc, simd, lane, tid, row_max, row_sum);
  if (tid < uint(HEAD_DIM)) {
    const float y = USE_SINKS ? with_sink(o, row_max, row_sum, sinks[kv_head * GQA + g])
                              : o / row_sum;
    out[(int64_t(first + j) * num_heads + kv_head * GQA + g) * HEAD_DIM + tid] =
        static_cast<T>(y);
  }
}
