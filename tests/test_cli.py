"""`mlxserve run` as a user runs it: one-shot, piped stdin, and a REPL on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlxserve.cli.chat import ChatSession
from mlxserve.config import EngineConfig
from mlxserve.sampling_params import SamplingParams
from tests.engine_helpers import make_tiny_model_dir
from tests.paths import ROOT, SMOLLM2_GGUF

RUN = [sys.executable, "-m", "mlxserve.cli", "run"]


# Greedy, the default model answers "The capital of France is Paris." with float and with
# int8 activations, by >= 1.7 nats at every step (bare "What is the capital of France?"
# is a near tie that int8 rounding flips).
QUESTION = "What is the capital of France? Answer with one word."


def run_cli(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        RUN + args, input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_one_shot_answers_with_flags_anywhere() -> None:
    """Flags before, between and after MODEL and the prompt (the model named by its path)."""
    args = ["--max-tokens", "12", str(SMOLLM2_GGUF), "--temperature", "0", QUESTION, "--seed", "3"]
    out = run_cli(args, stdin="")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The capital of France is Paris."


def test_a_greedy_loop_is_stopped_with_a_note() -> None:
    """Greedy, the default model answers this with two lines over and over until its 8k
    context is full (60 s+, before the loop stop); now the answer stops at the loop. (Which
    prompt loops moves with the kernels' last bits: "Write a haiku about autumn." looped
    until the attention's vectorized softmax, and now ends after two lines.)"""
    out = run_cli(["Write a poem about autumn.", "--temperature", "0"], stdin="")
    assert out.returncode == 0, out.stderr
    assert out.stderr.endswith(  # one-shot: the flag, not a REPL command
        "[stopped: the answer repeats itself; --no-stop-on-loop allows it]\n"
    )
    # The answer ends in one block of text repeated (which block depends on the path:
    # "a leaf's fate is determined, " with float activations, two lines with int8 ones):
    # at least 3 copies, and stopped within 20.
    period, copies = looping_tail(out.stdout.rstrip("\n"))
    assert period >= 10 and 3 <= copies < 20, (period, copies, out.stdout)


def looping_tail(text: str, min_period: int = 10) -> tuple[int, float]:
    """(p, copies): the shortest period p >= min_period of characters over which the end of
    ``text`` repeats itself at least 3 times, and how many copies of it the tail holds;
    (0, 0) if none."""
    for p in range(min_period, len(text) // 3 + 1):
        start = len(text) - p  # text[i] == text[i + p] for every i from start on
        while start > 0 and text[start - 1] == text[start - 1 + p]:
            start -= 1
        if (len(text) - start) / p >= 3:
            return p, (len(text) - start) / p
    return 0, 0.0


def test_piped_stdin_is_the_prompt() -> None:
    out = run_cli(
        ["--max-tokens", "12", "--temperature", "0"],
        stdin=QUESTION + "\n",
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_bad_input_is_one_clear_error_line(tmp_path: Path) -> None:
    out = run_cli([str(tmp_path / "missing.gguf"), "hi", "--max-tokens", "4"], stdin="")
    assert out.returncode == 2
    assert "missing.gguf" in out.stderr and "Traceback" not in out.stderr
    out = run_cli(["hi", "--temperature", "-1", "--max-tokens", "4"], stdin="")
    assert out.returncode == 2 and "temperature must be >= 0" in out.stderr


class Terminal:
    """A child process on a pseudo-terminal, read until expected text appears."""

    def __init__(self, args: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            os.chdir(ROOT)
            # As if launched by a non-interactive shell's background job (SIGINT ignored,
            # and inherited through exec): Ctrl-C must still stop an answer.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.execv(sys.executable, RUN[:1] + RUN[1:] + args)
        self.buffer = ""

    def expect(self, text: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not seen; got:\n{self.buffer}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096).decode(errors="replace")
                except OSError:
                    raise AssertionError(f"process ended before {text!r}:\n{self.buffer}") from None
                self.buffer += chunk
        before, _, after = self.buffer.partition(text)
        self.buffer = after
        return before

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining so the child never blocks on a full pty
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.buffer += os.read(self.fd, 4096).decode(errors="replace")
            except OSError:
                pass
        os.kill(self.pid, 9)
        raise AssertionError("process did not exit")


def test_repl_two_turns_clear_ctrl_c_and_exit() -> None:
    # Room for a long answer to interrupt; short questions end on their own (EOS). Greedy:
    # the same answers every time.
    term = Terminal(["--max-tokens", "400", "--temperature", "0"])
    term.expect(">>> ")
    # The default model's card defaults are "model" defaults; no --seed flag was given.
    term.send("/set\n")
    table = term.expect(">>> ")
    for row in [
        "temperature          0.0      (flag)",
        "top_p                0.9      (model)",
        "top_k                40       (default)",
        "seed                 none     (default)",
    ]:
        assert row in table, table
    term.send(QUESTION + "\n")
    answer = term.expect(">>> ")
    assert "Paris" in answer
    term.send("And of Germany?\n")
    term.expect(">>> ")
    term.send("/clear\n")
    term.expect("(conversation cleared)")
    term.expect(">>> ")
    # A long answer, interrupted: the REPL survives and says so. (Not the loop stop.)
    term.send("/set stop_on_loop off\n")
    term.expect("stop_on_loop = off")
    term.expect(">>> ")
    term.send("Write a long story about a dragon.\n")
    time.sleep(2)
    term.send("\x03")
    term.expect("[stopped]")
    term.expect(">>> ")
    term.send("/exit\n")
    assert term.wait() == 0


def test_chat_session_keeps_history_and_clears_it(tmp_path: Path) -> None:
    _, model_dir = make_tiny_model_dir(tmp_path / "m", seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    session = ChatSession.load(
        EngineConfig(model=str(model_dir), num_blocks=64), params, system="Be brief."
    )
    import io

    first = session.answer("hello", io.StringIO())
    session.answer("again", io.StringIO())
    assert [m["role"] for m in session.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert session.messages[2]["content"] == first
    # The second prompt is the template over the whole conversation so far.
    tok = session.engine.tokenizer
    expected = tok.encode_chat(session.messages[:4], add_generation_prompt=True)
    assert session._prompt_ids()[: len(expected) - 3] == expected[: len(expected) - 3]
    session.clear()
    assert session.messages == [{"role": "system", "content": "Be brief."}]


def test_repl_on_a_terminal_multiline_settings_and_ctrl_d(tmp_path: Path) -> None:
    """The model's generation_config under the flags (shown by /set), a triple-quoted
    block, an unknown command answered, and Ctrl-D leaving the shell a fresh line."""
    _, model_dir = make_tiny_model_dir(tmp_path / "m", seed=5)
    (model_dir / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    term = Terminal([str(model_dir), "--max-tokens", "3", "--top-k", "7", "--num-blocks", "64"])
    term.expect(">>> ")
    term.send("/set\n")
    table = term.expect(">>> ")
    for row in [
        "temperature          0.6      (model)",
        "top_p                0.95     (model)",
        "top_k                7        (flag)",
        "max_tokens           3        (flag)",
        "min_p                0.0      (default)",
        "seed                 0        (default)",
    ]:
        assert row in table
    term.send('"""\n')
    term.expect("... ")
    term.send("two\n")
    term.expect("... ")
    term.send('lines"""\n')
    term.expect("[stopped at max_tokens=3;")
    term.expect(">>> ")
    term.send("/nope\n")
    term.expect("unknown command '/nope': /help lists the commands")
    term.expect(">>> ")
    term.send("\x04")  # Ctrl-D
    assert term.wait() == 0
    assert term.buffer == "\r\n"  # the newline after the prompt (the pty adds the \r)


def test_install_hints_name_the_clones_extras() -> None:
    """mlxserve is installed from its git clone, not from PyPI: a hint that says
    `pip install mlxserve[extra]` fails for every user; `pip install -e '.[extra]'` works."""
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml", "*.sh", "*.txt"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.split()
    pypi_extra = re.compile(r"\bmlxserve\[[\w,-]+\]")
    found = [
        f"{name}:{number}: {line.strip()}"
        for name in files
        if (ROOT / name).is_file() and name != "tests/test_cli.py"
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if pypi_extra.search(line)
    ]
    assert found == []
