// attention_common.metal -- helpers shared by mlxserve's paged attention kernels.
// Passed as the `header` of mx.fast.metal_kernel, so it sits before each generated kernel.
//
// Work split used by every attention kernel: a threadgroup owns one KV head and ROWS query
// rows (the GQA group of that head, times the query tokens of a tile). Its simdgroups stride
// over the context tokens through the block table; the 32 lanes of a simdgroup split
// head_dim (lane owns dims lane, lane + 32, ...), so a K or V row is read once, coalesced,
// for all ROWS rows. Each simdgroup keeps an online softmax per row; at the end the
// simdgroups' partial results are merged through threadgroup memory.

#define MLXS_DIMS_PER_LANE(HEAD_DIM) (((HEAD_DIM) + 31) / 32)
#define MLXS_NEG_BIG (-1.0e30f)

// Online-softmax attention of ROWS query rows over tokens t_begin, t_begin + t_step, ...
// below t_end of one request. Row r sees tokens [start[r], limit[r]) (start > 0 only under a
// sliding window); a row with limit 0 is unused.
// q holds this lane's dims of each row, already multiplied by the softmax scale.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int ROWS, typename KV, typename Table>
inline void paged_attend(
    thread const float (&q)[ROWS][MLXS_DIMS_PER_LANE(HEAD_DIM)],
    thread const int (&start)[ROWS],
    thread const int (&limit)[ROWS],
    KV k_cache,
    KV v_cache,
    Table table,
    int kv_head,
    int num_kv_heads,
    int t_begin,
    int t_end,
    int t_step,
    uint lane,
    thread float (&m)[ROWS],
    thread float (&l)[ROWS],
    thread float (&acc)[ROWS][MLXS_DIMS_PER_LANE(HEAD_DIM)]) {
  constexpr int DPL = MLXS_DIMS_PER_LANE(HEAD_DIM);
  for (int r = 0; r < ROWS; ++r) {
    m[r] = MLXS_NEG_BIG;
    l[r] = 0.0f;
    for (int i = 0; i < DPL; ++i) {
      acc[r][i] = 0.0f;
    }
  }
  for (int t = t_begin; t < t_end; t += t_step) {
    const int block = table[t / BLOCK_SIZE];
    const int64_t row = (int64_t(block) * BLOCK_SIZE + t % BLOCK_SIZE) * num_kv_heads + kv_head;
    KV k_row = k_cache + row * HEAD_DIM;
    KV v_row = v_cache + row * HEAD_DIM;
    float k[DPL];
    float v[DPL];
    for (int i = 0; i < DPL; ++i) {
      const int d = int(lane) + 32 * i;
      k[i] = d < HEAD_DIM ? static_cast<float>(k_row[d]) : 0.0f;
      v[i] = d < HEAD_DIM ? static_cast<float>(v_row[d]) : 0.0f;
    }
    for (int r = 0; r < ROWS; ++r) {
      if (t >= limit[r] || t < start[r]) {  // same t, r on every lane: uniform in the simdgroup
        continue;
      }
      float partial = 0.0f;
      for (int i = 0; i < DPL; ++i) {
        partial += q[r][i] * k[i];
      }
      const float score = metal::simd_sum(partial);
      const float m_new = metal::max(m[r], score);
      const float correction = metal::exp(m[r] - m_new);
      const float p = metal::exp(score - m_new);
      l[r] = l[r] * correction + p;
      for (int i = 0; i < DPL; ++i) {
        acc[r][i] = acc[r][i] * correction + p * v[i];
      }
      m[r] = m_new;
    }
  }
}

// Each simdgroup publishes its running max and sum of every row; ends with a barrier.
// tg_stats holds 2 * NUM_SIMD * ROWS floats. Every thread of the threadgroup must call it.
template <int ROWS, int NUM_SIMD>
inline void publish_stats(
    thread const float (&m)[ROWS],
    thread const float (&l)[ROWS],
    threadgroup float* tg_stats,
    uint simd,
    uint lane) {
  if (lane == 0) {
    for (int r = 0; r < ROWS; ++r) {
      tg_stats[simd * ROWS + r] = m[r];
      tg_stats[(NUM_SIMD + simd) * ROWS + r] = l[r];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Merges row r across simdgroups (after publish_stats). Returns to thread tid < HEAD_DIM
// the row's unnormalized output at dim tid, and the row's softmax max and denominator.
// tg_acc holds NUM_SIMD * HEAD_DIM floats. Every thread of the threadgroup must call it.
template <int HEAD_DIM, int ROWS, int NUM_SIMD>
inline float merge_row(
    int r,
    thread const float (&m)[ROWS],
    thread const float (&acc)[ROWS][MLXS_DIMS_PER_LANE(HEAD_DIM)],
    threadgroup const float* tg_stats,
    threadgroup float* tg_acc,
    uint simd,
    uint lane,
    uint tid,
    thread float& row_max,
    thread float& row_sum) {
  constexpr int DPL = MLXS_DIMS_PER_LANE(HEAD_DIM);
  float mx = MLXS_NEG_BIG;
  for (int s = 0; s < NUM_SIMD; ++s) {
    mx = metal::max(mx, tg_stats[s * ROWS + r]);
  }
  float sum = 0.0f;
  for (int s = 0; s < NUM_SIMD; ++s) {
    sum += tg_stats[(NUM_SIMD + s) * ROWS + r] * metal::exp(tg_stats[s * ROWS + r] - mx);
  }
  const float factor = metal::exp(m[r] - mx);
  for (int i = 0; i < DPL; ++i) {
    const int d = int(lane) + 32 * i;
    if (d < HEAD_DIM) {
      tg_acc[simd * HEAD_DIM + d] = acc[r][i] * factor;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float out = 0.0f;
  if (tid < uint(HEAD_DIM)) {
    for (int s = 0; s < NUM_SIMD; ++s) {
      out += tg_acc[s * HEAD_DIM + tid];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // tg_acc is reused by the next row
  row_max = mx;
  row_sum = sum;
  return out;
}

// The first context token a query at position `pos` sees: 0, or under a sliding window of
// WINDOW tokens (WINDOW > 0) the oldest of the last WINDOW positions.
template <int WINDOW>
inline int window_first(int pos) {
  return WINDOW > 0 ? metal::max(pos + 1 - WINDOW, 0) : 0;
}

// Final output of one row from its unnormalized output o, softmax max and denominator,
// with an attention sink: a logit that joins the denominator only (gpt-oss).
inline float with_sink(float o, float row_max, float row_sum, float sink) {
  const float m = metal::max(row_max, sink);
  const float f = metal::exp(row_max - m);
  return o * f / (row_sum * f + metal::exp(sink - m));
}
