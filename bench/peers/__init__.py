"""mlx-lm as a peer of bench/zoo_vs_mlx_lm.py (the suite's peers are in mlxserve/cli/bench)."""
