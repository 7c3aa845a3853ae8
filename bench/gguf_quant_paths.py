"""Which path each GGUF tensor type takes on mlxserve's CPU, and the error of each type.

For every tensor of a GGUF file (or the first ``--max-per-type`` of each type), the
weights mlxserve computes with (its loader's MLX arrays, as the CPU kernels store them)
are compared with ``gguf.quants.dequantize`` of the same bytes (the gguf package: an
independent reader)::

    PYTHONPATH=. python bench/gguf_quant_paths.py MODEL.gguf [--json out.json]

Per type: the MLX format it becomes (bits stored, scales' dtype), whether that is exact,
the largest error relative to the tensor's largest weight and the RMS error relative to
the tensor's RMS. Q6_K's 16-value sub-blocks have no exact 32-value affine form: it is
re-quantized to 8 bits (min-max per 32 values), whose error is printed here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlxserve.cpu.kernels import STORED_BITS  # noqa: E402
from mlxserve.loader.gguf_quants import FLOAT_TYPES, REPACKABLE, convert_tensor  # noqa: E402


def tensor_path(qtype: QT, parts: dict[str, mx.array], cols: int) -> dict[str, object]:
    """How the loader stores a tensor of ``qtype`` and how the CPU kernels run it."""
    if qtype in FLOAT_TYPES or "scales" not in parts:
        return {"format": f"float ({parts['weight'].dtype})", "exact": qtype in FLOAT_TYPES}
    bits = parts["weight"].shape[-1] * 32 // cols
    return {
        "format": f"affine {bits}-bit g32, {str(parts['scales'].dtype).split('.')[-1]} scales",
        "kernel_bits": STORED_BITS.get(bits, bits),
        "exact": qtype in REPACKABLE,
    }


def measure(path: Path, max_per_type: int) -> dict[str, dict]:
    """Per tensor type: its path and the errors of the first ``max_per_type`` tensors."""
    out: dict[str, dict] = {}
    for t in GGUFReader(str(path)).tensors:
        qtype = QT(t.tensor_type)
        entry = out.setdefault(qtype.name, {"tensors": 0, "measured": 0})
        entry["tensors"] += 1
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # numpy order
        if qtype in FLOAT_TYPES:
            entry.update(format=f"float ({qtype.name}, kept as stored)", exact=True)
            continue
        if len(shape) != 2 or entry["measured"] >= max_per_type:
            continue
        want = quants.dequantize(t.data, qtype).reshape(shape).astype(np.float32)
        parts = convert_tensor(np.asarray(t.data), qtype, shape, keep_float=False)
        entry.update(tensor_path(qtype, parts, shape[1]))
        if "scales" in parts:
            bits = parts["weight"].shape[-1] * 32 // shape[1]
            got = mx.dequantize(
                parts["weight"], *(parts[k].astype(mx.float32) for k in ("scales", "biases")),
                group_size=32, bits=bits,
            )  # fmt: skip
            got = np.array(got)
        else:
            got = np.array(parts["weight"].astype(mx.float32))
        err = np.abs(got - want)
        rms = float(np.sqrt(np.mean(want.astype(np.float64) ** 2))) or 1.0
        entry["max_error_rel_max"] = max(
            entry.get("max_error_rel_max", 0.0), float(err.max() / np.abs(want).max())
        )
        entry["rms_error_rel_rms"] = max(
            entry.get("rms_error_rel_rms", 0.0),
            float(np.sqrt(np.mean(err.astype(np.float64) ** 2)) / rms),
        )
        entry["measured"] += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--max-per-type", type=int, default=4)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    result = measure(args.model, args.max_per_type)
    for name, e in result.items():
        errors = ""
        if "rms_error_rel_rms" in e:
            errors = (
                f"max err {e['max_error_rel_max']:.1e} of max |w|, "
                f"rms err {e['rms_error_rel_rms']:.1e} of rms"
            )
        kernel = f" -> kernels {e['kernel_bits']}-bit" if "kernel_bits" in e else ""
        exact = "exact" if e.get("exact") else "NOT exact"
        print(
            f"{name:6} x{e['tensors']:4}  {e.get('format', '(not 2-D)')}{kernel}, {exact}; {errors}"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "types": result}, indent=1))


if __name__ == "__main__":
    main()
