"""The engines mlxserve is compared with: mlx-lm (same MLX, same weights) and llama.cpp."""
