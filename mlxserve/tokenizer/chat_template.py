"""Chat templates with Hugging Face semantics (sandboxed Jinja2, transformers' helpers)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxserve.exceptions import ParameterError
from mlxserve.tokenizer.system_notes import render_in_place

# Put after the final message's text to find where it ends in the rendered prompt; its
# trailing space tells whether the template kept the text's trailing whitespace.
CONTINUE_MARK = "MLXSERVE_CONTINUE_FINAL_MESSAGE "


class _GenerationTag(Extension):
    """Accept transformers' ``{% generation %}...{% endgeneration %}`` markers; render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; templates are written against json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja2 environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _is_content(expr: nodes.Node, content_vars: set[str]) -> bool:
    """True when `expr` is message content: x.content, x['content'], a variable set from it."""
    if isinstance(expr, nodes.Getattr):
        return expr.attr == "content"
    if isinstance(expr, nodes.Getitem):
        return isinstance(expr.arg, nodes.Const) and expr.arg.value == "content"
    if isinstance(expr, nodes.Name):
        return expr.name in content_vars
    if isinstance(expr, (nodes.Filter, nodes.Test)):
        return expr.node is not None and _is_content(expr.node, content_vars)
    return False


def iterates_over_content(ast: nodes.Template) -> bool:
    """Whether a template loops over message content (it expects OpenAI-style lists of parts)."""
    content_vars: set[str] = set()
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _is_content(assign.node, content_vars):
            content_vars.add(assign.target.name)
    return any(_is_content(loop.iter, content_vars) for loop in ast.find_all(nodes.For))


def _flatten_content(content: Any, role: Any) -> Any:
    """A list of text parts -> one string (joined by newlines) for templates that expect strings."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") == "text" and "text" in part:
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"messages: content part of type {kind!r} in a {role!r} message is not supported "
                "(only text parts)"
            )
    return "\n".join(texts)


class ChatTemplate:
    """One compiled chat template."""

    def __init__(self, source: str, env: ImmutableSandboxedEnvironment | None = None) -> None:
        self.source = source
        env = env or make_environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: Jinja syntax error on line {e.lineno}: {e}") from e
        self.wants_content_parts = iterates_over_content(ast)
        # Whether it renders tools itself (reads the ``tools`` variable).
        self.uses_tools = any(n.name == "tools" for n in ast.find_all(nodes.Name))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render messages to the prompt text.

        ``continue_final_message`` ends the text with the final message, open, for the model
        to continue (transformers' semantics: its trailing whitespace is kept when the
        template renders the message verbatim).
        """
        if continue_final_message and add_generation_prompt:
            raise ParameterError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(one continues the last message, the other starts a new assistant turn): "
                "set add_generation_prompt to false",
                "continue_final_message",
            )
        if tools is not None:
            tools = [self._check_tool(t) for t in tools]

        def render(given: list[dict[str, Any]]) -> str:
            chat = self._prepare(given)
            if continue_final_message:
                chat[-1] = self._mark_final(chat[-1])
            try:
                return self._template.render(
                    **dict(variables or {}),
                    messages=chat,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                )
            except jinja2.TemplateError as e:
                raise ValueError(f"chat_template: {e}") from e

        if isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        if not all(isinstance(m, Mapping) for m in messages):
            return render(list(messages))  # _prepare names the bad message
        text = render_in_place(render, messages)
        if continue_final_message:
            text = self._cut_at_mark(text)
        return text

    def _prepare(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
            # Keys set to None (OpenAI's content=None next to tool_calls) are dropped, as
            # transformers does; templates test for a missing key, not for None.
            msg = {k: v for k, v in message.items() if v is not None}
            if "content" in msg and not self.wants_content_parts:
                msg["content"] = _flatten_content(msg["content"], msg.get("role"))
            chat.append(msg)
        return chat

    @staticmethod
    def _check_tool(tool: Any) -> Any:
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools must be JSON-schema dicts, got {type(tool).__name__}")
        return tool

    @staticmethod
    def _mark_final(message: dict[str, Any]) -> dict[str, Any]:
        """The final message with CONTINUE_MARK after its text (the last text part's)."""
        content = message.get("content")
        if isinstance(content, str):
            return message | {"content": content + CONTINUE_MARK}
        if isinstance(content, list):
            parts = list(content)
            for i in reversed(range(len(parts))):
                part = parts[i]
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    parts[i] = {**part, "text": part["text"] + CONTINUE_MARK}
                    return message | {"content": parts}
        raise ParameterError(
            "continue_final_message needs a final message with text content", "messages"
        )

    @staticmethod
    def _cut_at_mark(text: str) -> str:
        at = text.rfind(CONTINUE_MARK.strip())
        if at < 0:
            raise ParameterError(
                "continue_final_message: the chat template does not render the final "
                "message's text as given, so it cannot be continued",
                "messages",
            )
        if text.startswith(CONTINUE_MARK, at):
            return text[:at]  # rendered verbatim: keep the message's trailing whitespace
        return text[:at].rstrip()  # the template strips whitespace: so does the cut
