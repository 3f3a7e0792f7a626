"""Cubin integrity without a GPU: the manifest's source fingerprint and each cubin's sha256.

A fake cubin set (any bytes, sealed like oproj_jax.cute.build seals a real one) stands in for
the kernels; the real manifest, where one is built in this checkout, is checked as well. What
only a GPU shows: that an intact cubin of a current manifest also loads and runs (test_cute_gpu).
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import fake_ready_cubins
from oproj_jax import configs
from oproj_jax.api import Dims
from oproj_jax.cute import backend, cache, ffi
from oproj_jax.cute import manifest as M

KEY = M.make_key(2, 1, True, 2, 0, False)


@pytest.fixture
def cubins(tmp_path, monkeypatch):
    """A sealed fake manifest of one key (folded build: the registry's ready mode) in tmp_path,
    with the cute backend pointed at it and a file standing in for the FFI library."""
    fake_ready_cubins(tmp_path, KEY)
    library = tmp_path / "lib.so"
    library.write_bytes(b"")
    monkeypatch.setenv(M.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(library))
    monkeypatch.setenv(cache.ENV_NO_COMPILE, "1")  # prebuilt cubins only
    monkeypatch.setattr(backend, "_is_cuda", lambda platform: True)
    return tmp_path


def rewrite_manifest(directory, change):
    manifest = json.loads((directory / M.MANIFEST).read_text())
    change(manifest)
    (directory / M.MANIFEST).write_text(json.dumps(manifest))


def test_seal_records_the_fingerprint_and_every_sha256(cubins):
    manifest = M.load_manifest(cubins)
    assert manifest["fingerprint"] == M.source_fingerprint("4.8.1")
    assert manifest["kernels"][0]["sha256"] == M.file_sha256(cubins / "k.cubin")
    assert M.stale_reason(manifest) is None
    assert backend.unavailable_reason("cuda") is None


def test_fingerprint_covers_every_kernel_source_and_the_dsl_version(tmp_path):
    here = M.source_fingerprint("4.8.1")
    assert M.source_fingerprint("4.8.2") != here
    for name in M.FINGERPRINT_SOURCES:
        copy = tmp_path / name.replace(".py", "")
        shutil.copytree(M.SOURCE_DIR, copy, ignore=shutil.ignore_patterns("cubins", "csrc", "__pycache__"))
        assert M.source_fingerprint("4.8.1", str(copy)) == here
        (copy / name).write_bytes((copy / name).read_bytes() + b"\n# edited\n")
        assert M.source_fingerprint("4.8.1", str(copy)) != here, name


def test_an_intact_cubin_is_hashed_once_per_process(cubins, monkeypatch):
    calls = []
    real = M.file_sha256
    monkeypatch.setattr(M, "file_sha256", lambda path: calls.append(path) or real(path))
    first = backend._kernel(KEY, 1, ready=True)
    second = backend._kernel(KEY, 3, ready=True)
    assert first == second and first.cubin == str(cubins / "k.cubin")
    assert len(calls) <= 1  # 0 when an earlier test of this process verified the same file


def test_a_changed_cubin_is_refused_naming_the_file_and_the_rebuild(cubins):
    backend._kernel(KEY, 1, ready=True)  # intact: verified
    (cubins / "k.cubin").write_bytes(b"\x7fELF another kernel!")  # size and bytes change
    with pytest.raises(ValueError, match="sha256") as err:
        backend._kernel(KEY, 1, ready=True)
    message = str(err.value)
    assert str(cubins / "k.cubin") in message
    assert "python -m oproj_jax.cute.build --key 2,1,1,2,0,0 --builds f0" in message


def test_a_cubin_without_a_recorded_sha256_is_refused(cubins):
    rewrite_manifest(cubins, lambda m: m["kernels"][0].pop("sha256"))
    with pytest.raises(ValueError, match="records no sha256"):
        backend._kernel(KEY, 1, ready=True)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.update(fingerprint="0" * 64), id="other-sources"),
        pytest.param(lambda m: m.update(cutlass_dsl="9.9.9"), id="other-dsl-version"),
        pytest.param(lambda m: m.pop("fingerprint"), id="no-fingerprint"),
    ],
)
def test_a_stale_manifest_makes_cute_unavailable_naming_the_rebuild(cubins, change):
    rewrite_manifest(cubins, change)
    reason = backend.unavailable_reason("cuda")
    assert reason is not None and M.REBUILD_COMMAND in reason and str(cubins) in reason
    assert "stale" in reason or "no source fingerprint" in reason
    with pytest.raises(ValueError, match="rebuild"):
        backend._kernel(KEY, 1, ready=True)


def test_a_stale_manifest_is_passed_over_where_variants_compile_on_first_use(cubins, monkeypatch):
    """With the CuTe DSL installed a stale prebuilt set does not make cute unavailable: every
    variant is compiled from the installed sources on first use (into its own fingerprint's
    cache directory), never taken from the stale set."""
    if not cache._dsl_installed():
        pytest.skip("the CuTe DSL (the cute extra) is not installed: nothing compiles on first use")
    rewrite_manifest(cubins, lambda m: m.update(fingerprint="0" * 64))
    monkeypatch.delenv(cache.ENV_NO_COMPILE)
    assert backend.unavailable_reason("cuda") is None
    monkeypatch.setattr(cache, "_compile", lambda *a: pytest.fail("asking for support compiled a cubin"))
    dims = Dims(KEY["R"], 1, KEY["NB"], configs.HIDDEN)
    assert backend.unsupported_reason(dims, has_delta=True, groups=2, xmoe_replicas=0) is None


def test_the_build_drops_entries_of_other_sources(tmp_path, monkeypatch):
    """build_cubins keeps an old manifest's entries only if that manifest has this fingerprint."""
    pytest.importorskip("cutlass")
    from oproj_jax.cute import build

    old = dict(
        arch=build.ARCH,
        H=configs.HIDDEN,
        fingerprint="0" * 64,
        kernels=[dict(key=M.make_key(16, 0, True, 1, 0, False), cubin="old.cubin")],
    )
    (tmp_path / "old.cubin").write_bytes(b"old")
    (tmp_path / M.MANIFEST).write_text(json.dumps(old))
    monkeypatch.setattr(
        build,
        "_compile_to",
        lambda args: dict(key=args[0], min_ctas=args[1].min_ctas, fold=args[1].fold, cubin="new.cubin"),
    )
    monkeypatch.setattr(build, "compile_publish", lambda: dict(cubin=M.PUBLISH_CUBIN, cubin_bytes=b"publish"))
    (tmp_path / "new.cubin").write_bytes(b"new")
    manifest = build.build_cubins(tmp_path, [KEY], jobs=1, builds=[M.FOLDED])
    assert [e["cubin"] for e in manifest["kernels"]] == ["new.cubin"]
    assert manifest["fingerprint"] == M.source_fingerprint(build.dsl_version())
    assert manifest["publish"]["sha256"] == M.file_sha256(tmp_path / M.PUBLISH_CUBIN)


def test_the_real_manifest_matches_the_sources_and_its_cubins():
    """The cubins built in this checkout (python -m oproj_jax.build), if any."""
    try:
        manifest = M.load_manifest(M.PACKAGE_DIR)
    except FileNotFoundError as err:
        pytest.skip(f"no cubins built in this checkout ({err})")
    if "fingerprint" not in manifest:
        pytest.skip(f"{M.PACKAGE_DIR} predates source fingerprints: rebuild with `{M.REBUILD_COMMAND}`")
    assert M.stale_reason(manifest) is None
    entries = manifest["kernels"] + ([manifest["publish"]] if manifest.get("publish") else [])
    for entry in entries:
        assert M.verified_cubin_path(manifest, entry).is_file()
    assert ffi.BUILD_COMMAND.startswith(M.REBUILD_COMMAND)
