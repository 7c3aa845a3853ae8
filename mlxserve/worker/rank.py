"""A tensor-parallel rank other than 0: ``python -m mlxserve.worker.rank SPEC READY_FD``.

Started by :class:`mlxserve.worker.launch.LocalRanks` with ``MLX_RANK`` and
``MLX_HOSTFILE`` set. SPEC is the engine's config and planning arguments as JSON.
The rank loads the same model as rank 0, keeps its shard, plans its KV pool with rank 0
(the same probe, then the smallest plan of all ranks) and runs forwards until STOP.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import mlx.core as mx

from mlxserve.config import EngineConfig
from mlxserve.loader import load_model
from mlxserve.worker.launch import serve_rank


def _exit_with_parent() -> None:
    """Leave as soon as rank 0's process is gone (even while not in a collective)."""
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    ready_fd = int(argv[1])
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    group = mx.distributed.init(strict=True, backend="ring")
    config = EngineConfig(**spec["config"])
    loaded = load_model(
        config.model,
        dtype=config.dtype,
        revision=config.revision,
        tokenizer=config.tokenizer,
        skip_tokenizer_init=True,
    )
    return serve_rank(loaded, config, spec["plan"], group)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
