"""`mlxserve run` in-process: sampling defaults, the loop stop, the REPL's input and commands,
and which first word is a MODEL. A tiny random model answers (fast, no downloads)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from mlxserve.cli.chat import CHAT_DEFAULTS, ChatSession, chat_sampling, split_model_and_prompt
from mlxserve.cli.main import build_parser
from mlxserve.cli.repl import HELP, Repl
from mlxserve.config import EngineConfig
from mlxserve.sampling_params import SamplingParams
from tests.engine_helpers import make_tiny_model_dir
from tests.test_loader_resolve import make_fake_hub
from tests.test_repetition import brute_force_first_loop

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def session_factory(tmp_path_factory: pytest.TempPathFactory):
    """New ChatSessions over one tiny model's engine."""
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("m") / "m", seed=5)
    first = ChatSession.load(EngineConfig(model=str(model_dir), num_blocks=128), GREEDY)

    def make(params: SamplingParams = GREEDY, **kw) -> ChatSession:
        return ChatSession(first.engine, params, **kw)

    return make


def run_repl(session: ChatSession, text: str) -> str:
    out = io.StringIO()
    Repl(session, io.StringIO(text), out).run()
    return out.getvalue()


# ---- sampling: chat defaults < the model's < flags ------------------------------------
def parse_run(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *flags])


def test_defaults_are_the_chat_ones_when_the_model_has_none() -> None:
    params, sources = chat_sampling(parse_run(), {})
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (
        0.8,
        40,
        0.9,
        1024,
    )
    assert params.seed == 0  # the engine's --seed: a sampled answer is reproducible
    assert {sources[k] for k in CHAT_DEFAULTS} == {"default"}
    assert sources["seed"] == "default"  # no --seed given: /set must not say "--seed"


def test_a_seed_flag_is_shown_as_a_flag() -> None:
    params, sources = chat_sampling(parse_run("--seed", "7"), {})
    assert (params.seed, sources["seed"]) == (7, "flag")
    params, sources = chat_sampling(parse_run("--seed", "0"), {})
    assert (params.seed, sources["seed"]) == (0, "flag")


def test_the_model_overrides_the_defaults_and_flags_override_the_model() -> None:
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    params, sources = chat_sampling(parse_run("--temperature", "0", "--max-tokens", "7"), model)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0, 0.95, 20, 7)
    assert params.seed is None  # greedy
    assert sources["temperature"] == sources["max_tokens"] == "flag"
    assert sources["top_p"] == sources["top_k"] == "model"
    assert sources["min_p"] == "default"


@pytest.mark.parametrize(
    "argv,words",
    [
        (["./dir", "--temperature", "0", "hi"], ["./dir", "hi"]),  # flags between
        (["--temperature", "0", "./dir", "hi"], ["./dir", "hi"]),
        (["./dir", "hi", "--temperature", "0"], ["./dir", "hi"]),
        (["what", "--temperature", "0", "is", "-v", "this"], ["what", "is", "this"]),
        (["-5 + 3 = ?", "--temperature", "0"], ["-5 + 3 = ?"]),  # a prompt, not an option
        (["--temperature", "0", "--", "-hi", "--top-k"], ["-hi", "--top-k"]),  # -- ends options
        (["./dir", "--temperature", "0", "--", "-x"], ["./dir", "-x"]),
        (["--temperature", "0"], []),
    ],
)
def test_flags_anywhere_among_model_and_prompt(argv: list[str], words: list[str]) -> None:
    args = parse_run(*argv)
    assert args.words == words
    assert args.temperature == 0


def test_an_unknown_flag_among_the_words_is_still_refused(capsys) -> None:
    from mlxserve.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "./dir", "--no-such-flag", "hi"])
    assert exc.value.code == 2
    assert "mlxserve run: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_a_bad_flag_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="top_p must be > 0"):
        chat_sampling(parse_run("--top-p", "0"), {})


# ---- the loop stop ---------------------------------------------------------------------
def greedy_tokens(session: ChatSession, text: str, max_tokens: int) -> list[int]:
    """What the engine generates for ``text`` with nothing stopping it early."""
    engine = session.engine
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}], True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("oracle", None, params, prompt_token_ids=ids)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step(delta=True):
            tokens += out.outputs[0].token_ids
    return tokens


