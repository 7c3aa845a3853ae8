"""`mlxserve pull | list (ls) | show | rm`: the models on this machine, as Ollama manages its own.

    mlxserve pull owner/name                 a repo's model files (config, safetensors, tokenizer)
    mlxserve pull owner/name:FILE.gguf       one GGUF file of a repo
    mlxserve pull owner/name --quant Q4_K_M  the GGUF file of a repo with that quantization
    mlxserve pull hf.co/owner/name:Q4_K_M    the same, in Ollama's words
    mlxserve list [--models-dir DIR]         every model in the Hugging Face cache (and DIR)
    mlxserve show MODEL                      architecture, parameters, tensor types, template
    mlxserve rm MODEL ...                    delete from the cache

Downloads go into the Hugging Face cache (HF_HOME / HF_HUB_CACHE; HF_ENDPOINT picks the hub)
with a progress bar per file; a pull that stops keeps what it got and the next one resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlxserve.loader import catalog, hub

COLUMNS = ("NAME", "FORMAT", "QUANT", "SIZE", "ARCH", "CONTEXT")


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as Ollama and the progress bars show sizes)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    """1234567 -> '1.23M' (parameter counts)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _pull_command(args: argparse.Namespace) -> int:
    repo_id, filename, quant = hub.parse_pull_name(args.model, args.quant)
    try:
        path = hub.pull(repo_id, filename, quant, args.revision)
    except KeyboardInterrupt:
        print(
            f"error: the pull of {args.model} was interrupted; run the same command again "
            f"to resume",
            file=sys.stderr,
        )
        return 130
    name = hub.cache_name(repo_id, path)
    model = catalog.describe(path, name)
    print(f"pulled {name}: {_summary(model)}")
    return 0


def _summary(model: catalog.LocalModel) -> str:
    context = f", context {model.context_length}" if model.context_length else ""
    return (
        f"{model.format}, {model.quantization}, {human_bytes(model.size)}, "
        f"{model.architecture}{context}"
    )


def _list_command(args: argparse.Namespace) -> int:
    rows = [
        (
            m.name,
            m.format,
            m.quantization,
            human_bytes(m.size),
            m.architecture,
            str(m.context_length or "-"),
        )
        for m in catalog.list_models(args.models_dir)
    ]
    widths = [max(len(row[i]) for row in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    for row in [COLUMNS, *rows]:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())
    return 0


def _show_command(args: argparse.Namespace) -> int:
    info = catalog.details(catalog.find_model(args.model, args.models_dir))
    model = info.model
    if args.template:
        print(_template_text(info.chat_template) or "(no chat template)")
        return 0
    facts = [
        ("name", model.name),
        ("path", str(model.path)),
        ("format", model.format),
        ("architecture", model.architecture),
        ("parameters", human_count(info.parameters)),
        ("context length", str(model.context_length or "-")),
        ("quantization", model.quantization),
        ("size on disk", human_bytes(model.size)),
        ("license", info.license or "-"),
    ]
    _print_section("Model", facts)
    _print_section(
        "Tensor types",
        [
            (label, f"{count} tensor{'' if count == 1 else 's'}, {human_count(params)} parameters")
            for label, (count, params) in info.tensor_types.items()
        ],
    )
    defaults = [(k, str(v)) for k, v in info.generation_defaults.items()]
    _print_section("Generation defaults", defaults or [("(none)", "")])
    print("Chat template")
    template = _template_text(info.chat_template)
    print("\n".join(f"  {line}" for line in template.splitlines()) if template else "  (none)")
    return 0


def _template_text(template: str | dict[str, str] | None) -> str:
    if isinstance(template, dict):
        return "\n".join(f"# template {name!r}\n{text}" for name, text in template.items())
    return template or ""


def _print_section(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    print(title)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}".rstrip())
    print()


def _rm_command(args: argparse.Namespace) -> int:
    for name in args.models:
        freed = catalog.remove(name)
        print(f"deleted {name} ({human_bytes(freed)} freed)")
    return 0


def add_models_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `pull`, `list` (alias `ls`), `show` and `rm` on the mlxserve command line."""
    common = {"description": __doc__, "formatter_class": argparse.RawDescriptionHelpFormatter}
    p = subparsers.add_parser("pull", help="download a model from the hub into the cache", **common)
    p.add_argument(
        "model", metavar="MODEL", help="hub repo id (owner/name) or one GGUF file: owner/name:FILE"
    )
    p.add_argument(
        "--quant",
        default=None,
        help="pull the repo's GGUF file with this quantization in its name (Q4_K_M, Q8_0, ...)",
    )
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.set_defaults(handler=_pull_command, verbose=False)

    models_dir = {
        "type": Path,
        "default": None,
        "metavar": "DIR",
        "help": "also the .gguf files under DIR (searched recursively)",
    }
    p = subparsers.add_parser(
        "list", aliases=["ls"], help="list the models on this machine", **common
    )
    p.add_argument("--models-dir", **models_dir)
    p.set_defaults(handler=_list_command, verbose=False)

    p = subparsers.add_parser(
        "show", help="a model's architecture, parameters, quantization and template", **common
    )
    p.add_argument("model", metavar="MODEL", help="a name `mlxserve list` shows, or a path")
    p.add_argument("--models-dir", **models_dir)
    p.add_argument("--template", action="store_true", help="print only the chat template")
    p.set_defaults(handler=_show_command, verbose=False)

    p = subparsers.add_parser("rm", help="delete models from the Hugging Face cache", **common)
    p.add_argument("models", metavar="MODEL", nargs="+", help="a name `mlxserve list` shows")
    p.set_defaults(handler=_rm_command, verbose=False)
