"""README.md as a stranger reads it: every ```python block works as pasted on a CPU, each in a
fresh interpreter started in an empty directory, except the blocks whose first line is
`# needs GPUs` (those must at least compile); the page stays short; its development commands
are the ones .ci/run executes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_LINES = 200
NEEDS_GPUS = "# needs GPUs"
TIMEOUT_S = 300  # each block takes ~10 s on 2 CPU cores, most of it compiling


def blocks(language: str) -> list[str]:
    """The fenced code blocks of README.md in `language`, in page order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)


def python_blocks() -> list[str]:
    return blocks("python")


def needs_gpus(source: str) -> bool:
    return source.splitlines()[0].strip() == NEEDS_GPUS


def cpu_blocks() -> list:
    return [
        pytest.param(source, id=f"block{i}-{source.splitlines()[0][:30]}")
        for i, source in enumerate(python_blocks())
        if not needs_gpus(source)
    ]


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES}"


def test_readme_has_cpu_and_gpu_examples():
    sources = python_blocks()
    assert any(not needs_gpus(s) for s in sources), "README.md has no Python block that works on a CPU"
    assert any(needs_gpus(s) for s in sources), f"README.md has no `{NEEDS_GPUS}` block (the peer-mode example)"


@pytest.mark.parametrize("source", cpu_blocks())
def test_block_works_on_a_cpu(source, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    script = tmp_path / "block.py"
    script.write_text(source)
    try:
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the README block did not finish within {TIMEOUT_S} s:\n{source}")
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{source}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )


def test_gpu_blocks_compile():
    for i, source in enumerate(python_blocks()):
        if needs_gpus(source):
            compile(source, f"README.md python block {i}", "exec")  # SyntaxError if it does not


def test_development_commands_are_the_ones_ci_runs():
    """The README's set-up and test commands (its ```bash block) are what .ci/run executes."""
    (commands,) = [b for b in blocks("bash") if "scripts/install.sh" in b]
    commands = [line.split("#")[0].strip() for line in commands.splitlines() if line.split("#")[0].strip()]
    assert commands == ["bash scripts/install.sh", ".venv/bin/python -m pytest -q"], commands
    ci = [line.split("#")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert any(line == command or line.endswith(" " + command) for line in ci), f".ci/run does not run {command!r}"
