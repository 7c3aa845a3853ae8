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
