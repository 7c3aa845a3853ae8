"""Tools and reasoning on /v1/chat/completions: the prompt, the constraint, the parsing.

    ChatFeatures (once per server)   which tool-call format the model writes (--tool-call-parser,
                                     else read from the chat template; Hermes for templates
                                     without tools), which reasoning parser (--reasoning-parser,
                                     else <think> in the template)
    ChatFeatures.plan(...) -> ChatPlan   per request, in API-neutral terms (plain messages,
                                     tools, a tool_choice name): messages and tools for the
                                     template, the grammar of a forced call, how to parse

tool_choice: "none" (tools are left out of the prompt, the reply is not parsed for calls),
"auto" (the default with tools: the reply is parsed), "required" and a named function (a
grammar makes the model write a call in its format, arguments valid for the schema).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mlxserve.exceptions import ParameterError
from mlxserve.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    OutputParser,
    ParsedDelta,
    tool_parser_for_template,
)
from mlxserve.parsers.base import ParsedMessage, aggregate
from mlxserve.parsers.harmony import HarmonyParser
from mlxserve.parsers.reasoning import THINK_END, ReasoningParser, prompt_opens_reasoning
from mlxserve.parsers.tool_grammar import call_grammar
from mlxserve.parsers.tool_prompt import FALLBACK_PARSER, fallback_messages, native_messages
from mlxserve.sampling_params import SamplingParams, StructuredOutputsParams
from mlxserve.server.prompt_normalization import normalize
from mlxserve.tokenizer.harmony import HARMONY_TEXT_TOKENS

logger = logging.getLogger("mlxserve.server")


@dataclass
class ChatPlan:
    """How one chat request uses tools and reasoning."""

    messages: list[dict[str, Any]]  # for the chat template
    tools: list[dict[str, Any]] | None  # for the chat template (templates that render tools)
    tool_parser: str | None  # parse the reply for calls in this format
    tool_defs: list[dict[str, Any]] | None
    parallel_tool_calls: bool
    reasoning: type[ReasoningParser] | None
    harmony: bool = False  # gpt-oss: the reply's channels say what is reasoning and calls
    forced: bool = False  # tool_choice "required" or a named function: a grammar makes calls

    def output_parser(self, prompt: str) -> OutputParser | HarmonyReplyParser | None:
        """A fresh parser for one sample's reply (None: the reply is all content)."""
        if self.harmony:
            return HarmonyReplyParser()
        if self.tool_parser is None and self.reasoning is None:
            return None
        tools = TOOL_PARSERS[self.tool_parser](self.tool_defs) if self.tool_parser else None
        reasoning = self.reasoning(prompt) if self.reasoning else None
        return OutputParser(reasoning, tools, calls_only=self.forced)

    def grammar_starts_after(self, prompt: str, params: SamplingParams) -> str | None:
        """With a constraint and a reasoning model: it applies after the reasoning, unless
        the prompt has closed the reasoning already (thinking turned off)."""
        if params.structured_outputs is None or self.reasoning is None:
            return None
        # No <think> in the prompt: Qwen3 and SmolLM3 open one themselves when thinking.
        return None if prompt_opens_reasoning(prompt) is False else THINK_END


