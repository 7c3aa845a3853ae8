"""The README's examples and docs/serving.md's "Other APIs" section run verbatim against
`mlxserve serve` (the embedded SmolLM2).

Each Python block is run as written (only the port differs: 8000, and Ollama's 11434); a
`print(...)  # text` line says what it prints, and the output must be exactly that.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.paths import ROOT
from tests.server_harness import start_server

KEY = "sk-readme-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    s = start_server(["--max-model-len", "512"], log, env={"MLXSERVE_API_KEY": KEY})
    yield s
    s.stop()


def section_blocks(
    language: str, page: str = "docs/serving.md", heading: str = "## Other APIs"
) -> list[str]:
    text = (ROOT / page).read_text()
    section = text[text.index(heading) :]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def expected_output(block: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^print\(.*\)  # (.*)$", block, flags=re.M)]


@pytest.mark.parametrize(
    ("page", "heading"),
    [("docs/serving.md", "## Other APIs"), ("README.md", "## One example per interface")],
)
def test_python_examples_run_verbatim(server, page: str, heading: str) -> None:
    blocks = section_blocks("python", page, heading)
    assert blocks
    env = dict(os.environ, MLXSERVE_API_KEY=KEY)
    for block in blocks:
        code = block.replace("localhost:8000", f"localhost:{server.port}")
        code = code.replace("localhost:11434", f"localhost:{server.port}")  # Ollama's port
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, (block, out.stderr)
        want = expected_output(block)
        assert want, f"say what this block prints: {block}"
        assert out.stdout.splitlines() == want, block
