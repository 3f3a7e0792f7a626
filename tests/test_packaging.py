"""The package as pip builds it: a platform wheel carrying the FFI library, the C++ sources (the
checkout's top-level ffi/, as oproj_jax/_ffi/) and the cubins (when built), installable,
importable and able to rebuild its library away from the checkout.

The wheel is built from a copy of the checkout (the build writes build/ and *.egg-info next to
setup.py). `pip wheel . --no-deps` uses build isolation: pip installs setuptools, jaxlib==0.11.2
and nvidia-cuda-runtime from the package index into a throwaway environment (network needed;
about 30 s with pip's cache warm). What only a GPU can show: that the library built here
registers its targets with the CUDA plugin and launches the cubins (tests/test_cute_gpu.py).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = "oproj_jax/_lib/liboproj_ffi.so"
CUBIN_DIR = ROOT / "oproj_jax" / "cute" / "cubins"
FFI_DIR = ROOT / "ffi"  # all the C++ of the project
SHIPPED_FFI_DIR = "oproj_jax/_ffi"  # where the wheel carries it


def checkout_copy(dest: pathlib.Path) -> pathlib.Path:
    ignore = shutil.ignore_patterns(
        ".venv*", ".git", "build", "*.egg-info", "__pycache__", "_lib", ".dev", ".whl", ".pytest_cache"
    )  # .venv*: the development venvs (.venv, and .ci/run's .venv-newest)
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def project_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["version"]


def index_unreachable() -> str | None:
    """Why pip's build isolation cannot fetch the build requirements here, or None."""
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as err:
        return (
            f"no package index reachable (pypi.org: {err}); pip wheel's build isolation downloads setuptools and jaxlib"
        )
    return None


