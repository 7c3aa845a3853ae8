"""A stand-in for mx.fast.metal_kernel that records the sources MLX would compile.

Running mlxserve's ops against ``Recorder().metal_kernel`` yields exactly the generated
kernels (signature, template arguments, address spaces) a Mac would build for those shapes,
without running anything: the static checks and the batched emulator build use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from metal.checker.signature import Generated, generate_for_call


@dataclass
class Recorder:
    """Collects every distinct generated kernel; calls return zero-filled outputs."""

    generated: dict[str, Generated] = field(default_factory=dict)

    def metal_kernel(
        self,
        name: str,
        input_names: list[str],
        output_names: list[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        compile_options: dict | None = None,
    ):
        """Same arguments as mx.fast.metal_kernel."""

        def call(
            *,
            inputs,
            output_shapes,
            output_dtypes,
            grid,
            threadgroup,
            template=None,
            init_value=None,
            verbose=False,
            stream=None,
        ) -> list[mx.array]:
            arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
            g = generate_for_call(
                name,
                input_names,
                output_names,
                source,
                header,
                arrays,
                output_dtypes,
                template,
                atomic_outputs,
            )
            self.generated.setdefault(g.source, g)
            return [
                mx.zeros(tuple(s), dtype=d)
                for s, d in zip(output_shapes, output_dtypes, strict=True)
            ]

        return call

    @property
    def variants(self) -> list[Generated]:
        return list(self.generated.values())
