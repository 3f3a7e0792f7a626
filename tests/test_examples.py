"""The examples (and the README's quickstart) run as a user runs them (a fresh process,
CPU-simulated 16 devices for the examples) and say what they should: exit 0 and the expected
lines."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180  # each example takes ~5-20 s on 2 CPU cores, most of it compiling


def _run(script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    try:
        done = subprocess.run(
            [sys.executable, str(REPO / "examples" / script), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} did not finish within {TIMEOUT_S} s")
    assert done.returncode == 0, f"{script} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_shard_map_tp16():
    out = _run("shard_map_tp16.py")
    assert "mesh: 16 x cpu devices" in out
    assert "each rank holds (1, 4, 7168)" in out
    for mode in ("oneshot", "twoshot"):
        assert f"{mode}: 16 ranks hold identical prefix and output bits" in out, out
    assert "oneshot and twoshot prefixes bit-identical (groups=1): True" in out, out


def test_decode_loop():
    out = _run("decode_loop.py")  # the defaults: H = 7168, 4 layers, 2 calls of 4 steps
    steps = re.findall(r"^step (\d+): output checksum (\S+)  prefix checksum (\S+)$", out, re.MULTILINE)
    assert [int(s) for s, _, _ in steps] == list(range(8)), out
    sums = [float(o) for _, o, _ in steps]
    assert all(math.isfinite(v) for v in sums), out
    assert len(set(sums)) == len(sums), f"the state should change from step to step:\n{out}"
    assert re.search(r"^call 1 \(4 steps\): [\d.]+ ms, [\d.]+ ms/step$", out, re.MULTILINE), out
    assert "done: 8 steps, checksums finite: True" in out, out


def test_readme_quickstart():
    """The README's first ```python block runs as pasted, on a CPU, in a fresh process."""
    readme = (REPO / "README.md").read_text()
    match = re.search(r"^```python\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no ```python block"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    try:
        done = subprocess.run(
            [sys.executable, "-c", match.group(1)], cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the README quickstart did not finish within {TIMEOUT_S} s")
    assert done.returncode == 0, f"the README quickstart exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert "prefix (4, 7168) bfloat16" in out, out
    assert "output (4, 7168) bfloat16" in out, out
    assert "xmoe (2, 4, 7168)" in out, out
    assert "jitted (4, 7168)" in out, out
