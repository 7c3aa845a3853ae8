"""The `mlxserve` command: one module per sub-command, the shared engine flags, `main`."""
