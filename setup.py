"""Builds the XLA FFI library (the cute and triton targets) into the package at install time.

Everything else about the package is declared in pyproject.toml. This file adds two commands:

* build_py also compiles ffi/*.cc (the top-level C++ sources) with g++ into
  oproj_jax/_lib/liboproj_ffi.so: into the wheel (`pip install .`, `pip wheel .`) or, for an
  editable install, into the checkout. It builds against the jaxlib headers of the build
  environment (jaxlib is pinned in [build-system] requires) and cuda.h from the
  nvidia-cuda-runtime wheel there, $CUDA_HOME or /usr/local/cuda. A wheel also carries a copy of
  ffi/*.cc and ffi/*.h as oproj_jax/_ffi/ (never written into the checkout), so that an installed
  package can rebuild its library against the user's jaxlib. Without a compiler or headers the
  package installs without the library and backend="cute" says how to build it later
  (`python -m oproj_jax.build --ffi-only`); a compiler error fails the install.
  OPROJ_JAX_NO_FFI=1 skips the library on purpose.
* bdist_wheel tags the wheel for the platform (py3-none-<platform>): it carries a native library.

Why setuptools rather than scikit-build-core + CMake: the library is one g++ command with nothing
to configure, and the install must not fail for want of it: without a compiler or headers the
package installs without the library and warns with the rebuild command, and an editable install
builds it into the checkout, where `python -m oproj_jax.build --ffi-only` also puts it. This hook
does that in a few lines of Python shared with that command (oproj_jax/_ffi_build.py), where a
CMake build would fail the install instead or need the same fallback written a second time.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
LIB_DIR = pathlib.PurePosixPath("oproj_jax", "_lib")
SHIPPED_SOURCE_DIR = pathlib.PurePosixPath("oproj_jax", "_ffi")  # ffi_build.PACKAGED_SOURCE_DIR in the wheel


def _ffi_build():
    """oproj_jax/_ffi_build.py, loaded by path: the package itself (and jax) is not imported."""
    spec = importlib.util.spec_from_file_location("_oproj_ffi_build", HERE / "oproj_jax" / "_ffi_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithFFI(build_py):
    def run(self):
        super().run()
        ffi_build = _ffi_build()
        if not self.editable_mode:  # the wheel's copy of the sources; an editable install uses ffi/
            shipped = pathlib.Path(self.build_lib) / SHIPPED_SOURCE_DIR
            shutil.rmtree(shipped, ignore_errors=True)  # no stale file of an earlier build
            shipped.mkdir(parents=True)
            for source in ffi_build.shipped_sources():
                shutil.copyfile(source, shipped / source.name)
        root = HERE if self.editable_mode else pathlib.Path(self.build_lib)
        target = root / LIB_DIR / ffi_build.LIBRARY_NAME
        if os.environ.get(ffi_build.NO_FFI_ENV, "") not in ("", "0"):
            self.announce(f"oproj_jax: {ffi_build.NO_FFI_ENV} is set: the FFI library is not built", level=3)
            return
        reason = ffi_build.missing()
        if reason:
            self.warn(
                f"oproj_jax: installing without the FFI library of backend='cute' ({reason}); build it later "
                f"with `python -m oproj_jax.build --ffi-only`"
            )
            return
        self.announce(f"oproj_jax: building {target} against {ffi_build.jaxlib_include_dir()}", level=3)
        ffi_build.compile_library(target)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        ffi_build = _ffi_build()
        build_lib = pathlib.Path(self.build_lib)
        shipped = [build_lib / SHIPPED_SOURCE_DIR / source.name for source in ffi_build.shipped_sources()]
        for built in [build_lib / LIB_DIR / ffi_build.LIBRARY_NAME, *shipped]:
            if built.is_file() and str(built) not in outputs:
                outputs.append(str(built))
        return outputs


class NativeDistribution(Distribution):
    def has_ext_modules(self):
        return True  # the package carries a native library: platlib, a platform wheel


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform  # no Python extension module: any Python 3, this platform


setup(distclass=NativeDistribution, cmdclass={"build_py": BuildPyWithFFI, "bdist_wheel": PlatformWheel})