class ChatFeatures:
    """The server's tool-call format and reasoning parser for its model's chat template."""

    def __init__(
        self,
        tokenizer,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        prompt_normalization: tuple[str, ...] = (),
    ) -> None:
        self.prompt_normalization = prompt_normalization  # server/prompt_normalization.PARTS
        self.num_dropped_reasoning = 0  # earlier turns whose reasoning the template left out
        template = None
        try:
            compiled = tokenizer.compiled_chat_template(None, tools=[])
        except ValueError:  # no chat template (or several and none default): no features
            compiled = None
        if compiled is not None:
            template = compiled.source
        # A harmony tokenizer (gpt-oss) renders tools itself, in its own renderer, and its
        # reply's channels are parsed by HarmonyReplyParser.
        self.harmony = getattr(tokenizer, "chat_format", "jinja") == "harmony"
        self.native_tools = self.harmony or (compiled is not None and compiled.uses_tools)
        detected = tool_parser_for_template(template)
        if tool_call_parser is None:
            tool_call_parser = detected or (None if self.native_tools else FALLBACK_PARSER)
        self.tool_parser = tool_call_parser
        if reasoning_parser is None and template and THINK_END in template:
            reasoning_parser = "qwen3"  # follows the prompt: R1-style templates open <think>
        self.reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        # Tool-call markers the vocabulary spells as one token (Qwen's <tool_call>, Mistral's
        # [TOOL_CALLS]): forced-call grammars ask for those tokens, and the reply is decoded
        # with them kept where they are special tokens, or the parser would never see them.
        markers = {m for p in TOOL_PARSERS.values() for m in p.markers} | set(HARMONY_TEXT_TOKENS)
        self._marker_ids = {m: i for m in markers if (i := tokenizer.token_to_id(m)) is not None}
        self._special_markers = {
            m for m, i in self._marker_ids.items() if i in tokenizer.all_special_ids
        }
        if self.harmony:
            logger.info("chat: harmony (gpt-oss): reasoning, content and tool calls by channel")
            return
        logger.info(
            "chat: tool calls %s%s, reasoning parser %s",
            self.tool_parser or "not parsed",
            "" if self.native_tools else " (tools described in the system message)",
            reasoning_parser or "none",
        )

    def keeps_special_tokens(self, parser: str) -> bool:
        """Whether a reply in ``parser``'s format must be decoded with special tokens kept."""
        cls = TOOL_PARSERS[parser]
        return cls.needs_special_tokens or any(m in self._special_markers for m in cls.markers)

    def note_dropped_reasoning(self, count: int) -> None:
        """Count turns whose reasoning the template left out; the first time, say what it
        costs (thread-safe enough: a count for the log, not an exact figure)."""
        if count and not self.num_dropped_reasoning:
            logger.info(
                "the chat template leaves out the reasoning of earlier assistant turns: "
                "each turn's prompt matches the cache up to the start of the previous "
                "reply, which is computed again"
            )
        self.num_dropped_reasoning += count

    def template_inputs(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) to render: natively, or with tools written into the messages
        for a template that does not render them (tool_prompt.fallback_messages); agents'
        volatile parts neutralized first (server/prompt_normalization.py)."""
        messages = normalize(messages, self.prompt_normalization)
        if self.native_tools:
            return native_messages(messages), tools or None
        if tools or any(m.get("tool_calls") for m in messages):
            return fallback_messages(messages, tools), None
        return messages, None

    def plan(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        tool_choice: str | None,
        parallel_tool_calls: bool,
        params: SamplingParams,
    ) -> ChatPlan:
        """Messages, tools and parsing for one chat request, whatever API it came in by.

        ``tools`` are OpenAI function tools (``{"type": "function", "function": {...}}``);
        ``tool_choice`` is "none", "auto", "required" or a function's name (None: "auto"
        with tools). A forced call's grammar goes into ``params.structured_outputs``.
        ParameterError (parameter "tool_choice") for a choice that cannot be honoured.
        """
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise ParameterError(f"tool_choice {choice!r} needs tools", parameter="tool_choice")
        functions = [t["function"] for t in tools]
        if choice not in ("none", "auto", "required"):  # a named function
            functions = [f for f in functions if f["name"] == choice]
            if not functions:
                names = ", ".join(repr(t["function"]["name"]) for t in tools)
                raise ParameterError(
                    f"tool_choice names the function {choice!r}, which is not in tools ({names})",
                    parameter="tool_choice",
                )
        use_tools = tools if choice != "none" else []
        parser = self.tool_parser if use_tools else None
        if choice not in ("none", "auto"):
            if self.harmony:
                parser = "harmony"  # a forced call's grammar; the reply is read by channel
            if parser is None:
                raise ParameterError(
                    "tool_choice cannot be enforced: the model's chat template renders tools "
                    "in a format mlxserve does not know; start the server with "
                    f"--tool-call-parser ({', '.join(TOOL_PARSERS)})",
                    parameter="tool_choice",
                )
            if params.structured_outputs is not None:
                raise ParameterError(
                    "tool_choice that forces a call cannot be combined with another output "
                    "constraint (response_format, structured_outputs, guided_*)",
                    parameter="tool_choice",
                )
            # "required": one call or more (parallel_tool_calls allowing); a named
            # function: exactly one call of it, as OpenAI's forced function.
            several = parallel_tool_calls and choice == "required"
            grammar = call_grammar(parser, functions, several, self._marker_ids.get)
            params.structured_outputs = StructuredOutputsParams(grammar=grammar)
        if parser == "harmony":
            parser = None  # HarmonyReplyParser reads the reply (ChatPlan.harmony)
        if parser is not None and self.keeps_special_tokens(parser):
            params.skip_special_tokens = False  # its markers are special tokens
        template_messages, template_tools = self.template_inputs(messages, use_tools)
        return ChatPlan(
            template_messages,
            template_tools,
            parser,
            use_tools or None,
            parallel_tool_calls,
            self.reasoning,
            self.harmony,
            forced=choice not in ("none", "auto"),
        )


class HarmonyReplyParser:
    """gpt-oss's harmony reply as the output parsers' deltas: the analysis channel is
    reasoning, final is content, a message to ``functions.NAME`` is a call of NAME."""

    def __init__(self) -> None:
        self._parser = HarmonyParser()

    def feed(self, text: str) -> ParsedDelta:
        return self._parser.feed(text)

    def finish(self) -> ParsedDelta:
        return self._parser.finish()

    def parse(self, text: str) -> ParsedMessage:
        return aggregate([self.feed(text), self.finish()])


class ReplyFormatter:
    """One sample's reply in OpenAI's chat shape: content, reasoning_content, tool_calls.

    Streamed (``delta`` per new piece of text, ``finish`` at the end) or whole
    (``message``); both go through the same OutputParser, so they agree.
    """

    def __init__(self, plan: ChatPlan, prompt: str) -> None:
        self.parser = plan.output_parser(prompt)
        self.has_reasoning = plan.reasoning is not None or plan.harmony
        self.forced = plan.forced
        self.parallel = plan.parallel_tool_calls
        self.num_calls = 0

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole reply."""
        if self.parser is None:
            return {"role": "assistant", "content": text}
        parsed = self.parser.parse(text)
        calls = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
        self.num_calls = len(calls)
        content = parsed.content or (None if self.forced else "")  # a call cut short: none
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = parsed.content or None
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        if self.has_reasoning:
            message["reasoning_content"] = parsed.reasoning_content or None
        return message

    def delta(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The chunk deltas a new piece of text gives (the end of the reply if ``final``)."""
        if self.parser is None:
            return [{"content": text}] if text else []
        parsed = self.parser.feed(text) if text else ParsedDelta()
        if final:
            parsed += self.parser.finish()
        out: list[dict[str, Any]] = []
        if parsed.reasoning_content:
            out.append({"reasoning_content": parsed.reasoning_content})
        if parsed.content:
            out.append({"content": parsed.content})
        for tc in parsed.tool_calls:
            if tc.index > 0 and not self.parallel:
                continue  # parallel_tool_calls=false: the first call only
            self.num_calls = max(self.num_calls, tc.index + 1)
            head = {"index": tc.index, "id": tc.id, "type": "function"}
            out.append({"tool_calls": [head | {"function": {"name": tc.name, "arguments": ""}}]})
            if tc.arguments:
                args = {"index": tc.index, "function": {"arguments": tc.arguments}}
                out.append({"tool_calls": [args]})
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the reply ended by calling tools."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason
