"""Start a model for the server: an LLMEngine, its AsyncLLM thread, the ServedModel.

`mlxserve serve` starts its first model with this at start-up, and every other one on its
first request (Serving's loader, server/serving.py), the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.engine.llm_engine import LLMEngine
from mlxserve.server.served_model import ModelSpec, ServedModel, make_served_model


def start_engine(spec: ModelSpec) -> LLMEngine:
    """Load the spec's model into a new engine (slow: reads the weights, sizes the pool)."""
    assert spec.config is not None, "a spec to load needs its engine config"
    return LLMEngine(spec.config)


def serve_engine(
    engine: LLMEngine,
    spec: ModelSpec,
    on_step: Callable | None = None,
    on_dead: Callable[[str], None] | None = None,
) -> ServedModel:
    """Run ``engine`` in its own thread (AsyncLLM) and describe it as the spec's model;
    with no names in the spec, under the engine's model name."""
    llm = AsyncLLM(engine, on_step=on_step, on_dead=on_dead)
    defaults = spec.sampling_defaults
    return make_served_model(
        llm,
        spec.names or (engine.model_name,),
        spec.tool_call_parser,
        spec.reasoning_parser,
        engine.loaded.generation_defaults if defaults is None else defaults,
        root=spec.root or engine.loaded.source.name,
        prompt_normalization=spec.prompt_normalization,
    )