def test_a_looping_answer_stops_and_the_history_keeps_one_copy(session_factory) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    session = session_factory(params)
    full = greedy_tokens(session, "hello", 400)
    loop = brute_force_first_loop(full, max_period=256, min_repeats=3, min_span=64)
    assert loop is not None, "the tiny model's greedy answer is expected to loop"
    out = io.StringIO()
    reply = session.answer("hello", out)
    decode = session.engine.tokenizer.decode
    assert reply == decode(full[: loop.keep]) == session.messages[-1]["content"]
    shown, note = out.getvalue().rsplit("\n", 2)[:2]
    assert decode(full).startswith(shown)  # streamed up to the loop, then cut
    assert note == (
        "[stopped: the answer repeats itself; /set stop_on_loop off (or --no-stop-on-loop) "
        "allows it]"
    )
    assert not session.engine.has_unfinished_requests()
    # Turned off, the same answer runs to max_tokens, and says so.
    session.set("stop_on_loop", "off")
    session.clear()
    notes = io.StringIO()
    assert session.answer("hello", io.StringIO(), notes=notes) == decode(full)
    assert notes.getvalue() == (
        "[stopped at max_tokens=400; /set max_tokens N (or --max-tokens N) for more]\n"
    )


def test_one_shot_notes_name_flags_not_repl_commands(session_factory) -> None:
    """A one-shot answer ends the program: its notes name the flag to rerun with."""
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    session = session_factory(params, is_one_shot=True)
    notes = io.StringIO()
    session.answer("hello", io.StringIO(), notes=notes)
    assert notes.getvalue() == (
        "[stopped: the answer repeats itself; --no-stop-on-loop allows it]\n"
    )
    session = session_factory(
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), is_one_shot=True
    )
    notes = io.StringIO()
    session.answer("hello", io.StringIO(), notes=notes)
    assert notes.getvalue() == "[stopped at max_tokens=2; --max-tokens N for more]\n"


# ---- the REPL ----------------------------------------------------------------------------
def test_commands_never_reach_the_model(session_factory) -> None:
    session = session_factory()
    out = run_repl(session, "/help\n/?\n/nonsense here\n/clear\n/exit\nhello\n")
    assert out.count(HELP) == 2
    assert (
        "unknown command '/nonsense': /help lists the commands (start the line with a space "
        "to send it to the model)"
    ) in out
    assert "(conversation cleared)" in out
    assert session.messages == []  # /exit ended the loop before "hello"


def test_a_leading_space_sends_a_slash_line_to_the_model(session_factory) -> None:
    session = session_factory()
    run_repl(session, " /etc/hosts: what is it?\n")
    assert session.messages[0] == {"role": "user", "content": "/etc/hosts: what is it?"}


def test_triple_quotes_make_one_message_of_several_lines(session_factory) -> None:
    session = session_factory()
    text = '"""first line\n\n  indented\n/not a command\nlast"""\n"""one line"""\n"""\nend of input'
    out = run_repl(session, text)
    users = [m["content"] for m in session.messages if m["role"] == "user"]
    assert users == [
        "first line\n\n  indented\n/not a command\nlast",
        "one line",
        "end of input",  # input ended inside the block: what there is is sent
    ]
    assert out.count("... ") == 6  # the continuation prompt, once per line read after """


def test_end_of_input_ends_with_a_newline(session_factory) -> None:
    out = run_repl(session_factory(), "")
    assert out == ">>> \n"  # the shell's prompt then starts on its own line


def test_set_shows_and_changes_settings(session_factory) -> None:
    session = session_factory(
        SamplingParams(temperature=0.8, max_tokens=4), sources={"temperature": "model"}
    )
    out = run_repl(
        session,
        "/set temperature 0.3\n/set max_tokens 2\n/set parameter top_k 5\n"
        "/set max_tokens none\n/set temperature -1\n/set top_k 1.5\n/set nope 1\n"
        "/set stop_on_loop maybe\n/set system Be brief.\n/set\n",
    )
    assert session.params.temperature == 0.3 and session.params.top_k == 5
    assert session.params.max_tokens is None
    assert "temperature = 0.3\n" in out and "top_k = 5\n" in out
    assert "error: temperature must be >= 0.0, got -1.0" in out  # SamplingParams' words
    assert "error: top_k must be an integer, got '1.5'" in out
    assert "error: unknown setting 'nope'; settable: temperature," in out
    assert "error: stop_on_loop is on or off, got 'maybe'" in out
    assert session.messages == [{"role": "system", "content": "Be brief."}]
    table = out.split(">>> ")[-2]  # the /set listing
    assert "  temperature          0.3      (/set)\n" in table
    assert "  top_p                1.0\n" in table
    assert "  stop_on_loop         on\n" in table
    assert "  system               'Be brief.'\n" in table


