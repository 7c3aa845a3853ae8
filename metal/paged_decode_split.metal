// paged_decode_split.metal -- first pass of split-K decode attention, for long contexts and
// small batches: threadgroup (request, KV head and head group, partition) attends over
// tokens [p * PARTITION_SIZE, (p + 1) * PARTITION_SIZE) of the context and writes an
// unnormalized partial output with its softmax max and sum; paged_decode_reduce.metal
// combines them.
//
// Template: T, HEAD_DIM, BLOCK_SIZE, GQA, NUM_SIMD, WINDOW, KV_QUANT (as paged_decode.metal),
//   PARTITION_SIZE. Under a window, partitions wholly before it are skipped (not written).
// Inputs: q, k_cache, v_cache, block_tables, context_lens, scale (as paged_decode.metal).
// Outputs (float32): partial_out (>= rows, num_heads, num_partitions, HEAD_DIM),
//   partial_max and partial_sum (>= rows, num_heads, num_partitions). Only partitions that
//   start inside the context of a real request are written; the reduce reads only those.
// Grid: (NUM_SIMD * 32 * num_kv_heads * MLXS_HEAD_GROUPS(GQA), rows, num_partitions),
//   threadgroup (NUM_SIMD * 32, 1, 1); rows: the decodes (request i's query is row i).
static_assert(NUM_SIMD * 32 >= HEAD_DIM, "one thread per head dim when merging");
constexpr int DPL = MLXS_DIMS_PER_LANE(HEAD_DIM);
constexpr int HG = MLXS_HEAD_GROUPS(GQA);
constexpr int ROWS = MLXS_GROUP_HEADS(GQA);
threadgroup float tg_stats[2 * NUM_SIMD * ROWS];
threadgroup float tg_acc[NUM_SIMD * HEAD_DIM];

const int kv_head = int(threadgroup_position_in_grid.x) / HG;
const int head0 = (int(threadgroup_position_in_grid.x) % HG) * ROWS;
const int req = int(threadgroup_position_in_grid.y);
const int part = int(threadgroup_position_in_grid.z);
const int num_parts = int(threadgroups_per_grid.z);
const uint simd = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;
const int num_kv_heads = k_cache_shape[2];
const int num_heads = num_kv_heads * GQA;
const int num_reqs = block_tables_shape[0];  // context_lens may be padded
const int max_blocks = block_tables_shape[1];
const int rows = metal::min(ROWS, GQA - head0);

if (req >= num_reqs) {
  return;
}
const int ctx = context_lens[req];
const int t_first = part * PARTITION_SIZE;
if (t_first >= ctx) {
  return;
}
const int t_end = metal::min(ctx, t_first + PARTITION_SIZE);
const int t_begin = metal::max(t_first, window_first<WINDOW>(ctx - 1));
if (t_begin >= t_end) {
  return;
}

float qr[ROWS][DPL];
int start[ROWS];
int limit[ROWS];
for (int r = 0; r < ROWS; ++r) {
  const int64_t q_off = (int64_t(req) * num_heads + kv_head * GQA + head0 + r) * HEAD_DIM;
  for (int i = 0; i < DPL; ++i) {
    const int d = int(lane) + 32 * i;
    qr[r][i] = (r < rows && d < HEAD_DIM) ? static_cast<float>(q[q_off + d]) * scale : 0.0f;
  }
  limit[r] = r < rows ? t_end : 0;
  start[r] = t_begin;
}

float m[ROWS];
float l[ROWS];
float acc[ROWS][DPL];
paged_attend<T, HEAD_DIM, BLOCK_SIZE, ROWS, NUM_SIMD, KV_QUANT>(
    qr, start, limit, k_cache, v_cache, block_tables + int64_t(req) * max_blocks, kv_head,
    num_kv_heads, t_begin, t_end, simd, lane, m, l, acc);

publish_stats<ROWS, NUM_SIMD>(m, l, tg_stats, simd, lane);
for (int r = 0; r < rows; ++r) {
  float row_max;
  float row_sum;
  const float o = merge_row<HEAD_DIM, ROWS, NUM_SIMD>(
      r, m, acc, tg_stats, tg_acc, simd, lane, tid, row_max, row_sum);
  const int64_t slot = (int64_t(req) * num_heads + kv_head * GQA + head0 + r) * num_parts + part;
  if (tid < uint(HEAD_DIM)) {
    partial_out[slot * HEAD_DIM + tid] = o;
  }
  if (tid == 0) {
    partial_max[slot] = row_max;
    partial_sum[slot] = row_sum;
  }
}
