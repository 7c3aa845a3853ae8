// paged_decode_reduce.metal -- second pass of split-K decode attention: combines the
// partitions written by paged_decode_split.metal into the final output.
//
// Template: T (out dtype), HEAD_DIM, PARTITION_SIZE, WINDOW and USE_SINKS (as
//   paged_decode.metal).
// Inputs: partial_out (num_tokens, num_heads, num_partitions, HEAD_DIM), partial_max and
//   partial_sum (num_tokens, num_heads, num_partitions) float32; context_lens (>= num_reqs,),
//   zero past the requests;
//   sinks (num_heads,) float32, read only with USE_SINKS.
// Output: out (num_tokens, num_heads, HEAD_DIM); padding rows (no request) are zeros.
// Grid: (threads >= HEAD_DIM, num_heads, num_tokens); one thread per output element.
const int d = int(thread_position_in_grid.x);
const int head = int(thread_position_in_grid.y);
const int row = int(thread_position_in_grid.z);
const int num_heads = partial_max_shape[1];
const int num_parts = partial_max_shape[2];
if (d >= HEAD_DIM) {
  return;
}
const int64_t out_off = (int64_t(row) * num_heads + head) * HEAD_DIM + d;
// context_lens is padded with zeros to >= 8 entries (device binding); a real request has
// at least one token.
if (row >= context_lens_shape[0] || context_lens[row] == 0) {
  out[out_off] = T(0.0f);
  return;
}
const int used = metal::min(num_parts, (context_lens[row] + PARTITION_SIZE - 1) / PARTITION_SIZE);
// Partitions before the window's first token were skipped by the split pass.
const int p_first = window_first<WINDOW>(context_lens[row] - 1) / PARTITION_SIZE;
const int64_t base = (int64_t(row) * num_heads + head) * num_parts;
float mx = MLXS_NEG_BIG;
for (int p = p_first; p < used; ++p) {
  mx = metal::max(mx, partial_max[base + p]);
}
float sum = 0.0f;
float o = 0.0f;
for (int p = p_first; p < used; ++p) {
  const float w = metal::fast::exp(partial_max[base + p] - mx);
  sum += partial_sum[base + p] * w;
  o += partial_out[(base + p) * HEAD_DIM + d] * w;
}
out[out_off] = static_cast<T>(USE_SINKS ? with_sink(o, mx, sum, sinks[head]) : o / sum);
