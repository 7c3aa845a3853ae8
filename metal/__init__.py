"""Metal kernel sources, shipped in the wheel as ``mlxserve._metal`` (see pyproject.toml).

The ``checker`` subpackage (shim, static checks, CPU emulator) is for development and CI
only and is not shipped.
"""
