"""Agents' volatile prompt parts (server/prompt_normalization.py), on messages written by hand
with the shape Claude Code sends: expected outputs derived by hand."""

from __future__ import annotations

import pytest

from mlxserve.server.prompt_normalization import PARTS, normalize, parse_parts

HEADER = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch=36ee5;"


def test_the_billing_header_line_leaves_system_messages_only() -> None:
    messages = [
        {"role": "system", "content": HEADER + "\nYou are a coding agent."},
        {"role": "user", "content": HEADER},  # a user's own text is theirs
    ]
    assert normalize(messages, ("billing-header",)) == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": HEADER},
    ]
    parts = {
        "role": "system",
        "content": [{"type": "text", "text": HEADER}, {"type": "text", "text": "Hi"}],
    }
    assert normalize([parts], ("billing-header",)) == [
        {
            "role": "system",
            "content": [{"type": "text", "text": ""}, {"type": "text", "text": "Hi"}],
        }
    ]


def test_two_turns_with_different_hashes_render_the_same_prefix() -> None:
    def turn(cch: str, left: int) -> list[dict]:
        marker = f"<total_tokens>{left} tokens left</total_tokens>"
        system = f"{HEADER.replace('36ee5', cch)}\nBe careful.\n{marker}"
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "Fix the bug."},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Thanks."},
        ]

    first, second = normalize(turn("aaaaa", 900), PARTS), normalize(turn("bbbbb", 700), PARTS)
    assert (
        first[:3]
        == second[:3]
        == [
            {"role": "system", "content": "Be careful."},
            {"role": "user", "content": "Fix the bug."},
            {"role": "assistant", "content": "Done."},
        ]
    )
    # The budget moved after everything a cache holds: the model still reads the latest one.
    assert second[3] == {
        "role": "user",
        "content": "Thanks.\n<total_tokens>700 tokens left</total_tokens>",
    }


def test_markers_stay_in_the_last_message_and_leave_earlier_ones() -> None:
    marker = "<total_tokens>5 tokens left</total_tokens>"
    messages = [
        {"role": "user", "content": "go"},
        {"role": "tool", "content": f"a.py\n{marker}"},
        {"role": "user", "content": [{"type": "text", "text": f"next\n{marker}"}]},
    ]
    out = normalize(messages, ("token-markers",))
    assert out[1] == {"role": "tool", "content": "a.py"}
    assert out[2] == messages[2]  # not cached yet: left as the client wrote it
    assert messages[1]["content"].endswith(marker)  # the caller's messages are not modified


def test_a_moved_marker_is_appended_as_a_text_part_to_a_list_content() -> None:
    messages = [
        {"role": "system", "content": "S\n<total_tokens>3 tokens left</total_tokens>"},
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
    ]
    assert normalize(messages, ("token-markers",))[1]["content"] == [
        {"type": "text", "text": "q"},
        {"type": "text", "text": "<total_tokens>3 tokens left</total_tokens>"},
    ]


def test_nothing_changes_with_no_parts_or_nothing_volatile() -> None:
    messages = [{"role": "system", "content": HEADER}, {"role": "user", "content": "hi"}]
    assert normalize(messages, ()) is messages
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert normalize(plain, PARTS) == plain


@pytest.mark.parametrize(
    "spec, parts",
    [
        ("all", PARTS),
        ("none", ()),
        ("token-markers", ("token-markers",)),
        (" billing-header , token-markers,billing-header", PARTS),
    ],
)
def test_the_flags_value(spec: str, parts: tuple[str, ...]) -> None:
    assert parse_parts(spec) == parts


def test_an_unknown_part_is_named() -> None:
    with pytest.raises(ValueError, match="'headers'.*billing-header, token-markers"):
        parse_parts("headers")


def test_a_template_that_drops_earlier_reasoning_is_detected() -> None:
    from mlxserve.server.prompt_normalization import dropped_reasoning

    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "think about a"},
        {"role": "user", "content": "c"},
    ]
    kept = "<|im_start|>assistant\n<think>\nthink about a\n</think>\nb<|im_end|>"
    assert dropped_reasoning(messages, kept) == 0
    assert dropped_reasoning(messages, "<|im_start|>assistant\nb<|im_end|>") == 1
    # The last message's reasoning is the one a continuation renders: not counted.
    assert dropped_reasoning(messages[:2], "") == 0


def test_the_server_says_once_that_its_template_drops_reasoning(tmp_path) -> None:
    import httpx

    from tests.engine_helpers import make_tiny_model_dir
    from tests.server_harness import start_server

    # Qwen3's habit, in short: reasoning shown only for assistant turns after the last user.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and "
        "m.reasoning_content is defined and loop.index0 > ns_last %}<think>{{ "
        "m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ).replace("ns_last", "(messages | map(attribute='role') | list | length) - 1")
    (tmp_path / "t.jinja").write_text(template)
    _, model_dir = make_tiny_model_dir(tmp_path / "tiny", seed=4)
    args = [str(model_dir), "--served-model-name", "tiny", "--chat-template"]
    server = start_server(args + [str(tmp_path / "t.jinja")], tmp_path / "log")
    try:
        history = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "I think so"},
            {"role": "user", "content": "c"},
        ]
        body = {"model": "tiny", "messages": history, "max_tokens": 1}
        for _ in range(2):
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        server.stop()
    assert server.log().count("leaves out the reasoning of earlier assistant turns") == 1
