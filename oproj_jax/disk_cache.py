"""What the on-disk cubin caches share (oproj_jax/cute/cache.py, oproj_jax/triton/library.py):
the user's cache directory (platformdirs), a lock file with a bounded wait (filelock), and an
atomic write.

The user's cache directory is platformdirs.user_cache_dir("oproj_jax"): on Linux
$XDG_CACHE_HOME/oproj_jax, else ~/.cache/oproj_jax. $OPROJ_JAX_CACHE_DIR, where set, takes its
place (each cache says where under it its files go).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import filelock
import platformdirs

APP = "oproj_jax"
ENV_CACHE_DIR = "OPROJ_JAX_CACHE_DIR"


def user_cache_root() -> Path:
    """platformdirs.user_cache_dir("oproj_jax"): $XDG_CACHE_HOME/oproj_jax, else ~/.cache/oproj_jax on Linux."""
    return Path(platformdirs.user_cache_dir(APP, appauthor=False))


@contextlib.contextmanager
def locked(path: Path, timeout_s: float, holder: str):
    """Holds the lock file `path` (filelock.FileLock) for the block. A lock still held by another
    process after `timeout_s` seconds is a TimeoutError naming the file, `holder` (what a process
    holding it is doing) and what to do."""
    lock = filelock.FileLock(path, timeout=timeout_s)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise TimeoutError(
            f"waited {timeout_s:g} s for the lock file {path}: another process holds it ({holder}). If that "
            f"process is still working, wait for it and call again; if none is (a crashed process on a file "
            f"system without working locks can leave a stale lock), delete {path}, or point "
            f"${ENV_CACHE_DIR} at a directory on a local disk"
        ) from None
    try:
        yield
    finally:
        lock.release()


def write_atomically(path: Path, data: bytes) -> None:
    """`data` written to `path` whole or not at all: a reader sees the old file, or the new one."""
    # By hand: a temporary file in the same directory and os.replace is all this needs; the one
    # library for it (atomicwrites) is archived and unmaintained.
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
