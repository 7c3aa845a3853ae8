"""The kernel source MLX generates for ``mx.fast.metal_kernel``, mirrored line for line.

Follows ``metal_kernel`` / ``write_signature`` / ``write_template`` / ``make_template_hash``
in mlx/backend/metal/custom_kernel.cpp (MLX 0.32): the same parameter list (inputs, then
``<name>_shape/_strides/_ndim`` when the body mentions them, then outputs, then the thread
attributes found by name in the body), the same address spaces (inputs with fewer than 8
elements go to ``constant``, 0-d inputs are references), the same kernel name and the same
explicit template instantiation. What compiles here is what MLX hands Apple's compiler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, type) in the order MLX appends them to the signature.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# MLX dtype name -> (Metal type string from get_type_string, numpy dtype of the storage)
TYPE_STRINGS = {
    "float32": ("float", np.float32),
    "float16": ("float16_t", np.float16),
    "bfloat16": ("bfloat16_t", np.uint16),
    "float64": ("double", np.float64),
    "bool": ("bool", np.bool_),
    "int8": ("int8_t", np.int8),
    "int16": ("int16_t", np.int16),
    "int32": ("int32_t", np.int32),
    "int64": ("int64_t", np.int64),
    "uint8": ("uint8_t", np.uint8),
    "uint16": ("uint16_t", np.uint16),
    "uint32": ("uint32_t", np.uint32),
    "uint64": ("uint64_t", np.uint64),
}


def dtype_name(dtype) -> str:
    """'float16' for mx.float16 (works for any object whose str ends in the name)."""
    return str(dtype).rsplit(".", 1)[-1]


def type_string(dtype) -> str:
    """MLX's get_type_string."""
    name = dtype_name(dtype)
    if name not in TYPE_STRINGS:
        raise ValueError(f"dtype {name} is not supported by metal_kernel")
    return TYPE_STRINGS[name][0]


@dataclass(frozen=True)
class InputSpec:
    """What the signature needs to know about one input array."""

    name: str
    dtype: str  # MLX dtype name
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class Param:
    """One kernel parameter, in buffer order (attributes have buffer=None)."""

    kind: str  # input | shape | strides | ndim | output | attr
    name: str
    ctype: str  # C type of the element (or of the attribute)
    buffer: int | None = None
    is_ref: bool = False  # 0-d input or ndim: passed by reference
    input_index: int | None = None
    output_index: int | None = None


@dataclass
class Generated:
    """The full text MLX compiles, and its parts."""

    kernel_name: str
    source: str  # exactly what MLX builds (before its own utils prelude)
    header: str
    signature: str  # template line + [[kernel]] line + parameters + ") {\n"
    body: str
    instantiation: str  # "" without template arguments
    template_def: str  # e.g. "<float16_t, 128>" or ""
    params: list[Param] = field(default_factory=list)


def shape_infos(source: str, input_names: list[str]) -> list[tuple[bool, bool, bool]]:
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes_in(source: str) -> list[tuple[str, str]]:
    """Thread attributes whose name occurs anywhere in the source (a substring match, as MLX)."""
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def _template_value(value) -> tuple[str, str]:
    """(parameter kind, value text) for a template argument."""
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "bool", "1" if value else "0"
    if isinstance(value, int):
        return "int", str(value)
    return "typename", type_string(value)


def write_template(template: list[tuple[str, object]]) -> str:
    return "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"


