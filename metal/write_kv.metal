// write_kv.metal -- scatter this step's new K/V rows into their pool slots, IN PLACE.
//
// mx.fast.metal_kernel gives a kernel fresh output buffers only (MLX 0.32 allocates every
// output; there is no donation or input/output aliasing for custom kernels), so a kernel
// whose output is the pool would copy the whole pool for every layer and step. Instead the
// pools are bound as inputs and written through their own buffers; the only output is a
// one-element token. mlxserve.ops.metal returns the pools as mx.depends(pools, [token]) and
// binds the token to the attention kernel that reads them, which makes MLX order the two
// dispatches (see mlxserve/ops/metal.py). Pools must be row-contiguous and hold >= 8
// elements (smaller inputs are bound as `constant`, which cannot be written).
//
// Template: T (pool dtype).
// Inputs: keys, values (num_tokens, num_kv_heads, head_dim); slot_mapping (>= num_tokens,)
//   int32, slot = block * block_size + offset; k_cache, v_cache (num_blocks, block_size,
//   num_kv_heads, head_dim).
// Output: written (1,) int32, the ordering token.
// Grid: (num_kv_heads * head_dim, num_tokens, 1), one thread per element.
const uint e = thread_position_in_grid.x;
const uint t = thread_position_in_grid.y;
const int64_t row = int64_t(keys_shape[1]) * keys_shape[2];
if (e == 0 && t == 0) {
  written[0] = 1;
}
if (int64_t(e) >= row) {
  return;
}
const int64_t slot = slot_mapping[t];
device T* k_pool = const_cast<device T*>(k_cache);
device T* v_pool = const_cast<device T*>(v_cache);
k_pool[slot * row + e] = static_cast<T>(static_cast<float>(keys[int64_t(t) * row + e]));
v_pool[slot * row + e] = static_cast<T>(static_cast<float>(values[int64_t(t) * row + e]));
