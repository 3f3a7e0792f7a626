"""Compile on first use (oproj_jax/cute/cache.py), without a GPU: a real variant outside the
prebuilt set compiled into a private cache by the first call that needs it, reused by a fresh
process without compiling, compiled once by two processes racing for it, refused once its
cubin is changed. Skipped with the reason where the CuTe DSL is not importable; about 15 s.
Without the DSL: where the cache is (platformdirs, $XDG_CACHE_HOME, $OPROJ_JAX_CACHE_DIR), and a
lock held by another process past cache.LOCK_TIMEOUT_S is a TimeoutError naming the lock file.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from conftest import dsl_missing_reason
from oproj_jax import configs
from oproj_jax import ffi
from oproj_jax.cute import backend, cache
from oproj_jax.cute import manifest as M

H = configs.HIDDEN
# R = 3 is outside the prebuilt family; groups=4 sums as 3 groups of one slot (S = 1)
OPTIONS = dict(has_delta=True, groups=4, xmoe_replicas=0)
KEY = backend.kernel_key(3, 1, twoshot=False, **OPTIONS)
COMPILING = "compiling the CuTe cubin"  # the one line cache.py logs per compile


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The FFI library lowering registers: the checkout's if it exports today's handlers, else
    one built into a temporary directory (~20 s)."""
    path = ffi.library_path()
    try:
        lib = ctypes.CDLL(str(path))
        for stages in ffi.SYMBOLS.values():
            for symbol in (stages.initialize, stages.execute):
                if symbol:
                    getattr(lib, symbol)
        return path
    except (OSError, AttributeError):
        return ffi.build_library(tmp_path_factory.mktemp("lib"))


def _env(cache_dir, prebuilt_dir) -> dict:
    """A process environment with its own cache and an empty prebuilt directory (no manifest)."""
    env = {k: v for k, v in os.environ.items() if k != cache.ENV_NO_COMPILE}
    env.update({cache.ENV_CACHE_DIR: str(cache_dir), M.ENV_DIR: str(prebuilt_dir), "JAX_PLATFORMS": "cpu"})
    return env


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def first_use(tmp_path_factory, library):
    """The registry call at R = 3 lowered for CUDA with nothing prebuilt: it compiles the
    variant into a fresh cache. Returns (the environment, the HLO text, the kernel, the log)."""
    reason = dsl_missing_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("first_use")
    (root / "prebuilt").mkdir()
    env = _env(root / "cache", root / "prebuilt")
    log = _Lines()
    with pytest.MonkeyPatch.context() as patch:
        for name in (cache.ENV_CACHE_DIR, M.ENV_DIR):
            patch.setenv(name, env[name])
        patch.delenv(cache.ENV_NO_COMPILE, raising=False)
        patch.setenv("OPROJ_JAX_FFI_LIBRARY", str(library))
        cache.log.addHandler(log)
        try:
            fn = functools.partial(backend.consumer, eps=1e-6, out_eps=1e-6, **OPTIONS)
            specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((3, 2, H), (2, H), (2, 1, H), (H,), (H,), (H,))]
            text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
            kernel = backend._kernel(KEY, 2, True)
        finally:
            cache.log.removeHandler(log)
        yield env, text, kernel, log.lines


def _entry_file(cubin: str):
    return cubin.removesuffix(".cubin") + ".json"


def test_the_first_call_compiles_into_the_cache_and_launches_it(first_use):
    env, text, kernel, lines = first_use
    assert len([line for line in lines if COMPILING in line]) == 1, lines
    fingerprint = M.source_fingerprint(cache.cute_build.dsl_version())
    assert os.path.dirname(kernel.cubin) == os.path.join(env[cache.ENV_CACHE_DIR], fingerprint)
    entry = json.loads(open(_entry_file(kernel.cubin)).read())
    assert entry["sha256"] == M.file_sha256(kernel.cubin) and entry["key"] == KEY and entry["fold"]
    assert entry["block"] == [128, 1, 1] and entry["entry"] == kernel.entry
    (call,) = [line for line in text.splitlines() if f"stablehlo.custom_call @{ffi.LAUNCH_TARGET}(" in line]
    assert f'cubin = "{kernel.cubin}"' in call and f'entry = "{kernel.entry}"' in call


