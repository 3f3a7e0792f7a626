"""Cubin integrity without a GPU: the manifest's source fingerprint and each cubin's sha256.

A fake cubin set (any bytes, sealed like oproj_jax.cute.build seals a real one) stands in for
the kernels; the real manifest, where one is built in this checkout, is checked as well. What
only a GPU shows: that an intact cubin of a current manifest also loads and runs (test_cute_gpu).
"""

from __future__ import annotations

import json

import pytest

from conftest import fake_ready_cubins
from oproj_jax import configs
from oproj_jax.contract import Dims
from oproj_jax import ffi
from oproj_jax.cute import backend, cache
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


# A package tree standing in for oproj_jax: the device code imports helpers (absolutely, relatively,
# inside a function, through another helper); the build driver has compile definitions and a shape
# table from a module only it imports; one module nothing of the device code imports.
FAKE_TREE = {
    "oproj_jax/__init__.py": "from oproj_jax.api import consumer\n",
    "oproj_jax/api.py": "def consumer(): ...\n",
    "oproj_jax/ptx.py": "WAIT = 'mbarrier.try_wait'\n",
    "oproj_jax/configs.py": "HIDDEN = 7168\nBENCH = [1, 8, 64]\n",
    "oproj_jax/unrelated.py": "X = 1\n",
    "oproj_jax/cute/__init__.py": "",
    "oproj_jax/cute/kernel.py": (
        "from oproj_jax.cute import primitives as P\n"
        "def launch():\n    from . import row_stats\n    return row_stats, P\n"
    ),
    "oproj_jax/cute/publish.py": "from oproj_jax.cute.primitives import put\n",
    "oproj_jax/cute/primitives.py": "from .. import ptx\ndef put(): return ptx.WAIT\n",
    "oproj_jax/cute/row_stats.py": "import oproj_jax.cute.primitives\n",
    "oproj_jax/cute/build.py": (
        "ARCH = 'sm_90a'\n"
        "FAMILY_R = (1, 2, 4)\n"
        "def default_set():\n    from oproj_jax import configs\n    return configs.BENCH\n"
        "def consumer_kernel(key):\n    from oproj_jax.cute.kernel import launch\n    return launch\n"
        "def compile_variant(key):\n    return consumer_kernel(key), '--gpu-arch ' + ARCH\n"
        "def compile_publish():\n    from oproj_jax.cute import publish\n    return publish\n"
    ),
}


def fake_tree(root):
    for name, text in FAKE_TREE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def edit(path, line="# edited"):
    path.write_text(path.read_text() + line + "\n")


def test_fingerprint_covers_imports(tmp_path, monkeypatch, cubins):
    """Every module of the device code's import closure is fingerprinted, however it is imported,
    and the compile definitions of build.py; build.py's shape table and what only it imports are
    not. A manifest built before a helper changed is refused, naming the rebuild command."""
    root = fake_tree(tmp_path / "tree")
    assert M.fingerprint_sources(root) == [
        "oproj_jax/cute/kernel.py",
        "oproj_jax/cute/primitives.py",
        "oproj_jax/cute/publish.py",
        "oproj_jax/cute/row_stats.py",
        "oproj_jax/ptx.py",
        "oproj_jax/cute/build.py:ARCH",
        "oproj_jax/cute/build.py:consumer_kernel",
        "oproj_jax/cute/build.py:compile_variant",
        "oproj_jax/cute/build.py:compile_publish",
    ]
    before = M.source_fingerprint("4.8.1", root)
    assert M.source_fingerprint("4.8.2", root) != before
    for name in ("oproj_jax/ptx.py", "oproj_jax/cute/row_stats.py", "oproj_jax/cute/primitives.py"):
        copy = fake_tree(tmp_path / name.replace("/", "_"))
        edit(copy / name)
        assert M.source_fingerprint("4.8.1", copy) != before, name
    copy = fake_tree(tmp_path / "compile")
    build = copy / "oproj_jax/cute/build.py"
    build.write_text(build.read_text().replace("'--gpu-arch '", "'--gpu-arch  '"))
    assert M.source_fingerprint("4.8.1", copy) != before
    copy = fake_tree(tmp_path / "driver")  # the build driver's own helpers: the cubins stay valid
    build = copy / "oproj_jax/cute/build.py"
    build.write_text(build.read_text().replace("FAMILY_R = (1, 2, 4)", "FAMILY_R = (1, 2, 4, 8)"))
    for name in ("oproj_jax/configs.py", "oproj_jax/unrelated.py", "oproj_jax/__init__.py", "oproj_jax/api.py"):
        edit(copy / name)
    assert M.source_fingerprint("4.8.1", copy) == before

    # the installed sources are the fake tree: the manifest sealed from it is current until its
    # imported helper changes, then it is refused by name
    monkeypatch.setattr(M, "PACKAGE_ROOT", root)
    M._installed_fingerprint.cache_clear()
    try:
        fake_ready_cubins(cubins, KEY)
        assert M.stale_reason(M.load_manifest(cubins)) is None
        assert backend.unavailable_reason("cuda") is None
        edit(root / "oproj_jax/ptx.py")
        M._installed_fingerprint.cache_clear()
        reason = M.stale_reason(M.load_manifest(cubins))
        assert reason is not None and "stale" in reason and "oproj_jax/ptx.py" in reason
        assert M.REBUILD_COMMAND in reason and str(cubins) in reason
        assert backend.unavailable_reason("cuda").startswith(reason)
        with pytest.raises(ValueError, match="rebuild") as err:
            backend._kernel(KEY, 1, ready=True)
        assert M.REBUILD_COMMAND in str(err.value)
    finally:
        M._installed_fingerprint.cache_clear()


