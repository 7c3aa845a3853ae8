// paged_decode.metal -- decode attention over the block pool, one threadgroup per
// (request, KV head, head group): the query heads of a GQA group, at most MLXS_MAX_ROWS of
// them per threadgroup, so K and V are read once per head group. Simdgroups take the
// context's blocks in turn through the block table.
//
// Template: T (q and out dtype; the cache's too unless KV_QUANT), HEAD_DIM, BLOCK_SIZE, GQA
//   (query heads per KV head), NUM_SIMD (simdgroups per threadgroup, NUM_SIMD * 32 >=
//   HEAD_DIM), WINDOW (sliding window in tokens, 0 = none), USE_SINKS (add sinks[head] to
//   each softmax denominator), KV_QUANT (the pools are int8 rows of HEAD_DIM + 4 bytes:
//   values then a float32 scale, attention_common.metal's MLXS_KV_ROW).
// Inputs: q (num_tokens, num_heads, HEAD_DIM); k_cache, v_cache (num_blocks, BLOCK_SIZE,
//   num_kv_heads, HEAD_DIM); block_tables (num_reqs, max_blocks) int32; context_lens
//   (num_reqs,) int32; scale () float32; sinks (num_heads,) float32, read only with
//   USE_SINKS. Request i's query is row i (decodes first).
// Output: out (rows, num_heads, HEAD_DIM), rows <= num_tokens; rows >= num_reqs (padding)
//   are zeros.
// Grid: (NUM_SIMD * 32 * num_kv_heads * MLXS_HEAD_GROUPS(GQA), rows, 1), threadgroup
//   (NUM_SIMD * 32, 1, 1).
static_assert(NUM_SIMD * 32 >= HEAD_DIM, "one thread per head dim when merging");
constexpr int DPL = MLXS_DIMS_PER_LANE(HEAD_DIM);
constexpr int HG = MLXS_HEAD_GROUPS(GQA);
constexpr int ROWS = MLXS_GROUP_HEADS(GQA);
threadgroup float tg_stats[2 * NUM_SIMD * ROWS];
threadgroup float tg_acc[NUM_SIMD * HEAD_DIM];

const int kv_head = int(threadgroup_position_in_grid.x) / HG;
const int head0 = (int(threadgroup_position_in_grid.x) % HG) * ROWS;  // first head in group
const int req = int(threadgroup_position_in_grid.y);
const uint simd = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;
const int num_kv_heads = k_cache_shape[2];
const int num_heads = num_kv_heads * GQA;
const int num_reqs = block_tables_shape[0];  // context_lens may be padded
const int max_blocks = block_tables_shape[1];
const int rows = metal::min(ROWS, GQA - head0);  // heads of this group (the last may be short)

device T* out_rows = out + (int64_t(req) * num_heads + kv_head * GQA + head0) * HEAD_DIM;
if (req >= num_reqs) {  // bucketing padding: nobody reads it, keep it defined
  for (int i = int(tid); i < rows * HEAD_DIM; i += NUM_SIMD * 32) {
    out_rows[i] = T(0.0f);
  }
  return;
}

const int ctx = context_lens[req];
const int t_first = window_first<WINDOW>(ctx - 1);
float qr[ROWS][DPL];
int start[ROWS];
int limit[ROWS];
for (int r = 0; r < ROWS; ++r) {
  const int64_t q_off = (int64_t(req) * num_heads + kv_head * GQA + head0 + r) * HEAD_DIM;
  for (int i = 0; i < DPL; ++i) {
    const int d = int(lane) + 32 * i;
    qr[r][i] = (r < rows && d < HEAD_DIM) ? static_cast<float>(q[q_off + d]) * scale : 0.0f;
  }
  limit[r] = r < rows ? ctx : 0;
  start[r] = t_first;
}

float m[ROWS];
float l[ROWS];
float acc[ROWS][DPL];
paged_attend<T, HEAD_DIM, BLOCK_SIZE, ROWS, NUM_SIMD, KV_QUANT>(
    qr, start, limit, k_cache, v_cache, block_tables + int64_t(req) * max_blocks, kv_head,
    num_kv_heads, t_first, ctx, simd, lane, m, l, acc);

publish_stats<ROWS, NUM_SIMD>(m, l, tg_stats, simd, lane);
for (int r = 0; r < rows; ++r) {
  float row_max;
  float row_sum;
  const float o = merge_row<HEAD_DIM, ROWS, NUM_SIMD>(
      r, m, acc, tg_stats, tg_acc, simd, lane, tid, row_max, row_sum);
  if (tid < uint(HEAD_DIM)) {
    const float y = USE_SINKS ? with_sink(o, row_max, row_sum, sinks[kv_head * GQA + head0 + r])
                              : o / row_sum;
    out_rows[r * HEAD_DIM + tid] = static_cast<T>(y);
  }
}