def build_wheel(src: pathlib.Path, out: pathlib.Path, *extra: str, env=None) -> tuple[pathlib.Path, str]:
    reason = index_unreachable()
    if reason:
        pytest.skip(reason)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(out), *extra],
        cwd=src,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if done.returncode != 0:
        pytest.fail(f"pip wheel failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    (wheel,) = out.glob("*.whl")
    return wheel, done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """`pip wheel . --no-deps`, as a user runs it (build isolation)."""
    tmp = tmp_path_factory.mktemp("wheel")
    path, _ = build_wheel(checkout_copy(tmp / "src"), tmp / "dist")
    return path


@pytest.mark.slow
def test_wheel_is_platform_tagged_and_carries_the_library(wheel):
    python_tag, abi_tag, platform_tag = wheel.stem.split("-")[-3:]
    assert (python_tag, abi_tag) == ("py3", "none"), wheel.name  # no Python extension: any Python 3
    assert platform_tag != "any" and platform_tag.startswith("linux"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    assert LIBRARY in names
    sources = {f"{SHIPPED_FFI_DIR}/{p.name}" for p in FFI_DIR.iterdir() if p.suffix in (".cc", ".h")}
    assert sources and sources <= names, sorted(sources - names)
    shipped = {n for n in names if n.startswith(f"{SHIPPED_FFI_DIR}/")}
    assert shipped == sources, sorted(shipped ^ sources)  # nothing stale, nothing else
    assert not any(n.startswith("ffi/") for n in names)  # the top-level ffi/ is not a package
    assert "oproj_jax/cute/ABI.md" in names
    if (CUBIN_DIR / "manifest.json").is_file():  # built in this checkout: shipped with it, every arch
        cubins = {f"oproj_jax/cute/cubins/{p.relative_to(CUBIN_DIR).as_posix()}" for p in CUBIN_DIR.rglob("*")}
        cubins = {n for n in cubins if (ROOT / n).is_file()}
        assert "oproj_jax/cute/cubins/manifest.json" in names
        assert cubins <= names, sorted(cubins - names)[:5]
    assert not any(n.endswith(".tmp") or "/__pycache__/" in n for n in names)


@pytest.mark.slow
def test_installed_wheel_runs_away_from_the_checkout(wheel, tmp_path):
    """The wheel unpacked on its own (no checkout on sys.path): the library loads and exports
    the bootstrap symbol, the cute backend finds it, the reference backend runs."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    library = target / LIBRARY
    assert ctypes.CDLL(str(library)).OprojRegisterTargets  # AttributeError if not exported
    script = (
        "import jax, jax.numpy as jnp, oproj_jax\n"
        "from oproj_jax import ffi\n"
        f"assert oproj_jax.__file__.startswith({str(target)!r}), oproj_jax.__file__\n"
        "assert ffi.unavailable_reason() is None, ffi.unavailable_reason()\n"
        f"assert oproj_jax.__version__ == {project_version()!r}, oproj_jax.__version__\n"
        "x = jnp.ones((2, 1, 512), jnp.bfloat16); w = jnp.ones((512,), jnp.bfloat16)\n"
        "res = oproj_jax.consumer(x, x[0], jnp.zeros((1, 0, 512), jnp.bfloat16), w, w, w, backend='reference')\n"
        "print(float(res.prefix[0, 0]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPROJ_JAX_")}
    env["PYTHONPATH"] = str(target)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "3.0"  # prefix 1 + two slots of 1


@pytest.mark.slow
def test_installed_wheel_rebuilds_its_library(wheel, tmp_path):
    """`python -m oproj_jax.build --ffi-only` in an installed wheel (no checkout): it compiles the
    sources the wheel carries (oproj_jax/_ffi/) against the jaxlib in use into oproj_jax/_lib/."""
    from oproj_jax import _ffi_build

    reason = _ffi_build.missing()
    if reason:
        pytest.skip(f"this machine cannot build the library: {reason}")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    (target / LIBRARY).unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPROJ_JAX_")}
    env["PYTHONPATH"] = str(target)
    build = [sys.executable, "-m", "oproj_jax.build", "--ffi-only"]
    done = subprocess.run(build, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert str(target / LIBRARY) in done.stdout, done.stdout
    script = (
        "import ctypes\n"
        "from oproj_jax import _ffi_build\n"
        "assert _ffi_build.SOURCE_DIR == _ffi_build.PACKAGED_SOURCE_DIR, _ffi_build.SOURCE_DIR\n"
        f"assert ctypes.CDLL({str(target / LIBRARY)!r}).OprojRegisterTargets\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_checkout_builds_from_the_top_level_ffi_sources():
    """In the checkout the library is built from ffi/ (all the C++ of the project); setup.py
    copies the sources into the wheel only, never into the checkout's package."""
    from oproj_jax import _ffi_build

    assert _ffi_build.SOURCE_DIR == FFI_DIR
    assert _ffi_build.sources() == sorted(FFI_DIR.glob("*.cc"))
    assert (FFI_DIR / "common.h") in _ffi_build.shipped_sources()
    assert not (ROOT / SHIPPED_FFI_DIR).exists()


@pytest.mark.slow
def test_without_a_compiler_the_wheel_has_no_library_and_says_so(tmp_path):
    """No compiler: the package still builds (reference and pallas need nothing native), the
    build log says how to get the library later, and the wheel holds no stale copy of it."""
    src = checkout_copy(tmp_path / "src")
    (src / "oproj_jax" / "_lib").mkdir()
    (src / LIBRARY).write_bytes(b"a stale library of the checkout: never shipped")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    wheel, log = build_wheel(src, tmp_path / "dist", "-v", env=env)  # build isolation, as a user builds
    assert LIBRARY not in zipfile.ZipFile(wheel).namelist()
    assert "installing without the FFI library" in log and "python -m oproj_jax.build --ffi-only" in log


def test_missing_library_reason_names_the_build_command(monkeypatch, tmp_path):
    from oproj_jax import ffi

    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(tmp_path / "liboproj_ffi.so"))
    reason = ffi.unavailable_reason()
    assert "not built" in reason and ffi.BUILD_COMMAND in reason and str(tmp_path) in reason
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert "no C++ compiler" in ffi.unavailable_reason()


def test_version_is_the_distributions():
    import oproj_jax

    assert oproj_jax.__version__ == project_version()


def test_version_of_a_checkout_that_is_not_installed(monkeypatch, tmp_path):
    """Without installed metadata (the checkout on sys.path only) the version is pyproject.toml's;
    without either, a PEP 440 version that says it is unknown."""
    from importlib import metadata

    import oproj_jax

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert oproj_jax._version() == project_version()
    assert oproj_jax._source_version(tmp_path / "pyproject.toml") is None
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert oproj_jax._source_version(tmp_path / "pyproject.toml") is None
