"""`mlxserve convert MODEL OUT`: write what mlxserve loads (a .gguf included) as an
mlx-lm / Hugging Face style directory.

    OUT/config.json             HF config (+ mlx-lm's "quantization" for packed weights)
    OUT/model.safetensors       HF-named weights, quantized ones in MLX's packed format
    OUT/tokenizer.json          the tokenizer (BOS added by a post-processor if the model wants it)
    OUT/tokenizer_config.json   special tokens and the chat template

A GGUF's Q4_0 / Q4_1 / Q8_0 blocks are MLX's affine format bit for bit, so mlx-lm
(`mlx_lm.load(OUT)`, `mlx_lm.server --model OUT`) runs exactly the same weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from mlxserve.loader import resolve_model
from mlxserve.loader.gguf import load_gguf
from mlxserve.loader.local import read_model_dir
from mlxserve.tokenizer import Tokenizer


def convert(model: str | None, out_dir: str | Path, revision: str | None = None) -> Path:
    """Export ``model`` (hub id, directory, .gguf, None = the embedded one) into ``out_dir``."""
    source = resolve_model(model, revision)
    if source.kind == "gguf":
        config, weights, meta = load_gguf(source.path)
        tokenizer = Tokenizer.from_gguf_metadata(meta, source=str(source.path))
    else:
        config, weights = read_model_dir(source.path)
        tokenizer = Tokenizer.from_dir(source.path)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: the output directory exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)

    config = dict(config)
    embed = weights.get("model.embed_tokens.weight")
    if "vocab_size" not in config and embed is not None:
        config["vocab_size"] = int(embed.shape[0])
    eos = sorted(tokenizer.eos_token_ids)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_tokenizer(tokenizer, out, config.get("max_position_embeddings"))
    return out


def _write_tokenizer(tokenizer: Tokenizer, out: Path, max_len: int | None) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    backend = Backend.from_str(tokenizer.backend.to_str())
    if tokenizer._manual_bos_eos:
        # mlxserve adds BOS/EOS itself for these; transformers needs a post-processor.
        bos, eos = tokenizer.bos_token, tokenizer.eos_token
        single = " ".join(
            ([f"{bos}:0"] if tokenizer.add_bos_token else [])
            + ["$A:0"]
            + ([f"{eos}:0"] if tokenizer.add_eos_token else [])
        )
        if single != "$A:0":
            specials = []
            if tokenizer.add_bos_token:
                specials.append((bos, tokenizer.bos_token_id))
            if tokenizer.add_eos_token:
                specials.append((eos, tokenizer.eos_token_id))
            backend.post_processor = TemplateProcessing(single=single, special_tokens=specials)
        else:
            backend.post_processor = None
    backend.save(str(out / "tokenizer.json"))
    tok_config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": tokenizer.add_eos_token,
    }
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if tokenizer.special_tokens.get(key):
            tok_config[key] = tokenizer.special_tokens[key]
    if max_len:
        tok_config["model_max_length"] = int(max_len)
    templates = tokenizer.chat_templates
    if isinstance(templates, dict):
        templates = [{"name": k, "template": v} for k, v in templates.items()]
    if templates:
        tok_config["chat_template"] = templates
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def add_convert_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `convert` on the mlxserve command line."""
    p = subparsers.add_parser(
        "convert",
        help="export a model (a .gguf included) as an mlx-lm / Hugging Face directory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="hub repo id, model directory or .gguf file")
    p.add_argument("out", metavar="OUT", help="output directory (created; must be empty)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.set_defaults(handler=_convert_command)


def _convert_command(args: argparse.Namespace) -> int:
    out = convert(args.model, args.out, revision=args.revision)
    print(f"wrote {out}")
    return 0
