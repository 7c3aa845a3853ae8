// quantize_kv.metal -- this step's new K and V rows as 8-bit pool rows (--kv-cache-dtype
// int8), into fresh outputs; MLX's scatter then writes them into the pools (ops.write_kv).
//
// Row format (mlxserve/ops/kv_quant.py): HEAD_DIM int8 values, then their float32 scale,
// scale = max|x| / 127 and q = round-to-nearest-even(x / scale) clamped to [-127, 127];
// an all-zero row stores zeros and scale 0.
//
// Template: T (dtype of the new rows), HEAD_DIM (a multiple of 4: the scale stays aligned).
// Inputs: keys, values (num_tokens, num_kv_heads, HEAD_DIM) T.
// Outputs: k_rows, v_rows (num_tokens, num_kv_heads, HEAD_DIM + 4) int8.
// Grid: (32 * num_kv_heads, num_tokens, 1), threadgroup (32, 1, 1): one simdgroup per row
//   of K and V (lanes take dims lane, lane + 32, ...; the row's max is a simd_max).
static_assert(HEAD_DIM % 4 == 0, "the float32 scale after the values stays aligned");
const uint lane = thread_index_in_simdgroup;
const int head = int(threadgroup_position_in_grid.x);
const int t = int(threadgroup_position_in_grid.y);
const int num_kv_heads = keys_shape[1];
const int64_t row = int64_t(t) * num_kv_heads + head;
quantize_row<HEAD_DIM>(keys + row * HEAD_DIM, k_rows + row * MLXS_KV_ROW(HEAD_DIM, true), lane);
quantize_row<HEAD_DIM>(values + row * HEAD_DIM, v_rows + row * MLXS_KV_ROW(HEAD_DIM, true), lane);
