"""Gemma 3 and Phi-3 / Phi-4 chat templates (the models' own, tests/fixtures/chat_templates)
through mlxserve's Jinja renderer, against transformers' renderer of the same template and
the formats their model cards document, written out by hand."""

from __future__ import annotations

import pytest

from mlxserve.tokenizer.chat_template import ChatTemplate
from tests.paths import ROOT

TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"
SPECIAL = {"bos_token": "<bos>", "eos_token": "<|endoftext|>"}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi there  "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
# What the model cards document for CHAT with a generation prompt.
DOCUMENTED = {
    # Gemma 3: the system prompt opens the first user turn; "model" is the assistant's role;
    # contents are trimmed.
    "gemma3": "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
    "<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
    "<start_of_turn>model\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\n  Hi there  <|end|>\n"
    "<|assistant|>\nHello!<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n",
    "phi4": "<|im_start|>system<|im_sep|>Be brief.<|im_end|>"
    "<|im_start|>user<|im_sep|>  Hi there  <|im_end|>"
    "<|im_start|>assistant<|im_sep|>Hello!<|im_end|>"
    "<|im_start|>user<|im_sep|>Bye<|im_end|><|im_start|>assistant<|im_sep|>",
}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def transformers_render(source: str, messages: list, add_generation_prompt: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        **SPECIAL,
    )
    return rendered[0]


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_renders_as_transformers_and_the_model_card(
    name: str, add_generation_prompt: bool
) -> None:
    source = template(name)
    got = ChatTemplate(source).render(
        CHAT, add_generation_prompt=add_generation_prompt, variables=SPECIAL
    )
    assert got == transformers_render(source, CHAT, add_generation_prompt)
    if add_generation_prompt:
        assert got == DOCUMENTED[name]


def test_gemma3_text_parts_and_no_system() -> None:
    """Gemma 3 loops over content parts itself (images, text): parts reach it as a list."""
    source = template("gemma3")
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": " this "}],
        }
    ]
    got = ChatTemplate(source).render(messages, variables=SPECIAL)
    assert got == transformers_render(source, messages, True)
    assert got == "<bos><start_of_turn>user\nDescribethis<end_of_turn>\n<start_of_turn>model\n"


def test_gemma3_refuses_roles_that_do_not_alternate() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        ChatTemplate(template("gemma3")).render(messages, variables=SPECIAL)


# ---- system messages after the first turn: in place, never hoisted ----------------------------
LATER_SYSTEM = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "system", "content": "Answer in French."},
    {"role": "assistant", "content": "Salut"},
    {"role": "user", "content": "Bye"},
    {"role": "system", "content": "Stop."},
]
# Renders messages[0] as the system prompt and skips every other system message.
DROPS_LATER_SYSTEM = (
    "{% if messages[0].role == 'system' %}SYSTEM: {{ messages[0].content }}\n{% endif %}"
    "{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}: {{ m.content }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
# Collects every system message into one block at the front.
HOISTS_SYSTEM = (
    "SYSTEM:{% for m in messages %}{% if m.role == 'system' %} {{ m.content }}{% endif %}"
    "{% endfor %}\n{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}: "
    "{{ m.content }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
NOTES = (
    "SYSTEM: Be brief.\nuser: Hi\n\n[System note] Answer in French.\nassistant: Salut\n"
    "user: Bye\n\n[System note] Stop.\nassistant:"
)


def test_chatml_renders_later_system_messages_in_place(smollm2_gguf) -> None:
    """SmolLM2's own template (ChatML) takes a system turn anywhere: rendered as given."""
    from mlxserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf)
    got = tok.apply_chat_template(LATER_SYSTEM)
    want = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in LATER_SYSTEM)
    assert got == want + "<|im_start|>assistant\n"


def test_a_template_that_raises_gets_user_side_notes_in_place() -> None:
    """Gemma 3 refuses a system message after the first (roles must alternate): each becomes
    a note at the end of the user turn it follows, so earlier turns render as before."""
    got = ChatTemplate(template("gemma3")).render(LATER_SYSTEM, variables=SPECIAL)
    assert got == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi\n\n[System note] Answer in French."
        "<end_of_turn>\n<start_of_turn>model\nSalut<end_of_turn>\n<start_of_turn>user\nBye\n\n"
        "[System note] Stop.<end_of_turn>\n<start_of_turn>model\n"
    )
    # Prefix caching: the conversation so far renders as the start of the next request.
    earlier = ChatTemplate(template("gemma3")).render(
        LATER_SYSTEM[:3], add_generation_prompt=False, variables=SPECIAL
    )
    assert got.startswith(earlier.removesuffix("<end_of_turn>\n"))


def test_a_note_after_an_assistant_turn_joins_the_next_user_turn_if_roles_must_alternate() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
    ]
    got = ChatTemplate(template("gemma3")).render(messages, variables=SPECIAL)
    assert got.endswith(
        "<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\n[System note] Be brief."
        "\n\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    )
    chatml = ChatTemplate(CHATML_NO_SYSTEM_CHECK).render(messages)  # no rule: a turn of its own
    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhy?" in chatml


CHATML_NO_SYSTEM_CHECK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("source", [DROPS_LATER_SYSTEM, HOISTS_SYSTEM], ids=["drops", "hoists"])
def test_a_template_that_drops_or_hoists_gets_user_side_notes_in_place(source: str) -> None:
    got = ChatTemplate(source).render(LATER_SYSTEM)
    if source is HOISTS_SYSTEM:  # trim_blocks eats the newline after the system block
        assert got == NOTES.replace("Be brief.\n", "Be brief.", 1)
    else:
        assert got == NOTES
