"""The Linux checker for mlxserve's Metal kernels: shim, static compile checks, emulator."""
