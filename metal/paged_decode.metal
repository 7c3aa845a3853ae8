// paged_decode.metal -- decode attention over the block pool, one threadgroup per
// (request, KV head) handling every query head of that GQA group, so K and V are read once
// per group. Simdgroups stride over the context tokens through the block table.
//
// Template: T (q, cache and out dtype), HEAD_DIM, BLOCK_SIZE, GQA (query heads per KV head),
//   NUM_SIMD (simdgroups per threadgroup, NUM_SIMD * 32 >= HEAD_DIM), WINDOW (sliding window
//   in tokens, 0 = none), USE_SINKS (add sinks[head] to each softmax denominator).
// Inputs: q (num_tokens, num_heads, HEAD_DIM); k_cache, v_cache (num_blocks, BLOCK_SIZE,
//   num_kv_heads, HEAD_DIM); block_tables (num_reqs, max_blocks) int32; context_lens
//   (num_reqs,) int32; scale () float32; sinks (num_heads,) float32, read only with
//   USE_SINKS. Request i's query is row i (decodes only).
// Output: out (num_tokens, num_heads, HEAD_DIM); rows >= num_reqs (padding) are zeros.
// Grid: (NUM_SIMD * 32 * num_kv_heads, num_tokens, 1), threadgroup (NUM_SIMD * 32, 1, 1).
static_assert(NUM_SIMD * 32 >= HEAD_DIM, "one thread per head dim when merging");
constexpr int DPL = MLXS_DIMS_PER_LANE(HEAD_DIM);
threadgroup float tg_stats[2 * NUM_SIMD * GQA];
threadgroup float tg_acc[NUM_SIMD * HEAD_DIM];

const int kv_head = int(threadgroup_position_in_grid.x);
const int req = int(threadgroup_position_in_grid.y);
const uint simd = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;
const int num_kv_heads = k_cache_shape[2];
const int num_heads = num_kv_heads * GQA;
const int num_reqs = block_tables_shape[0];  // context_lens may be padded
const int max_blocks = block_tables_shape[1];

device T* out_rows = out + (int64_t(req) * num_heads + kv_head * GQA) * HEAD_DIM;
if (req >= num_reqs) {  // bucketing padding: nobody reads it, keep it defined
  for (int i = int(tid); i < GQA * HEAD_DIM; i += NUM_SIMD * 32) {
    out_rows[i] = T(0.0f);
  }
  return;
}

const int ctx = context_lens[req];
const int t_first = window_first<WINDOW>(ctx - 1);
float qr[GQA][DPL];
int start[GQA];
int limit[GQA];
for (int r = 0; r < GQA; ++r) {
  const int64_t q_off = (int64_t(req) * num_heads + kv_head * GQA + r) * HEAD_DIM;
  for (int i = 0; i < DPL; ++i) {
    const int d = int(lane) + 32 * i;
    qr[r][i] = d < HEAD_DIM ? static_cast<float>(q[q_off + d]) * scale : 0.0f;
  }
  limit[r] = ctx;
  start[r] = t_first;
}

float m[GQA];
float l[GQA];
float acc[GQA][DPL];
paged_attend<T, HEAD_DIM, BLOCK_SIZE, GQA>(
    qr, start, limit, k_cache, v_cache, block_tables + int64_t(req) * max_blocks, kv_head,
    num_kv_heads, t_first + int(simd), ctx, NUM_SIMD, lane, m, l, acc);

publish_stats<GQA, NUM_SIMD>(m, l, tg_stats, simd, lane);
for (int r = 0; r < GQA; ++r) {
  float row_max;
  float row_sum;
  const float o = merge_row<HEAD_DIM, GQA, NUM_SIMD>(
      r, m, acc, tg_stats, tg_acc, simd, lane, tid, row_max, row_sum);
  if (tid < uint(HEAD_DIM)) {
    const float y = USE_SINKS ? with_sink(o, row_max, row_sum, sinks[kv_head * GQA + r])
                              : o / row_sum;
    out_rows[r * HEAD_DIM + tid] = static_cast<T>(y);
  }
}
