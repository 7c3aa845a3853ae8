// attention_common.metal -- helpers shared by mlxserve's paged attention kernels.
// Passed as the `header` of mx.fast.metal_kernel, so it sits before each generated kernel.
//
// Work split used by every attention kernel: a threadgroup owns one KV head and at most
// MLXS_MAX_ROWS query rows (some heads of that KV head's GQA group, times the query tokens
// of a tile). A GQA group wider than MLXS_MAX_ROWS is split into head groups of equal size,
// each its own threadgroup, so the per-thread row registers never grow with the GQA ratio.
// Simdgroups take whole blocks of the context in turn (one block-table read per block);
// the 32 lanes of a simdgroup split head_dim (lane owns dims lane, lane + 32, ...), so a K
// or V row is read once, coalesced, for all rows. Each simdgroup keeps an online softmax
// per row; at the end the simdgroups' partial results are merged through threadgroup memory.
// Exponentials are metal::fast::exp, as MLX's own attention kernels use.

#define MLXS_DIMS_PER_LANE(HEAD_DIM) (((HEAD_DIM) + 31) / 32)
#define MLXS_NEG_BIG (-1.0e30f)
// Rows (query head x query token) per threadgroup; mlxserve/ops/metal.py's MAX_ROWS.
#define MLXS_MAX_ROWS 8
// Threadgroups per KV head for a GQA group of GQA heads, and heads in each of them.
#define MLXS_HEAD_GROUPS(GQA) (((GQA) + MLXS_MAX_ROWS - 1) / MLXS_MAX_ROWS)
#define MLXS_GROUP_HEADS(GQA) (((GQA) + MLXS_HEAD_GROUPS(GQA) - 1) / MLXS_HEAD_GROUPS(GQA))

// K/V pool rows (mlxserve/ops/kv_quant.py): with KV_QUANT, HEAD_DIM int8 values followed by
// their float32 scale (4 bytes; value = q * scale); otherwise HEAD_DIM elements of the
// pool's float type. A row's scale multiplies its whole dot product (K) or its softmax
// weight (V), so dequantizing costs one multiply per key, not per element.
#define MLXS_KV_ROW(HEAD_DIM, KV_QUANT) ((KV_QUANT) ? (HEAD_DIM) + 4 : (HEAD_DIM))

// The scale of the pool row starting at `row`: its stored float32 (KV_QUANT), else 1.
template <bool KV_QUANT, int HEAD_DIM, typename KV>
inline float kv_row_scale(KV row) {
  static_assert(!KV_QUANT || HEAD_DIM % 4 == 0, "the scale after the values stays aligned");
  return KV_QUANT ? *reinterpret_cast<const device float*>(row + HEAD_DIM) : 1.0f;
}

// Quantizes one row of HEAD_DIM values x into the 8-bit row `row` (values, then the
// float32 scale max|x| / 127); called by the 32 lanes of one simdgroup (quantize_kv.metal).
template <int HEAD_DIM, typename X>
inline void quantize_row(X x, device int8_t* row, uint lane) {
  float amax = 0.0f;
  for (int d = int(lane); d < HEAD_DIM; d += 32) {
    amax = metal::max(amax, metal::abs(static_cast<float>(x[d])));
  }
  amax = metal::simd_max(amax);
  const float scale = amax / 127.0f;
  const float safe = scale > 0.0f ? scale : 1.0f;  // an all-zero row: zeros, scale 0
  for (int d = int(lane); d < HEAD_DIM; d += 32) {
    const float q = metal::rint(static_cast<float>(x[d]) / safe);
    row[d] = static_cast<int8_t>(metal::clamp(q, -127.0f, 127.0f));
  }
  if (lane == 0) {
    *reinterpret_cast<device float*>(row + HEAD_DIM) = scale;
  }
}

// Online-softmax attention of ROWS query rows over tokens [t_begin, t_end) of one request.
// Simdgroup `simd` of NUM_SIMD takes the blocks holding those tokens in turn (the first,
// the NUM_SIMD + 1st, ...), reading each block's table entry once. Row r sees tokens
// [start[r], limit[r]) (start > 0 only under a sliding window); a row with limit 0 is unused.
// q holds this lane's dims of each row, already multiplied by the softmax scale.
// KV_QUANT: the pools hold 8-bit rows with scales (MLXS_KV_ROW).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int ROWS, int NUM_SIMD, bool KV_QUANT,
          typename KV, typename Table>
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
    uint simd,
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
  for (int b = t_begin / BLOCK_SIZE + int(simd); b * BLOCK_SIZE < t_end; b += NUM_SIMD) {
    const int64_t block = table[b];
    const int b_first = b * BLOCK_SIZE;
    const int lo = metal::max(b_first, t_begin);
    const int hi = metal::min(b_first + BLOCK_SIZE, t_end);
    for (int t = lo; t < hi; ++t) {
      const int64_t row = (block * BLOCK_SIZE + (t - b_first)) * num_kv_heads + kv_head;
      KV k_row = k_cache + row * MLXS_KV_ROW(HEAD_DIM, KV_QUANT);
      KV v_row = v_cache + row * MLXS_KV_ROW(HEAD_DIM, KV_QUANT);
      const float k_scale = kv_row_scale<KV_QUANT, HEAD_DIM>(k_row);
      const float v_scale = kv_row_scale<KV_QUANT, HEAD_DIM>(v_row);
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
        const float score = metal::simd_sum(partial) * k_scale;
        const float m_new = metal::max(m[r], score);
        const float correction = metal::fast::exp(m[r] - m_new);
        const float p = metal::fast::exp(score - m_new);
        l[r] = l[r] * correction + p;
        const float pv = p * v_scale;
        for (int i = 0; i < DPL; ++i) {
          acc[r][i] = acc[r][i] * correction + pv * v[i];
        }
        m[r] = m_new;
      }
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
    sum += tg_stats[(NUM_SIMD + s) * ROWS + r] * metal::fast::exp(tg_stats[s * ROWS + r] - mx);
  }
  const float factor = metal::fast::exp(m[r] - mx);
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
  const float f = metal::fast::exp(row_max - m);
  return o * f / (row_sum * f + metal::fast::exp(sink - m));
}
