"""llama-server's speculative modes on the prompt bench/spec_decode.py measures (--llama-cpp).

The same GGUF and the same prompt token ids as mlxserve's engines (the /completion endpoint
takes token ids, so both tokenize nothing), greedy, one slot, one stream:

- ``llama.cpp``: plain decoding;
- ``llama.cpp ngram-simple``: llama.cpp's prompt lookup, set like mlxserve's n-gram engine
  (``--spec-ngram-simple-size-n`` = ``prompt_lookup_min``, drafts of up to k tokens: it
  looks up one n-gram size only, the most recent match);
- ``llama.cpp draft:NAME``: ``--spec-type draft-simple -md DRAFT`` for each --draft entry
  that is a GGUF (``self``: the target's own file).

Its output tokens come back too (``return_tokens``), so the report says whether llama.cpp's
greedy output is mlxserve's, token for token (two implementations of the same weights may
part ways where two logits nearly tie).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence


def llama_cpp_modes(gguf: str, k: int, lookup_min: int, drafts: str) -> dict[str, list[str]]:
    """Name -> llama-server's extra arguments, for each mode the bench runs."""
    spec = ["--spec-draft-n-max", str(k)]
    modes = {
        "llama.cpp": [],
        "llama.cpp ngram-simple": [
            "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(lookup_min),
            "--spec-ngram-simple-size-m", str(k), *spec,
        ],
    }  # fmt: skip
    for name in filter(None, drafts.split(",")):
        path = gguf if name == "self" else name
        if path.endswith(".gguf"):
            modes[f"llama.cpp draft:{name}"] = ["-md", path, "--spec-type", "draft-simple", *spec]
    return modes


def llama_cpp_rows(
    prompt_ids: Sequence[int],
    max_tokens: int,
    k: int,
    drafts: str,
    gguf: str | None = None,
    lookup_min: int = 2,
    threads: int | None = None,
) -> dict[str, dict]:
    """llama-server on ``gguf`` (default: the embedded model) in each llama_cpp_modes mode.
    Skipped (with the reason) when the bench's llama.cpp build is missing: building it
    takes ~10 minutes (``python -m mlxserve.cli.bench.llamacpp``)."""
    import subprocess
    import tempfile

    from mlxserve.cli.bench.llamacpp import TARGETS, bin_dir
    from mlxserve.loader import default_model_path

    if not all((bin_dir() / t).exists() for t in TARGETS):
        print("  llama.cpp: skipped (not built: python -m mlxserve.cli.bench.llamacpp builds it)")
        return {}
    gguf = gguf or str(default_model_path())
    if not gguf.endswith(".gguf"):
        print(f"  llama.cpp: skipped ({gguf} is not a .gguf file)")
        return {}
    rows = {}
    threads = str(threads or os.cpu_count() or 2)
    context = str(max(4096, len(prompt_ids) + max_tokens + 64))
    for name, extra in llama_cpp_modes(gguf, k, lookup_min, drafts).items():
        port = 18700 + len(rows)
        cmd = [str(bin_dir() / "llama-server"), "-m", gguf, "-t", threads, "-c", context]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-webui", "-np", "1", *extra]
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                rows[name] = _llama_cpp_run(port, prompt_ids, max_tokens, proc)
            except RuntimeError as e:
                log.seek(0)
                tail = log.read().decode(errors="replace").splitlines()[-5:]
                raise RuntimeError(f"{name}: {e}: {' | '.join(tail)}") from None
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    return rows


def _llama_cpp_run(port: int, prompt_ids: Sequence[int], max_tokens: int, proc) -> dict:
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{port}"
    for _ in range(1500):
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    body = {
        "prompt": list(prompt_ids),
        "n_predict": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "return_tokens": True,
    }
    req = urllib.request.Request(
        url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        out = json.loads(r.read())
    wall = time.perf_counter() - t0
    t = out.get("timings", {})
    drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
    return {
        "output_tokens": t.get("predicted_n", 0),
        "decode_tok_s": t.get("predicted_per_second", 0.0),
        "seconds": wall,
        "steps": 0,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "text": out.get("content", ""),
        "llama_tokens": out.get("tokens", []),
    }
