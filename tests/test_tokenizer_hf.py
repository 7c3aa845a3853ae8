"""Tokenizer.from_dir against transformers.AutoTokenizer on the same local directory (offline)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from mlxserve.exceptions import ParameterError
from mlxserve.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! What is the weather like in Paris today?",
    "Tools: get_weather(city) returns the temperature in celsius.",
    "你好，世界。今天天气很好。 Café naïve façade 🙂",
    "def add(a, b):\n    return a + b\n",
] * 30
SPECIALS = ["<|begin|>", "<|end|>", "<|im_start|>", "<|im_end|>", "<pad>"]

# A Qwen-style template: tools as JSON, tool calls, tool results, loop controls, raise_exception,
# an extra variable, BOS text at the start, whitespace shaped by trim_blocks / lstrip_blocks.
CHATML_TOOLS = """{{- bos_token }}
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}
# Tools
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}<|im_end|>
{%- elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
<|im_start|>{{ message.role }}
{% if message.content is defined %}{{ message.content }}{% endif %}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
<tool_call>{{ call.function | tojson }}</tool_call>
        {%- endfor %}
    {%- endif %}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
    {% if enable_thinking is defined and not enable_thinking %}
<think></think>
    {% endif %}
{%- endif %}"""

# A template that loops over content parts (OpenAI-style lists).
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}\n{% endfor %}"
)
TOOL_USE_TEMPLATE = "TOOLS={{ tools | tojson }} {% for m in messages %}{{ m.content }}{% endfor %}"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, “quoted” & <escaped?>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What's the weather in Paris?"},
    ],
    [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in 東京?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "東京"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 °C 🙂"},
        {"role": "user", "content": "Thanks!"},
    ],
]


def train_byte_level(corpus: list[str]) -> Backend:
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<|begin|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", bos)]
    )
    return tok


def train_metaspace(corpus: list[str]) -> Backend:
    tok = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def write_dir(path: Path, backend: Backend, config: dict[str, Any], **files: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    config.setdefault("clean_up_tokenization_spaces", False)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        name = name.replace("__", ".")
        text = content if isinstance(content, str) else json.dumps(content)
        (path / name).write_text(text)
    return path


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    backend = train_byte_level(CORPUS)
    im_end, end = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|end|>")
    config = {
        "bos_token": "<|begin|>",
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<pad>",
        "chat_template": CHATML_TOOLS,
    }
    return write_dir(
        tmp_path_factory.mktemp("hf") / "chat",
        backend,
        config,
        generation_config__json={"eos_token_id": [im_end], "pad_token_id": 4},
        config__json={"eos_token_id": end, "bos_token_id": 0},
    )


@pytest.fixture(scope="module")
def pair(chat_dir: Path) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(chat_dir), AutoTokenizer.from_pretrained(
        chat_dir, local_files_only=True
    )


TEXTS = [
    "Hello world!",
    "  spaces  and\ttabs\n\nnewlines ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "你好，世界 🙂 Café",
    "",
    "<|begin|>already has a BOS",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, hf = pair
    assert ours.encode(text) == hf(text)["input_ids"]
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(0, 599), max_size=30))
def test_decode_random_ids_matches_transformers(
    pair: tuple[Tokenizer, Any], ids: list[int]
) -> None:
    ours, hf = pair
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_match_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    assert ours.bos_token_id == hf.bos_token_id and ours.bos_token == hf.bos_token
    assert ours.eos_token_id == hf.eos_token_id and ours.eos_token == hf.eos_token
    assert ours.pad_token_id == hf.pad_token_id
    # all_special_ids is what decoding with skip_special_tokens drops (transformers' own
    # all_special_ids lists only the named ones)
    dropped = {i for i in range(len(hf)) if hf.decode([i], skip_special_tokens=True) == ""}
    assert ours.all_special_ids == frozenset(dropped) >= frozenset(hf.all_special_ids)
    assert ours.vocab_size == len(hf)
    assert ours.add_bos_token
    # the union of tokenizer eos, generation_config.json's list and config.json's int
    ids = {hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|end|>")}
    assert ours.eos_token_ids == frozenset(ids)
    for token in ("Ġworld", "<pad>"):
        assert ours.token_to_id(token) == hf.convert_tokens_to_ids(token)
        assert ours.id_to_token(ours.token_to_id(token)) == token


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_chat_template_matches_transformers(
    pair: tuple[Tokenizer, Any], conv: int, add_generation_prompt: bool, with_tools: bool
) -> None:
    ours, hf = pair
    messages = CONVERSATIONS[conv]
    tools = [WEATHER_TOOL] if with_tools else None
    kwargs = {"add_generation_prompt": add_generation_prompt, "tools": tools}
    expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == expected
    thinking = hf.apply_chat_template(messages, tokenize=False, enable_thinking=False, **kwargs)
    assert ours.apply_chat_template(messages, enable_thinking=False, **kwargs) == thinking
    # the rendered text starts with the BOS text: encode_chat must not add a second BOS
    ids = ours.encode_chat(messages, **kwargs)
    assert ids == hf(expected, add_special_tokens=False)["input_ids"]
    assert ids[:2] != [ours.bos_token_id] * 2


def test_chat_template_errors(pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = pair
    with pytest.raises(ValueError, match="Unknown role: narrator"):
        ours.apply_chat_template([{"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="non-empty list"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match="image_url"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match="syntax error"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}")


def test_content_parts_flattened_for_string_templates(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    joined = [{"role": "user", "content": "a\nb"}]
    assert ours.apply_chat_template(parts) == hf.apply_chat_template(
        joined, tokenize=False, add_generation_prompt=True
    )
    # a template that loops over parts gets them as they are
    kwargs = {"chat_template": PARTS_TEMPLATE, "add_generation_prompt": False}
    mixed = [*parts, {"role": "assistant", "content": "c"}]
    assert ours.apply_chat_template(mixed, **kwargs) == hf.apply_chat_template(
        mixed, tokenize=False, **kwargs
    )
    assert (
        ours.apply_chat_template(mixed, **kwargs) == "user:[a][b]assistant:c"
    )  # trim_blocks ate the newlines


def test_generation_tag_and_helpers_match_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% else %}{{ m.content | tojson(indent=2) }}{% endif %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    messages = CONVERSATIONS[2][-2:]
    kwargs = {"chat_template": template, "add_generation_prompt": False}
    expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == expected


TRIM_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content | trim }}\n{% endfor %}"
CODE_PREFILL = "```python\nimport os\n"  # a reply pre-started with a fence and a line


@pytest.mark.parametrize(
    ("final", "template", "ends"),
    [
        ("It is", None, "It is"),
        # The template renders the text verbatim: its trailing newline is kept.
        (CODE_PREFILL, None, CODE_PREFILL),
        # The template trims: so does the cut (transformers' semantics).
        (CODE_PREFILL, TRIM_TEMPLATE, "import os"),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b "}], PARTS_TEMPLATE, "[b "),
        ("", None, "<|im_start|>assistant\n"),
    ],
)
def test_continue_final_message_matches_transformers(
    pair: tuple[Tokenizer, Any], final: Any, template: str | None, ends: str
) -> None:
    ours, hf = pair
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": final}]
    kwargs = {"chat_template": template, "add_generation_prompt": False}
    expected = hf.apply_chat_template(
        messages, tokenize=False, continue_final_message=True, **kwargs
    )
    got = ours.apply_chat_template(messages, continue_final_message=True, **kwargs)
    assert got == expected and got.endswith(ends)


def test_continue_final_message_errors(pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = pair
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": "It is"}]
    with pytest.raises(ParameterError, match="cannot both be true") as e:
        ours.apply_chat_template(messages, continue_final_message=True)
    assert e.value.parameter == "continue_final_message"
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    no_text = [*CONVERSATIONS[1], {"role": "assistant", "content": None}]
    with pytest.raises(ParameterError, match="final message with text content"):
        ours.apply_chat_template(no_text, **flags)
    dropped = "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}"
    with pytest.raises(ParameterError, match="does not render the final message") as e:
        ours.apply_chat_template(messages, chat_template=dropped, **flags)
    assert e.value.parameter == "messages"


def test_metaspace_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_dir(
        tmp_path / "spm", train_metaspace(CORPUS), {"bos_token": "<s>", "eos_token": "</s>"}
    )
    ours, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    for text in TEXTS + ["  lead", "a  b", "ẞ𝔘nknown chars ☃"]:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.chat_template is None
    with pytest.raises(ValueError, match="has no chat template; pass chat_template="):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])
    # with a template and BOS not in the rendered text, encode_chat adds exactly one BOS
    ids = ours.encode_chat(
        [{"role": "user", "content": "hi"}], chat_template="{{ messages[0].content }}"
    )
    assert ids == ours.encode("hi")
    assert ids[0] == ours.bos_token_id and ids[1] != ours.bos_token_id


def test_add_bos_eos_flags_override_post_processor(tmp_path: Path) -> None:
    backend = train_byte_level(CORPUS[:10])  # its post-processor adds <|begin|>
    begin, end = backend.token_to_id("<|begin|>"), backend.token_to_id("<|end|>")
    plain = backend.encode("hi there", add_special_tokens=False).ids
    special = {"bos_token": "<|begin|>", "eos_token": "<|end|>"}
    flags = {**special, "add_bos_token": False, "add_eos_token": True}
    tok = Tokenizer.from_dir(write_dir(tmp_path / "flags", backend, flags))
    assert tok.encode("hi there") == [*plain, end]
    assert tok.encode("hi there", add_special_tokens=False) == plain
    assert not tok.add_bos_token and tok.add_eos_token
    # without the flags the post-processor decides, and the flags describe it
    tok = Tokenizer.from_dir(write_dir(tmp_path / "plain", backend, special))
    assert tok.encode("hi there") == [begin, *plain]
    assert tok.add_bos_token and not tok.add_eos_token


def test_template_files_precedence(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    backend = train_byte_level(CORPUS[:10])
    named = [
        {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
        {"name": "tool_use", "template": TOOL_USE_TEMPLATE},
    ]
    listed = write_dir(
        tmp_path / "listed", backend, {"chat_template": named, "eos_token": "<|end|>"}
    )
    jinja = write_dir(
        tmp_path / "jinja",
        backend,
        {"chat_template": "CONFIG", "eos_token": "<|end|>"},
        chat_template__jinja="FILE {{ messages[0].content }}",
    )
    legacy = write_dir(
        tmp_path / "legacy",
        backend,
        {"eos_token": "<|end|>"},
        chat_template__json={"chat_template": "JSON {{ messages[0].content }}"},
    )
    msgs = [{"role": "user", "content": "x"}]
    for path in (listed, jinja):
        ours, hf = (
            Tokenizer.from_dir(path),
            AutoTokenizer.from_pretrained(path, local_files_only=True),
        )
        for tools in (None, [WEATHER_TOOL]):
            assert ours.apply_chat_template(msgs, tools=tools) == hf.apply_chat_template(
                msgs, tools=tools, tokenize=False, add_generation_prompt=True
            )
    assert Tokenizer.from_dir(listed).apply_chat_template(msgs).startswith("DEFAULT")
    assert Tokenizer.from_dir(jinja).apply_chat_template(msgs) == "FILE x"
    assert Tokenizer.from_dir(legacy).apply_chat_template(msgs) == "JSON x"


def test_dir_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty/tokenizer\.json: not found"):
        Tokenizer.from_dir(empty)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match=r"corrupt/tokenizer\.json: not a valid tokenizers file"):
        Tokenizer.from_dir(corrupt)
    bad_config = write_dir(tmp_path / "badcfg", train_byte_level(CORPUS[:5]), {})
    (bad_config / "generation_config.json").write_text("{eos: 1}")
    with pytest.raises(ValueError, match=r"badcfg/generation_config\.json: invalid JSON"):
        Tokenizer.from_dir(bad_config)
