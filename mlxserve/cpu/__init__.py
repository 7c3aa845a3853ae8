"""mlxserve's backend for MLX's CPU (Linux, CI): its kernels and what runs a model on them.

    build.py    compile the kernels' MLX extension (csrc/) on first use, cache it, load it
    kernels.py  the loaded extension, its status, the quantized layers that run in it
    blas.py     an optimized BLAS bound under MLX's float32 matmuls
    ops.py      the attention ops on the extension's primitives; registers itself with
                mlxserve.ops (the dispatch point), which then also hands the primitives
                to models/layers.py's RMSNorm and RoPE
    layer.py    a llama-family decoder layer in one op (or its halves in one op each)
    stack.py    all of a model's decoder layers in one op
    install.py  install(model): at load time, the quantized layers onto the kernels and
                the fused forwards onto the llama-family decoder (and pipeline stages)

A file in models/ never imports this package: the loader installs it on a loaded model.
This file imports nothing, so that importing ``mlxserve.cpu.blas`` (the settings do) loads
nothing else.
"""
