"""llama-server's speculative modes on the prompt bench/spec_decode.py measures (--llama-cpp)."""

from __future__ import annotations

import json
import time


def llama_cpp_rows(prompt: str, max_tokens: int, k: int, drafts: str) -> dict[str, dict]:
    """llama-server on the embedded GGUF, greedy, one stream: plain, ngram-simple, and a
    draft model (the same GGUF, as ``--draft self``). Skipped (with the reason) when the
    bench's llama.cpp build is missing: building it takes ~10 minutes."""
    import os
    import subprocess
    import tempfile

    from bench.peers.llamacpp import TARGETS, bin_dir
    from mlxserve.loader import default_model_path

    if not all((bin_dir() / t).exists() for t in TARGETS):
        print("  llama.cpp: skipped (not built: python -m bench.peers.llamacpp builds it)")
        return {}
    gguf = str(default_model_path())
    modes = {"llama.cpp": [], "llama.cpp ngram-simple": ["--spec-type", "ngram-simple"]}
    if "self" in drafts.split(","):
        modes["llama.cpp draft:self"] = ["-md", gguf, "--spec-type", "draft-simple"]
    rows = {}
    threads = str(os.cpu_count() or 2)
    for name, extra in modes.items():
        port = 18700 + len(rows)
        cmd = [str(bin_dir() / "llama-server"), "-m", gguf, "-t", threads, "-c", "4096"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-webui", "-np", "1"]
        if extra:
            cmd += extra + ["--spec-draft-n-max", str(k)]
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                rows[name] = _llama_cpp_run(port, prompt, max_tokens, proc)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    return rows


def _llama_cpp_run(port: int, prompt: str, max_tokens: int, proc) -> dict:
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
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
        "prompt": prompt,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
    }
    req = urllib.request.Request(
        url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
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
    }