def make_template_hash(template_def: str) -> str:
    out = []
    i = 0
    while i < len(template_def):
        c = template_def[i]
        if c in "<>":
            out.append("_")
        elif c == "," and i + 1 < len(template_def) and template_def[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def generate(
    name: str,
    input_names: list[str],
    output_names: list[str],
    source: str,
    header: str,
    inputs: list[InputSpec],
    output_dtypes: list[str],
    template: list[tuple[str, object]] | None,
    atomic_outputs: bool = False,
) -> Generated:
    """Build the kernel source as mx.fast.metal_kernel(...)(...) does."""
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    if len(inputs) != len(input_names):
        raise ValueError(
            f"[metal_kernel] Expected `inputs` to have size {len(input_names)} "
            f"but got size {len(inputs)}."
        )
    if len(output_dtypes) != len(output_names):
        raise ValueError(
            f"[metal_kernel] Expected `output_dtypes` to have size {len(output_names)} "
            f"but got size {len(output_dtypes)}."
        )
    template = list(template or [])
    infos = shape_infos(source, input_names)
    attrs = attributes_in(source)

    kernel_name = "custom_kernel_" + name
    template_def = ""
    if template:
        template_def = write_template(template)
        kernel_name += "_" + make_template_hash(template_def)
    for spec in inputs:
        kernel_name += "_" + type_string(spec.dtype)
        if len(spec.shape) == 0:
            kernel_name += "s"
        elif spec.size < MAX_CONSTANT_ARRAY_SIZE:
            kernel_name += "c"
    for dt in output_dtypes:
        kernel_name += "_" + type_string(dt)

    params: list[Param] = []
    sig = ""
    if template:
        sig += "template <"
        sig += ", ".join(f"{_template_value(v)[0]} {n}" for n, v in template)
        sig += ">\n"
    sig += f"[[kernel]] void {kernel_name}(\n"
    index = 0
    for i, (iname, spec) in enumerate(zip(input_names, inputs, strict=True)):
        tstr = type_string(spec.dtype)
        location = "constant" if spec.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if len(spec.shape) == 0 else "*"
        sig += f"  const {location} {tstr}{ref} {iname} [[buffer({index})]],\n"
        params.append(Param("input", iname, tstr, index, ref == "&", input_index=i))
        index += 1
        if len(spec.shape) > 0:
            has_shape, has_strides, has_ndim = infos[i]
            if has_shape:
                sig += f"  const constant int* {iname}_shape [[buffer({index})]],\n"
                params.append(Param("shape", iname + "_shape", "int", index, input_index=i))
                index += 1
            if has_strides:
                sig += f"  const constant int64_t* {iname}_strides [[buffer({index})]],\n"
                params.append(Param("strides", iname + "_strides", "int64_t", index, input_index=i))
                index += 1
            if has_ndim:
                sig += f"  const constant int& {iname}_ndim [[buffer({index})]],\n"
                params.append(Param("ndim", iname + "_ndim", "int", index, True, input_index=i))
                index += 1
    for j, (oname, dt) in enumerate(zip(output_names, output_dtypes, strict=True)):
        tstr = type_string(dt)
        elem = f"atomic<{tstr}>" if atomic_outputs else tstr
        sig += f"  device {elem}* {oname} [[buffer({index})]]"
        params.append(Param("output", oname, elem, index, output_index=j))
        # MLX's condition, verbatim (it counts shape buffers in `index`).
        if index < len(inputs) + len(output_names) - 1 or len(attrs) > 0:
            sig += ",\n"
        else:
            sig += ") {\n"
        index += 1
    for k, (attr, atype) in enumerate(attrs):
        sig += f"  {atype} {attr} [[{attr}]]"
        params.append(Param("attr", attr, atype))
        sig += ",\n" if k < len(attrs) - 1 else ") {\n"

    instantiation = ""
    if template:
        tdef = kernel_name + template_def
        instantiation = (
            f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({tdef}) {tdef};\n'
        )
    full = header + sig + source + "\n}\n" + instantiation
    return Generated(
        kernel_name=kernel_name,
        source=full,
        header=header,
        signature=sig,
        body=source,
        instantiation=instantiation,
        template_def=template_def,
        params=params,
    )


def generate_for_call(
    name: str,
    input_names: list[str],
    output_names: list[str],
    source: str,
    header: str,
    arrays: list,
    output_dtypes: list,
    template: list[tuple[str, object]] | None,
    atomic_outputs: bool = False,
) -> Generated:
    """:func:`generate` from what a metal_kernel call receives: the input arrays, MLX dtypes."""
    specs = [
        InputSpec(n, dtype_name(a.dtype), tuple(a.shape))
        for n, a in zip(input_names, arrays, strict=True)
    ]
    return generate(
        name,
        list(input_names),
        list(output_names),
        source,
        header,
        specs,
        [dtype_name(d) for d in output_dtypes],
        template,
        atomic_outputs,
    )
