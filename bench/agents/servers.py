"""The servers the agents talk to: `mlxserve serve` and llama-server, on 127.0.0.1.

Both serve the same GGUF with the same context length. Claude Code's first request is
~18k tokens, so the bench wants 32k of context; mlxserve refuses a ``--max-model-len``
above the GGUF's ``<arch>.context_length`` (the embedded SmolLM2 says 8192), and has no
flag to override that. When the model is shorter than asked, the bench serves a copy of
the GGUF whose context_length says the length asked (one metadata field changed; RoPE
past the trained length is not the point here: the protocol is), to both servers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from mlxserve.cli.bench.common import cache_dir
from mlxserve.cli.bench.serving import ServerSpec

SERVED_NAME = "mlxserve-bench"  # the model name every client is told to use


def context_length(gguf: Path) -> tuple[str, int]:
    """The GGUF's context-length key and its value."""
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(str(gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    key = f"{arch}.context_length"
    return key, int(reader.fields[key].parts[-1][0])


def with_context(gguf: Path, length: int, log=print) -> tuple[Path, dict]:
    """``gguf`` itself if it allows ``length`` tokens, else a cached copy whose
    context_length is ``length``; and a note of what was done."""
    key, trained = context_length(gguf)
    note = {"gguf": str(gguf), "trained_context": trained, "served_context": length}
    if trained >= length:
        return gguf, note
    import gguf as gguf_py

    out = cache_dir() / "agents" / "models" / f"{gguf.stem}-ctx{length}.gguf"
    if not out.exists():
        log(f"[agents] {gguf.name}: {key} {trained} < {length}; writing {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.copyfile(gguf, tmp)
        reader = gguf_py.GGUFReader(str(tmp), "r+")
        field = reader.fields[key]
        field.parts[field.data[0]][0] = length  # same type and size: edited in place
        del reader
        os.replace(tmp, out)
    note.update(copy=str(out), changed=f"{key}: {trained} -> {length}")
    return out, note


def mlxserve_spec(
    model: Path, max_model_len: int, max_output_tokens: int, work: Path, extra: list[str]
) -> ServerSpec:
    """`mlxserve serve` as a user would start it for an agent, plus the bench's settings:
    a 2048-token step (serve's CPU default of 32 is for many users; here one agent waits
    on a long prompt), and a default max_tokens given as a generation config (read as
    vLLM reads one: max_new_tokens is the default of a request's max_tokens)."""
    config_dir = work / "mlxserve-generation-config"
    config_dir.mkdir(parents=True, exist_ok=True)
    config = {"max_new_tokens": max_output_tokens}
    (config_dir / "generation_config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "mlxserve", "serve", str(model), "--host", "127.0.0.1"]
    cmd += ["--max-model-len", str(max_model_len), "--served-model-name", SERVED_NAME]
    cmd += ["--max-num-batched-tokens", "2048", "--max-num-seqs", "4"]
    cmd += ["--generation-config", str(config_dir), *extra]
    cmd += ["--kv-cache-disk-dir", str(work / "kv-cache")]  # this run's own disk tier
    return ServerSpec("mlxserve", cmd)


def llama_server_spec(
    bin_dir: Path, model: Path, ctx: int, max_output_tokens: int, threads: int
) -> ServerSpec:
    """llama-server with one slot holding the whole context, its Jinja chat template on,
    and ``-n`` as the default max_tokens."""
    cmd = [str(bin_dir / "llama-server"), "-m", str(model), "-c", str(ctx), "-np", "1"]
    cmd += ["-n", str(max_output_tokens), "--jinja", "-t", str(threads)]
    cmd += ["--host", "127.0.0.1", "--no-webui", "--alias", SERVED_NAME]
    return ServerSpec("llama-server", cmd)


def llama_server_routes(src_root: Path) -> dict[str, bool]:
    """Which agent APIs a llama.cpp source tree's server registers (grep of server.cpp)."""
    found = sorted(src_root.glob("**/tools/server/server.cpp"))
    text = found[0].read_text() if found else ""
    return {r: f'"{r}"' in text for r in ("/v1/messages", "/v1/responses", "/v1/chat/completions")}