def test_an_equivalent_groups_takes_the_same_cubin(first_use, monkeypatch):
    env, _, kernel, _ = first_use
    for name in (cache.ENV_CACHE_DIR, M.ENV_DIR):
        monkeypatch.setenv(name, env[name])
    monkeypatch.delenv(cache.ENV_NO_COMPILE, raising=False)
    monkeypatch.setattr(cache, "_compile", lambda *a: pytest.fail("a cached variant was compiled again"))
    same = backend.kernel_key(3, 1, has_delta=True, groups=3, xmoe_replicas=0, twoshot=False)  # S = 1 as well
    assert same == KEY and backend._kernel(same, 7, True) == kernel


_LOOKUP = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from oproj_jax.cute import backend
    key = json.loads(sys.argv[1])
    if len(sys.argv) > 2:  # a start line: every racer asks for the kernel at the same moment
        barrier = Path(sys.argv[2])
        (barrier / sys.argv[3]).touch()
        while len(list(barrier.iterdir())) < int(sys.argv[4]):
            time.sleep(0.01)
    kernel = backend._kernel(key, 1, True)
    print(json.dumps({"cubin": kernel.cubin, "dsl_imported": "cutlass" in sys.modules}))
""")


def _lookup(env, *barrier) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _LOOKUP, json.dumps(KEY), *map(str, barrier)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process) -> tuple[dict, str]:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def test_a_fresh_process_reuses_the_cached_cubin(first_use):
    env, _, kernel, _ = first_use
    before = os.stat(kernel.cubin)
    result, err = _finish(_lookup(env))
    after = os.stat(kernel.cubin)
    assert result["cubin"] == kernel.cubin
    assert COMPILING not in err, err[-2000:]
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    assert not result["dsl_imported"]  # a cached variant needs no DSL import


def test_two_processes_racing_for_a_variant_compile_it_once(tmp_path):
    reason = dsl_missing_reason()
    if reason:
        pytest.skip(reason)
    (tmp_path / "prebuilt").mkdir()
    (tmp_path / "barrier").mkdir()
    env = _env(tmp_path / "cache", tmp_path / "prebuilt")
    racers = [_lookup(env, tmp_path / "barrier", i, 2) for i in range(2)]
    results = [_finish(p) for p in racers]
    assert sum(err.count(COMPILING) for _, err in results) == 1, [err[-1500:] for _, err in results]
    (cubin,) = {r["cubin"] for r, _ in results}
    entry = json.loads(open(_entry_file(cubin)).read())
    assert entry["sha256"] == M.file_sha256(cubin)
    directory = os.path.dirname(cubin)
    assert not [f for f in os.listdir(directory) if f.endswith(".tmp")]  # no partial file left


def test_a_changed_cached_cubin_is_refused(first_use, tmp_path, monkeypatch):
    env, _, kernel, _ = first_use
    copy = tmp_path / "cache"
    shutil.copytree(env[cache.ENV_CACHE_DIR], copy)
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(copy))
    monkeypatch.setenv(M.ENV_DIR, env[M.ENV_DIR])
    monkeypatch.delenv(cache.ENV_NO_COMPILE, raising=False)
    monkeypatch.setattr(cache, "_compile", lambda *a: pytest.fail("a changed cubin was compiled over"))
    cubin = copy / os.path.relpath(kernel.cubin, env[cache.ENV_CACHE_DIR])
    cubin.write_bytes(cubin.read_bytes()[:-1] + b"!")
    with pytest.raises(ValueError, match="sha256") as err:
        backend._kernel(KEY, 1, True)
    message = str(err.value)
    assert str(cubin) in message and "python -m oproj_jax.cute.build --key 3,1,1,3,0,0`" in message
    assert f"or delete {_entry_file(str(cubin))} to compile it again on first use" in message
    dims = backend.Dims(3, 1, 1, H)
    assert "sha256" in backend.unsupported_reason(dims, **OPTIONS)  # not offered as supported either


# ---- where the cache is, and its lock (no DSL needed) -----------------------------------------


def test_cache_root_follows_platformdirs_unless_overridden(monkeypatch, tmp_path):
    """$OPROJ_JAX_CACHE_DIR is the root itself; unset or empty, platformdirs' user cache
    directory: $XDG_CACHE_HOME/oproj_jax/cubins, else ~/.cache/oproj_jax/cubins (Linux)."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    assert cache.directory().parent == tmp_path / "mine"
    monkeypatch.setenv(cache.ENV_CACHE_DIR, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "oproj_jax" / "cubins"
    monkeypatch.delenv(cache.ENV_CACHE_DIR)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if sys.platform == "linux":
        assert cache.cache_root() == tmp_path / "home" / ".cache" / "oproj_jax" / "cubins"


_HOLD = "import sys, filelock; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); sys.stdin.read()"


@contextmanager
def _held_by_another_process(path: Path):
    """The lock file `path` held (filelock) by a child process until the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.stdin.close()  # the child's read returns: it exits, and the lock is released
        holder.wait(timeout=30)


def test_a_lock_held_past_the_timeout_is_a_clear_error(monkeypatch, tmp_path):
    """Another process holds the variant's lock (compiling it, or hung): this one waits
    cache.LOCK_TIMEOUT_S (here 0.2 s), then raises a TimeoutError naming the lock file, what its
    holder does and what to do; it compiles nothing and writes no entry. Once the lock is free
    the same call takes it and compiles."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(cache.ENV_NO_COMPILE, raising=False)
    monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 0.2)
    where, name, entry_path = cache._files(KEY)
    lock = where / (name.removesuffix(".cubin") + ".lock")
    where.mkdir(parents=True)
    compiled = []

    def fake_compile(key, where, name, entry_path, why, arch):
        compiled.append(name)
        raise RuntimeError("stop here: the lock was taken")

    monkeypatch.setattr(cache, "_compile", fake_compile)
    with _held_by_another_process(lock):
        start = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            cache.kernel(KEY, "test", "the rebuild command")
        waited = time.monotonic() - start
    message = str(err.value)
    assert str(lock) in message and f"compiling the CuTe cubin {name}" in message, message
    assert "another process holds it" in message and f"delete {lock}" in message, message
    assert 0.2 <= waited < 10, waited
    assert not compiled and not entry_path.exists()
    with pytest.raises(RuntimeError, match="stop here"):  # released: taken at once, and compiling starts
        cache.kernel(KEY, "test", "the rebuild command")
    assert compiled == [name]


