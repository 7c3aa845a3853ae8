"""System messages in the middle of a conversation, rendered in place for every chat template.

Agents send system messages after the first turn (Anthropic's ``role: "system"`` inside
``messages``, Responses ``developer`` items, OpenAI chat ``system`` later on). Moving them to
the front would change the start of every prompt and lose its prefix cache, so they stay
where they are:

1. rendered by the template itself, when it keeps them in place (probed: each message's
   content is replaced by a marker, and the markers must come out in message order);
2. else as a user-side note in place, ``[System note] ...``: appended to the user turn it
   follows, or a user turn of its own (merged into the next user turn if the template
   insists that roles alternate).

    [system A, user B, system C, assistant D]      ChatML: rendered as is
    Gemma (raises on a later system message)  ->  [system A, user "B\n\n[System note] C",
                                                   assistant D]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

SYSTEM_NOTE = "[System note] "
_PROBE = "MLXSERVEPROBE{}X"

Messages = Sequence[Mapping[str, Any]]


def later_system_indices(messages: Messages) -> list[int]:
    """Indices of the system messages that are not the first message."""
    return [i for i, m in enumerate(messages) if i > 0 and m.get("role") == "system"]


def text_of(content: Any) -> str:
    """A message's content as text (text parts joined by newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p if isinstance(p, str) else p.get("text", "") for p in content]
        return "\n".join(p for p in parts if isinstance(p, str))
    return "" if content is None else str(content)


def render_in_place(render: Callable[[list[dict[str, Any]]], str], messages: Messages) -> str:
    """``render(messages)``, with later system messages kept in place (see the module doc).

    ``render`` raises ValueError when the template refuses the messages.
    """
    chat = [dict(m) for m in messages]
    later = later_system_indices(chat)
    if not later:
        return render(chat)
    if _keeps_in_place(render, chat, later):
        return render(chat)
    try:
        return render(as_user_notes(chat, merge_forward=False))
    except ValueError:
        return render(as_user_notes(chat, merge_forward=True))


def _keeps_in_place(
    render: Callable[[list[dict[str, Any]]], str], chat: list[dict[str, Any]], later: list[int]
) -> bool:
    """Whether the template renders each later system message once, in message order.

    The probe goes one exchange further than the request, so the answer holds as the
    conversation grows (Gemma takes [system, user, system], not one turn more): a choice
    that changed between two requests of one conversation would change its prefix.
    """
    more = [{"role": "user"}] if chat[-1].get("role") == "assistant" else []
    if not more:
        more = [{"role": "assistant"}, {"role": "user"}]
    probe = []
    for i, m in enumerate(chat + [m | {"content": ""} for m in more]):
        content = m.get("content")
        if isinstance(content, list):
            m = m | {"content": [{"type": "text", "text": _PROBE.format(i)}]}
        elif isinstance(content, str):
            m = m | {"content": _PROBE.format(i)}
        probe.append(m)
    try:
        text = render(probe)
    except ValueError:
        return False
    for i in later:
        mark = _PROBE.format(i)
        if text.count(mark) != 1:
            return False  # dropped, or rendered twice (hoisted and in place)
    found = [(i, text.find(_PROBE.format(i))) for i in range(len(probe))]
    positions = [at for _, at in found if at >= 0]
    return positions == sorted(positions)


def as_user_notes(messages: Messages, merge_forward: bool = False) -> list[dict[str, Any]]:
    """Later system messages as ``[System note]`` text on the user side, in place.

    A note joins the user turn it follows; otherwise it is a user turn of its own, or with
    ``merge_forward`` the start of the next user turn (for templates whose roles alternate).
    A run of system messages at the very start stays a system message (joined).
    """
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # notes waiting for the next user turn (merge_forward)
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "system" and i > 0:
            text = text_of(m.get("content"))
            if all(x.get("role") == "system" for x in out):  # still the leading system run
                out[0] = out[0] | {"content": text_of(out[0].get("content")) + "\n\n" + text}
                continue
            note = SYSTEM_NOTE + text
            last = out[-1]
            if last.get("role") == "user":
                out[-1] = last | {"content": text_of(last.get("content")) + "\n\n" + note}
            elif merge_forward and any(x.get("role") == "user" for x in messages[i + 1 :]):
                pending.append(note)
            else:
                out.append({"role": "user", "content": note})
            continue
        m = dict(m)
        if role == "user" and pending:
            m["content"] = "\n\n".join([*pending, text_of(m.get("content"))])
            pending = []
        out.append(m)
    return out
