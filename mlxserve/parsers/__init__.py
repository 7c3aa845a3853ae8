"""Parsers of model output, API-neutral: tool calls and ``<think>`` reasoning.

A front-end (today the OpenAI chat endpoint) feeds the detokenized output through them and
formats the ParsedDeltas its own way.

    tool parsers:      hermes (Qwen2.5 / Qwen3 / Hermes), qwen3_coder, llama3_json, mistral
    reasoning parsers: qwen3, deepseek_r1, smollm3
"""

from __future__ import annotations

from mlxserve.parsers.base import (
    ParsedDelta,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    aggregate,
    make_tool_call_id,
)
from mlxserve.parsers.hermes import HermesToolParser
from mlxserve.parsers.llama3 import Llama3JsonToolParser
from mlxserve.parsers.mistral import MistralToolParser
from mlxserve.parsers.output import OutputParser
from mlxserve.parsers.qwen3_coder import Qwen3CoderToolParser
from mlxserve.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    ReasoningParser,
    SmolLM3ReasoningParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (HermesToolParser, Qwen3CoderToolParser, Llama3JsonToolParser, MistralToolParser)
}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (ReasoningParser, DeepSeekR1ReasoningParser, SmolLM3ReasoningParser)
}


def tool_parser_for_template(template: str | None) -> str | None:
    """The tool parser that reads what a chat template asks the model to write, if any.

    Looks for each format's markers in the template's text (Qwen3-Coder's XML before
    Hermes' tags, since both use <tool_call>).
    """
    if not template:
        return None
    if "<tool_call>" in template and "<function=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return "llama3_json"
    return None


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParsedDelta",
    "OutputParser",
    "ParsedMessage",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "aggregate",
    "make_tool_call_id",
    "tool_parser_for_template",
]
