"""A jax.distributed cluster of local processes: how the tests and benchmarks run one process per
device (or per group of CPU devices) on this host.

`run(argv, count, ...)` starts `count` copies of `argv + [process_id, count, port]` with a free
loopback port for the coordinator, waits for all of them at most `timeout_s`, and returns each
process's exit code and combined output; a process still running then is killed and reported
with exit code None. `initialize(process_id, count, port, ...)` is the worker's side;
`client()` and `barrier(name, timeout_s)` what the processes share afterwards.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple


class Finished(NamedTuple):
    code: int | None  # None: killed at the timeout
    log: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list[str], count: int, *, env: dict | None = None, cwd=None, timeout_s: float = 240) -> list[Finished]:
    """Runs `count` processes `[sys.executable, *argv, id, count, port]` at once."""
    port = str(free_port())
    base = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    logs = [tempfile.TemporaryFile("w+") for _ in range(count)]  # files: no pipe can fill and stall
    workers = [
        subprocess.Popen(
            [sys.executable, *argv, str(i), str(count), port], cwd=cwd, env=base, stdout=log, stderr=subprocess.STDOUT
        )
        for i, log in enumerate(logs)
    ]
    deadline = time.monotonic() + timeout_s
    codes = []
    try:
        for w in workers:
            try:
                codes.append(w.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    results = []
    for code, log in zip(codes, logs):
        log.seek(0)
        text = log.read() + ("" if code is not None else f"\n[killed: the processes ran past {timeout_s} s]")
        results.append(Finished(code, text))
        log.close()
    return results


def initialize(process_id: int, count: int, port: int, **kwargs) -> None:
    """jax.distributed.initialize for process `process_id` of `count` on this host."""
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=count,
        process_id=process_id,
        initialization_timeout=kwargs.pop("initialization_timeout", 60),
        **kwargs,
    )


def client():
    """jax.distributed's coordination client (key-value store, barriers), or None before
    jax.distributed.initialize; jax exposes it only under jax._src, so only here."""
    from jax._src import distributed

    return distributed.global_state.client


def barrier(name: str, timeout_s: float) -> None:
    """Waits (at most `timeout_s`) until every process has reached the barrier `name`; with one
    process, returns at once."""
    import jax

    if jax.process_count() > 1:
        client().wait_at_barrier(name, int(timeout_s * 1000))


def report(results: list[Finished]) -> str:
    """Every process's exit code and output, for an assertion message."""
    return "\n".join(f"--- process {i} (exit {r.code}) ---\n{r.log}" for i, r in enumerate(results))