def test_the_installed_fingerprint_covers_the_device_codes_imports():
    sources = M.fingerprint_sources()
    for name in ("kernel.py", "publish.py", "primitives.py", "row_stats.py"):
        assert f"oproj_jax/cute/{name}" in sources
    assert "oproj_jax/dsmem_ptx.py" in sources  # imported by primitives.py
    assert not [name for name in sources if "missing" in name], sources
    assert [f"oproj_jax/cute/build.py:{name}" for name in M.COMPILE_DEFINITIONS] == sources[-4:]
    assert "oproj_jax/configs.py" not in sources  # the shape table only the build driver reads
    assert M.source_fingerprint("4.8.1") == M.source_fingerprint("4.8.1", M.PACKAGE_ROOT)
    assert M.source_fingerprint("4.8.2") != M.source_fingerprint("4.8.1")


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
    assert "python -m oproj_jax.cute.build --key 2,1,1,2,0,0`" in message


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
        kernels=[dict(key=M.make_key(16, 0, True, 1, 0, False), min_ctas=0, fold=True, cubin="old.cubin")],
    )
    (tmp_path / "old.cubin").write_bytes(b"old")
    (tmp_path / M.MANIFEST).write_text(json.dumps(old))
    monkeypatch.setattr(build, "_compile_to", lambda args: dict(key=args[0], min_ctas=0, fold=True, cubin="new.cubin"))
    monkeypatch.setattr(build, "compile_publish", lambda arch: dict(cubin=M.PUBLISH_CUBIN, cubin_bytes=b"publish"))
    (tmp_path / "new.cubin").write_bytes(b"new")
    manifest = build.build_cubins(tmp_path, [KEY], jobs=1)
    assert [e["cubin"] for e in manifest["kernels"]] == ["new.cubin"]
    assert manifest["fingerprint"] == M.source_fingerprint(build.dsl_version())
    assert manifest["publish"]["sha256"] == M.file_sha256(tmp_path / M.PUBLISH_CUBIN)


def test_the_build_keeps_only_folded_entries_of_these_sources(tmp_path, monkeypatch):
    """Adding a key to a built set keeps that manifest's other folded entries, and drops those of
    another build (nothing launches them) with their cubins."""
    pytest.importorskip("cutlass")
    from oproj_jax.cute import build

    other = M.make_key(16, 0, True, 1, 0, False)
    old = dict(
        arch=build.ARCH,
        H=configs.HIDDEN,
        fingerprint=M.source_fingerprint(build.dsl_version()),
        kernels=[
            dict(key=other, min_ctas=0, fold=True, cubin="oproj_R16_f.cubin"),
            dict(key=other, min_ctas=3, fold=False, cubin="oproj_R16_m3.cubin"),
        ],
    )
    for name in ("oproj_R16_f.cubin", "oproj_R16_m3.cubin", "new.cubin"):
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / M.MANIFEST).write_text(json.dumps(old))
    monkeypatch.setattr(build, "_compile_to", lambda args: dict(key=args[0], min_ctas=0, fold=True, cubin="new.cubin"))
    monkeypatch.setattr(build, "compile_publish", lambda arch: dict(cubin=M.PUBLISH_CUBIN, cubin_bytes=b"publish"))
    manifest = build.build_cubins(tmp_path, [KEY], jobs=1)
    assert [e["cubin"] for e in manifest["kernels"]] == ["oproj_R16_f.cubin", "new.cubin"]
    assert not (tmp_path / "oproj_R16_m3.cubin").exists()


@pytest.mark.parametrize("arch", list(M.ARCHS))
def test_the_real_manifest_matches_the_sources_and_its_cubins(arch):
    """The cubins built in this checkout (python -m oproj_jax.build), if any, of each arch."""
    try:
        manifest = M.load_manifest(M.PACKAGE_DIR, arch)
    except FileNotFoundError as err:
        pytest.skip(f"no {arch} cubins built in this checkout ({err})")
    if "fingerprint" not in manifest:
        pytest.skip(f"{M.PACKAGE_DIR} predates source fingerprints: rebuild with `{M.REBUILD_COMMAND}`")
    assert M.stale_reason(manifest) is None and manifest["arch"] == arch
    assert manifest["dir"] == str(M.arch_dir(arch, M.PACKAGE_DIR))
    entries = manifest["kernels"] + ([manifest["publish"]] if manifest.get("publish") else [])
    for entry in entries:
        assert M.verified_cubin_path(manifest, entry).is_file()
    assert ffi.BUILD_COMMAND.startswith(M.REBUILD_COMMAND)
