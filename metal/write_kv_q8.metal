// write_kv_q8.metal -- write_kv.metal for 8-bit pools (--kv-cache-dtype int8): quantize each
// new (token, KV head) row of K and V and scatter it into its pool slot, IN PLACE (why in
// place, and the ordering token: write_kv.metal).
//
// Row format (mlxserve/ops/kv_quant.py): HEAD_DIM int8 values, then their float32 scale,
// scale = max|x| / 127 and q = round-to-nearest-even(x / scale) clamped to [-127, 127];
// an all-zero row stores zeros and scale 0.
//
// Template: HEAD_DIM (a multiple of 4: the scale stays aligned).
// Inputs: keys, values (num_tokens, num_kv_heads, HEAD_DIM) float; slot_mapping
//   (>= num_tokens,) int32; k_cache, v_cache (num_blocks, block_size, num_kv_heads,
//   HEAD_DIM + 4) int8.
// Output: written (1,) int32, the ordering token.
// Grid: (32 * num_kv_heads, num_tokens, 1), threadgroup (32, 1, 1): one simdgroup per row
//   of K and V (lanes take dims lane, lane + 32, ...; the row's max is a simd_max).
static_assert(HEAD_DIM % 4 == 0, "the float32 scale after the values stays aligned");
const uint lane = thread_index_in_simdgroup;
const int head = int(threadgroup_position_in_grid.x);
const int t = int(threadgroup_position_in_grid.y);
const int num_kv_heads = keys_shape[1];
if (head == 0 && t == 0 && lane == 0) {
  written[0] = 1;
}
const int64_t src = (int64_t(t) * num_kv_heads + head) * HEAD_DIM;
const int64_t dst = (int64_t(slot_mapping[t]) * num_kv_heads + head) * MLXS_KV_ROW(HEAD_DIM, true);
quantize_row<HEAD_DIM>(keys + src, const_cast<device int8_t*>(k_cache) + dst, lane);
quantize_row<HEAD_DIM>(values + src, const_cast<device int8_t*>(v_cache) + dst, lane);
