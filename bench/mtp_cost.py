"""What MTP speculation costs and gains on this machine, on random models of a real size.

    PYTHONPATH=. python bench/mtp_cost.py                 # SmolLM2-135M's shape, 128 tokens
    PYTHONPATH=. python bench/mtp_cost.py --layers 12 --max-tokens 64 --k 1,2

No MTP checkpoint small enough for this machine is available offline, so two random mimo
models with SmolLM2-135M's dimensions (hidden 576, 9 heads / 3 KV heads, MLP 1536,
vocabulary 49,152) and an MTP layer are made (kept in the bench cache):

- ``random``: random target, random MTP layer. Drafts are (almost) never accepted: the
  cost of drafting and verifying with nothing gained (the back-off is turned off so that
  every step pays it).
- ``perfect``: the target's layers add nothing (o_proj and down_proj zero, so it predicts
  the next token from the current one) and the MTP layer passes the token after its
  position through to the same head: every greedy draft is accepted. The matmuls are
  those of a real model of this size; the upper bound of what MTP gains at k drafts.

Each model runs plain and with MTP at each k, one greedy stream, alternately
``--repeat`` times (best run kept), with one BLAS thread (OPENBLAS_NUM_THREADS=1 unless
set). Reported: decode tok/s, engine steps, drafted and
accepted tokens, and whether the output equals the plain one (it must).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# One BLAS thread: on a machine shared with other jobs, OpenBLAS's spinning threads made
# identical runs differ by 10x (0.9 to 14 tok/s); single-threaded they agree within ~30%.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxserve.cli.bench.common import cache_dir  # noqa: E402

VOCAB = 49152


def shape(layers: int) -> dict:
    return {
        "model_type": "mimo",
        "hidden_size": 576,
        "num_hidden_layers": layers,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "num_nextn_predict_layers": 1,
    }


def write_tokenizer(path: Path) -> None:
    """A word-level vocabulary ``t0 .. t49151`` (the bench feeds and reads token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))


def make_model(path: Path, layers: int, perfect: bool) -> Path:
    """A random mimo checkpoint with an MTP layer (see the module docstring)."""
    if (path / "config.json").exists():
        return path
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import mimo

    config = shape(layers)
    mx.random.seed(0)
    model = mimo.Model(mimo.ModelArgs.from_dict(config))
    block = mimo.TransformerBlock(model.args)
    weights = dict(tree_flatten(model.parameters()))
    hidden = config["hidden_size"]
    prefix = "model.mtp_layers.0."
    weights |= {prefix + k: v for k, v in tree_flatten(block.parameters())}
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[f"{prefix}{name}.weight"] = mx.ones((hidden,))
    proj = mx.random.normal((hidden, 2 * hidden)) * (2 * hidden) ** -0.5
    if perfect:
        for name, w in weights.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = mx.zeros_like(w)
        eye = mx.eye(hidden)
        proj = mx.concatenate([mx.zeros_like(eye), eye], axis=1)  # passes the token through
    weights[prefix + "input_proj.weight"] = proj
    weights = {k: v.astype(mx.float16) for k, v in weights.items()}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    write_tokenizer(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def run(model: Path, k: int, prompt: list[int], max_tokens: int) -> dict:
    from mlxserve import LLM, SamplingParams

    spec = None
    if k:
        spec = {"method": "mtp", "num_speculative_tokens": k, "min_acceptance_rate": 0.0}
        spec["disable_by_cost"] = False  # every step pays (the cost back-off would stop it)
    llm = LLM(str(model), dtype="float32", num_blocks=128, speculative_config=spec)
    llm.generate([prompt[:8]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    before = llm.engine.get_stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - t0
    stats = llm.engine.get_stats()
    return {
        "tokens": out.token_ids,
        "tok_s": len(out.token_ids) / seconds,
        "drafted": stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        "accepted": stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--k", default="1,3", help="numbers of drafts to try, comma-separated")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    import numpy as np

    prompt = np.random.default_rng(0).integers(2, VOCAB, args.prompt_tokens).tolist()
    ks = [0] + [int(k) for k in args.k.split(",")]
    for variant in ("random", "perfect"):
        path = cache_dir() / f"mtp-{variant}-{args.layers}"
        model = make_model(path, args.layers, variant == "perfect")
        best: dict[int, dict] = {}
        for _ in range(args.repeat):
            for k in ks:
                r = run(model, k, prompt, args.max_tokens)
                if k not in best or r["tok_s"] > best[k]["tok_s"]:
                    best[k] = r
        plain = best[0]
        for k in ks:
            r = best[k]
            print(
                f"{variant:8s} k={k}: {r['tok_s']:6.2f} tok/s ({r['tok_s'] / plain['tok_s']:.2f}x)"
                f"  drafted {r['drafted']:4d}  accepted {r['accepted']:4d}"
                f"  same output: {r['tokens'] == plain['tokens']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