def test_set_max_tokens_applies_to_the_next_answer(session_factory) -> None:
    session = session_factory(SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    run_repl(session, "/set max_tokens 2\nhi\n")
    reply = session.messages[-1]["content"]
    assert len(session.engine.tokenizer.encode(reply, add_special_tokens=False)) <= 2


# ---- MODEL or prompt? ---------------------------------------------------------------------
@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch) -> Path:
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    make_fake_hub(cache, "acme/cached", {"config.json": "{}"})
    make_fake_hub(cache, "acme/cached-GGUF", {"m.gguf": "x"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize(
    "words,flag,expected",
    [
        (["hello there"], None, (None, "hello there")),
        (["and/or"], None, (None, "and/or")),  # was taken for a hub model id
        (["org/model", "hi"], None, (None, "org/model hi")),  # not downloaded: the prompt
        (["acme/cached", "hi"], None, ("acme/cached", "hi")),
        (["acme/cached-GGUF/m.gguf"], None, ("acme/cached-GGUF/m.gguf", None)),
        (["what is 1 + 1?"], None, (None, "what is 1 + 1?")),
        (["acme/cached", "hi"], "x.gguf", ("x.gguf", "acme/cached hi")),
        (["./nowhere/model.gguf", "hi"], None, ("./nowhere/model.gguf", "hi")),
        (["~/models/m", "hi"], None, ("~/models/m", "hi")),
        ([], None, (None, None)),
    ],
)
def test_model_or_prompt_first_word(hub_cache, words, flag, expected) -> None:
    assert split_model_and_prompt(words, flag) == expected


def test_an_existing_directory_is_a_model(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel").mkdir()
    assert split_model_and_prompt(["mymodel", "hi"], None) == ("mymodel", "hi")


@pytest.mark.parametrize("word", ["llama3.2:1b", "qwen2.5-coder:0.5b", "hf.co/acme/x-GGUF:Q4_K_M"])
def test_an_ollama_name_read_as_the_prompt_says_so(hub_cache, capsys, word: str) -> None:
    assert split_model_and_prompt([word, "hi"], None) == (None, f"{word} hi")  # unchanged
    assert capsys.readouterr().err == (
        f"note: {word!r} looks like an Ollama model name but is not a local or downloaded "
        "model, so it is read as the prompt; name a model with --model: a hub id "
        "(owner/name), a directory or a .gguf file\n"
    )


@pytest.mark.parametrize("words", [["10:30", "in 12h time?"], ["hello"], ["Summarize:", "x"]])
def test_a_prompt_that_is_no_model_name_gets_no_note(hub_cache, capsys, words) -> None:
    assert split_model_and_prompt(words, None) == (None, " ".join(words))
    assert capsys.readouterr().err == ""


def test_a_hub_id_read_as_the_prompt_says_so(hub_cache, capsys) -> None:
    split_model_and_prompt(["Qwen/Qwen3-0.6B"], None)
    assert capsys.readouterr().err == (
        "note: 'Qwen/Qwen3-0.6B' is not a local or downloaded model, so it is read as the "
        "prompt; to download it from the hub: mlxserve run --model Qwen/Qwen3-0.6B\n"
    )


def test_load_goes_on_with_another_model_and_show_describes_it(tmp_path) -> None:
    _, first_dir = make_tiny_model_dir(tmp_path / "first", seed=5)
    _, other_dir = make_tiny_model_dir(tmp_path / "other", seed=6)
    session = ChatSession.load(EngineConfig(model=str(first_dir), num_blocks=128), GREEDY)
    session.sampling_for = lambda defaults: (SamplingParams(max_tokens=7), {"max_tokens": "flag"})
    out = run_repl(
        session,
        "hello\n/set temperature 0\n/show\n/load\n/load /no/such/model\n"
        f"/load {other_dir}\nagain\n/show\n/show template\n/show nope\n",
    )
    assert session.engine.model_name == "other" and session.config.model == str(other_dir)
    assert "  model            first\n" in out and "  architecture     llama\n" in out
    assert "error: /load needs a model" in out
    assert "error: model '/no/such/model' is neither" in out
    assert "loaded other\n" in out
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2  # kept
    assert session.params.temperature == 0.0 and session.params.max_tokens == 7
    assert session.sources["temperature"] == "/set"
    assert "<|im_start|>" in out  # the chat template
    assert "error: /show nope: expected info, template" in out
