"""Compile on first use: the cubins a call needs that the prebuilt manifest lacks.

When backend._kernel finds no prebuilt cubin for a key (or the prebuilt manifest is missing or
stale) and the CuTe DSL is installed, it compiles the variant here (build.compile_variant, the
folded build as every path launches it, about a second) into a persistent cache, and every
later call and process reuses it:

    $OPROJ_JAX_CACHE_DIR, else platformdirs.user_cache_dir("oproj_jax")/cubins (on Linux
    $XDG_CACHE_HOME/oproj_jax/cubins, else ~/.cache/oproj_jax/cubins)
      <source fingerprint>/            manifest.source_fingerprint(the installed DSL version)
        <cubin_name>.cubin             the cubin (build.cubin_name), for sm_90a
        <cubin_name>.json              its manifest entry with "sha256", written last
        <cubin_name>.lock              held (filelock.FileLock) by the process that compiles it
        sm_100a/                       the same for sm_100a (manifest.arch_dir, as the prebuilt set)

The fingerprint directory holds only cubins of the installed kernel sources and DSL version:
a change of either starts a new directory, so a stale cubin is never launched (old
directories stay until deleted; deleting any of it is safe, it is compiled again).

Processes: the first to need a variant takes its lock file and compiles; the cubin and then
the entry are written under temporary names and renamed into place (os.replace), so a reader
sees a complete entry or none. A process that waited on the lock finds the entry and does not
compile; one that waited LOCK_TIMEOUT_S raises a TimeoutError naming the lock file and what to
do (disk_cache.locked). Readers that find the entry need no lock. Each cubin is hashed against
its entry's sha256 once per process (manifest.verified_cubin_path), like the prebuilt ones.

$OPROJ_JAX_NO_COMPILE=1: prebuilt cubins only (a deployment that must not compile while it
serves); a variant that is not prebuilt is then an error naming the command that builds it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import threading
from pathlib import Path

from oproj_jax import disk_cache
from oproj_jax.cute import build as cute_build
from oproj_jax.cute import manifest as M

ENV_CACHE_DIR = disk_cache.ENV_CACHE_DIR  # "OPROJ_JAX_CACHE_DIR"
ENV_NO_COMPILE = "OPROJ_JAX_NO_COMPILE"
COMPILE_EXTRA = "pip install 'oproj-jax[cute]'"
# How long a process waits for another that compiles the same variant (about a second, plus the
# DSL's first import: seconds) before it gives up with a TimeoutError naming the lock file.
LOCK_TIMEOUT_S = 300.0

log = logging.getLogger(__name__)
# One compile at a time in a process: the DSL's compiler state is not documented thread-safe,
# and the lock files only order processes (and threads) that compile the same variant.
_compile_lock = threading.Lock()


def cache_root() -> Path:
    """$OPROJ_JAX_CACHE_DIR if set (and non-empty), else platformdirs.user_cache_dir("oproj_jax")/cubins:
    $XDG_CACHE_HOME/oproj_jax/cubins, else ~/.cache/oproj_jax/cubins on Linux."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    return disk_cache.user_cache_root() / "cubins"


def directory(arch: str = M.PRIMARY_ARCH) -> Path:
    """This installation's cache directory for `arch`: the root's subdirectory of the source
    fingerprint (for sm_100a its subdirectory sm_100a/, manifest.arch_dir)."""
    return M.arch_dir(arch, cache_root() / M.source_fingerprint(cute_build.dsl_version()))


@functools.cache
def _dsl_installed() -> bool:
    return importlib.util.find_spec("cutlass") is not None  # finds, does not import (seconds)


def disabled_reason() -> str | None:
    """Why this process cannot compile a variant on first use (nor read the cache), or None."""
    if os.environ.get(ENV_NO_COMPILE, "") not in ("", "0"):
        return f"compile-on-first-use is off: ${ENV_NO_COMPILE} is set (prebuilt cubins only)"
    if not _dsl_installed():
        return (
            f"the CuTe DSL is not installed here; installing the `cute` extra ({COMPILE_EXTRA}) "
            f"enables compile-on-first-use"
        )
    return None


def _files(key: dict, arch: str = M.PRIMARY_ARCH) -> tuple[Path, str, Path]:
    """(the cache directory of `arch`, the cubin's file name, its entry's path)."""
    name = cute_build.cubin_name(key)
    where = directory(arch)
    return where, name, where / (name.removesuffix(".cubin") + ".json")


