"""``python -m mlxserve.cpu``: build the CPU kernels now (not on first use) and say so.

Exits 0 when they are built and pass their check, 1 (saying why) when they cannot be used
here; mlxserve then runs quantized layers on the previous CPU path.
"""

from __future__ import annotations

import logging
import sys

from mlxserve.cpu import kernels


def main() -> int:
    """Build (or find in the cache) and check the kernels; print the outcome."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    ok = kernels.available()
    print(kernels.status())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
