"""vLLM flags a copied `vllm serve` line carries that mean nothing on MLX.

Each is accepted so the line starts unchanged, and warned about in one line that says why it
has no effect here; a flag left at vLLM's default says nothing. Flags that do something here
(sizes, ports, parallelism) are real engine or server flags, not listed here.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass

logger = logging.getLogger("mlxserve")


@dataclass(frozen=True)
class NoEffectFlag:
    """One accepted vLLM flag: its spellings, how it parses, and why it does nothing here."""

    names: tuple[str, ...]
    reason: str
    takes_value: bool = True  # False: a switch (store_true, or BooleanOptionalAction)
    negatable: bool = False  # a switch that vLLM also spells --no-NAME
    # Values that change nothing even in vLLM's terms: no warning (a switch: off).
    quiet_values: tuple[str, ...] = ("False",)
    # Where argparse stores it; an EngineConfig field keeps its name (enforce_eager).
    dest_name: str | None = None
    nargs: str | None = None  # "+" for vLLM's list-valued flags

    @property
    def dest(self) -> str:
        return self.dest_name or "compat_" + self.names[0].lstrip("-").replace("-", "_")


ENGINE_FLAGS = (
    NoEffectFlag(
        ("--trust-remote-code",),
        "mlxserve never runs Python code from a model repository; its architectures are "
        "built in (mlxserve/models, or mlx-lm's)",
        takes_value=False,
        negatable=True,
    ),
    NoEffectFlag(
        ("--enforce-eager",),
        "MLX builds its graphs lazily each step; there are no CUDA graphs to capture",
        takes_value=False,
        dest_name="enforce_eager",
    ),
    NoEffectFlag(
        ("--swap-space",),
        "preempted requests are recomputed, never swapped: CPU and GPU share one memory",
    ),
    NoEffectFlag(
        ("--cpu-offload-gb",),
        "CPU and GPU share one (unified) memory, so there is nothing to offload to",
    ),
    NoEffectFlag(
        ("--quantization", "-q"),
        "the checkpoint's own quantization is used, read from its files (mlx-community "
        "packed weights or GGUF blocks); a value that does not match it is an error",
    ),
    NoEffectFlag(
        ("--load-format",),
        "the format is read from the files (safetensors directory or .gguf)",
        quiet_values=("auto",),
    ),
    NoEffectFlag(
        ("--tokenizer-mode",),
        "the tokenizer is always the model's tokenizer.json (or the GGUF's vocabulary)",
        quiet_values=("auto",),
    ),
    NoEffectFlag(
        ("--device",),
        "MLX picks its device: Metal on Apple Silicon, the CPU elsewhere",
        quiet_values=("auto",),
    ),
    NoEffectFlag(
        ("--max-seq-len-to-capture",),
        "there are no CUDA graphs on MLX",
    ),
    NoEffectFlag(("--cuda-graph-sizes",), "there are no CUDA graphs on MLX", nargs="+"),
    NoEffectFlag(
        ("--enable-chunked-prefill",),
        "chunked prefill is how the scheduler always works (--max-num-batched-tokens sizes "
        "the chunks)",
        takes_value=False,
        negatable=True,
        quiet_values=("True",),  # on, as it always is here: only --no-... is worth a word
    ),
    NoEffectFlag(
        ("--disable-custom-all-reduce",),
        "one device: there is no all-reduce",
        takes_value=False,
    ),
    NoEffectFlag(
        ("--distributed-executor-backend",),
        "one device: there are no workers to distribute (scale-out is not wired in yet)",
    ),
)

SERVER_FLAGS = (
    NoEffectFlag(
        ("--disable-log-requests",),
        "mlxserve never logs request contents",
        takes_value=False,
    ),
    NoEffectFlag(
        ("--enable-log-requests",),
        "mlxserve never logs request contents, only the periodic stats line",
        takes_value=False,
    ),
    NoEffectFlag(
        ("--disable-frontend-multiprocessing",),
        "the HTTP front end and the engine thread always share one process",
        takes_value=False,
    ),
)


def add_no_effect_flags(parser: argparse.ArgumentParser, flags: tuple[NoEffectFlag, ...]) -> None:
    """Accept ``flags`` (help says they do nothing here, and why)."""
    g = parser.add_argument_group("vLLM flags accepted with no effect here")
    for flag in flags:
        kwargs: dict = {"dest": flag.dest, "default": None, "help": f"no effect: {flag.reason}"}
        if flag.takes_value:
            kwargs.update(metavar="VALUE", nargs=flag.nargs)
        elif flag.negatable:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif not flag.takes_value:
            kwargs.update(action="store_true", default=False)
        g.add_argument(*flag.names, **kwargs)


def warn_no_effect(args: argparse.Namespace, flags: tuple[NoEffectFlag, ...]) -> list[str]:
    """Log one warning per flag given (other than vLLM's default); return the lines."""
    lines = []
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None or str(value) in flag.quiet_values:
            continue
        if isinstance(value, bool):
            shown = flag.names[0] if value else "--no-" + flag.names[0][2:]
        else:
            shown = f"{flag.names[0]} {' '.join(value) if isinstance(value, list) else value}"
        lines.append(f"{shown} has no effect here: {flag.reason}")
        logger.warning(lines[-1])
    return lines


def checkpoint_quantization(source_kind: str, config: dict) -> str | None:
    """How a loaded checkpoint is quantized, in --quantization's terms (None: it is not)."""
    if source_kind == "gguf":
        return "gguf"
    qconf = config.get("quantization_config")
    if isinstance(qconf, dict) and qconf.get("quant_method"):
        return str(qconf["quant_method"])
    return "mlx" if config.get("quantization") else None


def check_quantization(args: argparse.Namespace, source_kind: str, config: dict) -> None:
    """--quantization is accepted when it names the checkpoint's own; else a ValueError."""
    wanted = getattr(args, "compat_quantization", None)
    actual = checkpoint_quantization(source_kind, config)
    if wanted is not None and wanted != actual:
        raise ValueError(
            f"--quantization {wanted} does not match the checkpoint, which is "
            f"{'quantized as ' + actual if actual else 'not quantized'}: mlxserve runs a "
            "checkpoint as it is quantized; drop the flag"
        )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]i?)?\s*$")


def human_int(text: str) -> int:
    """An int as vLLM takes sizes: ``4096``, ``8k`` (x1000), ``8K`` / ``8Ki`` (x1024), ``2G``."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected an integer like 4096, 8k or 2G, got {text!r}")
    number, unit = float(m.group(1)), m.group(2) or ""
    power = " kmgt".index(unit[:1].lower()) if unit else 0
    base = 1024 if unit[:1].isupper() or unit.endswith("i") else 1000
    value = number * base**power
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)