class _Blackwell:
    platform = "gpu"
    compute_capability = "10.0"


def test_a_10_0_device_compiles_sm100a_into_its_own_directory(tmp_path, monkeypatch):
    """A compute capability 10.0 device (a stand-in) with nothing prebuilt: the call's variant is
    compiled for sm_100a into the fingerprint directory's sm_100a/, the entry records the arch,
    the ELF header says sm_100; sm_90a's place is left alone."""
    reason = dsl_missing_reason()
    if reason:
        pytest.skip(reason)
    (tmp_path / "prebuilt").mkdir()
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(M.ENV_DIR, str(tmp_path / "prebuilt"))
    monkeypatch.delenv(cache.ENV_NO_COMPILE, raising=False)
    monkeypatch.setattr(backend, "_cuda_devices", lambda: (_Blackwell(),))
    kernel = backend._kernel(KEY, 1, True)
    assert Path(kernel.cubin).parent == cache.directory("sm_100a") == cache.directory() / "sm_100a"
    entry = json.loads(Path(_entry_file(kernel.cubin)).read_text())
    assert entry["arch"] == "sm_100a" and entry["key"] == KEY
    data = Path(kernel.cubin).read_bytes()
    assert data[:4] == b"\x7fELF" and (int.from_bytes(data[0x30:0x34], "little") >> 8) & 0xFF == 100
    assert cache.cached(KEY, "sm_100a") and not cache.cached(KEY)