def cached(key: dict, arch: str = M.PRIMARY_ARCH) -> bool:
    """Whether some process has compiled `key` for `arch` into the cache (not verified here)."""
    return _files(key, arch)[2].is_file()


def kernel_rejects(key: dict) -> str | None:
    """The kernel's own verdict on a variant (OprojConsumer's constructor: the ranges of R, NB,
    groups, xmoe_replicas, H/R for twoshot), or None if it can be compiled. Imports the DSL
    (once per process), compiles nothing."""
    return _kernel_rejects(tuple(M.normalize_key(key).items()))


@functools.lru_cache(maxsize=256)
def _kernel_rejects(items: tuple) -> str | None:
    try:
        import oproj_jax.cute.kernel  # noqa: F401
    except Exception as err:  # the DSL raises more than ImportError when its libraries are absent
        return f"the CuTe DSL does not import ({type(err).__name__}: {err}), so nothing is compiled on first use"
    try:
        cute_build.consumer_kernel(dict(items), M.FOLDED)
    except ValueError as err:
        return f"the CuTe kernel is not built for it: {err}"
    return None


def _read_entry(path: Path, name: str) -> dict | None:
    """The entry at `path` if it is complete (it is renamed into place whole), else None."""
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable or edited: compiled again under the lock
        return None
    if not isinstance(entry, dict) or entry.get("cubin") != name or not isinstance(entry.get("sha256"), str):
        return None
    return entry


def _compile(key: dict, where: Path, name: str, entry_path: Path, why: str, arch: str = M.PRIMARY_ARCH) -> dict:
    log.warning(
        "oproj_jax: compiling the CuTe cubin for %s (%s) into %s (%s); takes about a second, once",
        M.describe(key),
        arch,
        where,
        why,
    )
    try:
        with _compile_lock:
            result = cute_build.compile_variant(key, M.FOLDED, arch=arch)
    except Exception as err:
        raise RuntimeError(f"compiling the CuTe cubin for {M.describe(key)} failed: {err}") from err
    cubin = result.pop("cubin_bytes")
    disk_cache.write_atomically(where / name, cubin)
    entry = dict(
        result,
        cubin=name,
        sha256=hashlib.sha256(cubin).hexdigest(),
        arch=arch,
        cutlass_dsl=cute_build.dsl_version(),
        fingerprint=where.name,
    )
    disk_cache.write_atomically(entry_path, json.dumps(entry, indent=1).encode())  # last: the entry commits it
    return entry


def kernel(key: dict, why: str, rebuild: str, arch: str = M.PRIMARY_ARCH) -> tuple[dict, dict, Path]:
    """(a manifest for the cache directory of `arch`, the entry of `key`, its verified
    cubin path); compiles it now if no process has (logging one line that says `why`). A cubin
    whose bytes differ from its entry is refused: ValueError naming it, `rebuild` (the command
    that adds it to the prebuilt set) and the file to delete. The caller has checked
    disabled_reason and kernel_rejects (backend._from_cache)."""
    from oproj_jax.contract import HIDDEN

    key = M.normalize_key(key)
    where, name, entry_path = _files(key, arch)
    entry = _read_entry(entry_path, name)
    if entry is None:
        try:
            where.mkdir(parents=True, exist_ok=True)
            lock = where / (name.removesuffix(".cubin") + ".lock")
            with disk_cache.locked(lock, LOCK_TIMEOUT_S, f"compiling the CuTe cubin {name}"):
                entry = _read_entry(entry_path, name)  # a process this one waited for compiled it
                if entry is None:
                    entry = _compile(key, where, name, entry_path, why, arch)
        except TimeoutError:
            raise  # the lock's holder did not finish in time: the message names the lock file
        except OSError as err:
            raise ValueError(
                f"the cubin cache {where} is not writable ({err}): point ${ENV_CACHE_DIR} at a writable "
                f"directory, or prebuild the variant with `{rebuild}`"
            ) from None
    manifest = dict(dir=str(where), arch=arch, H=HIDDEN)
    path = M.verified_cubin_path(
        manifest, entry, rebuild, otherwise=f", or delete {entry_path} to compile it again on first use"
    )
    return manifest, entry, path
