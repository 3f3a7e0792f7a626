"""CPU checks of the CuTe AOT build: cubins, entry names, the kernel ABI, the manifest.

Compiles a few variants (about 2-5 s each on 2 cores) into a temporary directory once per
module; skipped with the reason where the CuTe DSL is not importable.
"""

from __future__ import annotations

import json
import struct

import pytest

from conftest import dsl_missing_reason
from oproj_jax.cute import manifest as M

# (R, NB, has_delta, groups, xmoe_replicas, twoshot): production shape, an uneven split
# (R=16 over 3 groups), R < groups, no blocks, xmoe, and a twoshot variant.
KEYS = [
    M.make_key(16, 8, True, 4, 0, False),
    M.make_key(16, 0, False, 3, 1, False),
    M.make_key(2, 1, True, 4, 0, False),
    M.make_key(16, 1, False, 1, 0, True),
]
COMMON_PARAMS = [".u64"] * 10 + [".f32", ".f32", ".u32", ".u32"]  # cute/ABI.md 0..13
ONESHOT_PARAMS = COMMON_PARAMS + [".u64"]  # 14 control
TWOSHOT_PARAMS = COMMON_PARAMS + [".u64", ".u64", ".u32"]  # 14 recv, 15 gather, 16 me


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    reason = dsl_missing_reason()
    if reason:
        pytest.skip(reason)
    from oproj_jax.cute import build

    out = tmp_path_factory.mktemp("cubins")
    build.build_cubins(out, KEYS, jobs=2)  # each key as the folded build
    return out, M.load_manifest(out)


def _section_headers(data: bytes) -> list[tuple]:
    """ELF64 section headers (name, type, flags, addr, offset, size, link, info, align, entsize)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2  # 64-bit ELF
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]


def _c_string(data: bytes, start: int) -> bytes:
    return data[start : data.index(b"\0", start)]


def _elf_symbols(data: bytes) -> set[bytes]:
    """Names in the ELF64 .symtab of a cubin (parsed here, independent of the builder)."""
    sections = _section_headers(data)
    names = set()
    for sh in sections:
        if sh[1] == 2:  # SHT_SYMTAB
            strtab = sections[sh[6]]
            for off in range(sh[4], sh[4] + sh[5], sh[9]):
                names.add(_c_string(data, strtab[4] + struct.unpack_from("<I", data, off)[0]))
    return names


def _elf_sections(data: bytes) -> dict[str, bytes]:
    """Section name -> contents."""
    sections = _section_headers(data)
    names = sections[struct.unpack_from("<H", data, 0x3E)[0]]  # e_shstrndx
    return {_c_string(data, names[4] + sh[0]).decode(): data[sh[4] : sh[4] + sh[5]] for sh in sections}


def _register_count(data: bytes) -> int:
    """EIATTR_REGCOUNT (0x2f) from the cubin's .nv.info: what ptxas allocated per thread."""
    info = _elf_sections(data)[".nv.info"]
    i = 0
    while i < len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt != 4:  # the module-level .nv.info holds sized (EIFMT_SVAL) attributes only
            break
        (size,) = struct.unpack_from("<H", info, i + 2)
        if attr == 0x2F:
            return struct.unpack_from("<II", info, i + 4)[1]
        i += 4 + size
    raise AssertionError("no EIATTR_REGCOUNT in .nv.info")


def test_manifest_lists_every_key_once_as_the_folded_build(built):
    out, manifest = built
    assert manifest["arch"] == "sm_90a" and manifest["H"] == 7168
    assert sorted(json.dumps(e["key"], sort_keys=True) for e in manifest["kernels"]) == sorted(
        json.dumps(k, sort_keys=True) for k in KEYS
    )
    assert all(M.entry_build(e) == M.FOLDED for e in manifest["kernels"])
    assert len({e["cubin"] for e in manifest["kernels"]}) == len(KEYS)


@pytest.mark.parametrize("key", KEYS, ids=M.describe)
def test_cubin_is_elf_with_the_manifest_entry(built, key):
    out, manifest = built
    entry = M.find(manifest, key)
    assert entry is not None
    data = M.cubin_path(manifest, entry).read_bytes()
    assert data[:4] == b"\x7fELF"
    assert entry["entry"].encode() in _elf_symbols(data)


@pytest.mark.parametrize("key", KEYS, ids=M.describe)
def test_no_launch_bound_and_a_register_count_ptxas_allows(built, key):
    _, manifest = built
    entry = M.find(manifest, key)
    assert entry["min_ctas"] == 0
    assert _register_count(M.cubin_path(manifest, entry).read_bytes()) <= 255


def test_only_the_folded_build_is_found():
    """Every path launches manifest.FOLDED: an entry of another build (an older manifest's) is
    never returned, whatever the order of the entries."""
    key = M.make_key(2, 1, True, 2, 0, False)
    grouped = dict(key=key, min_ctas=0, fold=False, cubin="g.cubin")
    folded = dict(key=key, min_ctas=0, fold=True, cubin="f.cubin")
    for kernels in ([grouped, folded], [folded, grouped]):
        assert M.find({"kernels": kernels}, key) is folded
    assert M.find({"kernels": [grouped, dict(grouped, min_ctas=3)]}, key) is None


@pytest.mark.parametrize(
    "R, groups, twoshot, effective",
    [
        (2, 3, False, 2),
        (2, 4, False, 2),
        (4, 3, False, 2),  # S = 2 slots per group: two groups own slots
        (1, 4, False, 1),
        (3, 4, False, 3),
        (16, 3, False, 3),  # S = 6: 6 + 6 + 4
        (8, 3, False, 3),
        (16, 4, True, 1),  # a twoshot kernel polls one slot (the gather row)
    ],
)
def test_keys_carry_the_effective_groups(R, groups, twoshot, effective):
    key = M.make_key(R, 0, True, groups, 0, twoshot)
    assert key["groups"] == M.effective_groups(R, groups, twoshot) == effective
    assert M.make_key(R, 0, True, effective, 0, twoshot) == key
    # the summation order (reference.rank_sum) depends only on S = ceil(R / groups)
    slots = 1 if twoshot else R
    assert -(-slots // groups) == -(-slots // effective)


def test_every_groups_option_is_one_effective_count_of_the_same_order():
    import numpy as np

    from oproj_jax import reference

    for R in range(1, 17):
        for groups in range(1, 5):
            effective = M.effective_groups(R, groups)
            assert 1 <= effective <= groups
            assert M.effective_groups(R, effective) == effective
            if effective != groups:  # bits: the same f32 additions in the same order
                x = np.random.default_rng(R * 10 + groups).standard_normal((R, 1, 64)).astype(np.float32) * 1e4
                a, b = reference.rank_sum(x, groups), reference.rank_sum(x, effective)
                assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)), (R, groups)


def test_an_equivalent_groups_finds_the_entry():
    entry = dict(key=M.make_key(2, 1, True, 2, 0, False), min_ctas=0, fold=True, cubin="k.cubin")
    manifest = {"arch": "sm_90a", "H": 7168, "kernels": [entry], "dir": "."}
    for groups in (2, 3, 4):
        assert M.find(manifest, dict(entry["key"], groups=groups)) is entry
    assert M.find(manifest, dict(entry["key"], groups=1)) is None
    with pytest.raises(ValueError, match="groups"):
        M.make_key(2, 1, True, 0, 0, False)


def test_the_default_set():
    """The production family, and every key the GPU tests and benchmarks run (the twoshot ones
    added; the rest, mode="peer"'s too, are in the family)."""
    from oproj_jax import configs
    from oproj_jax.cute import build

    keys = build.default_set()
    family = build.production_keys()
    assert len(family) == 9 * 2 * 4 * (1 + 2 + 3 + 4 + 4)  # NB x has_delta x xmoe x effective (R, groups)
    listed = {json.dumps(k, sort_keys=True) for k in keys}
    assert len(listed) == len(keys) == len(family) + len(build.twoshot_keys())  # no repeats
    assert all(k["twoshot"] for k in build.twoshot_keys())

    def prebuilt(R, NB, has_delta, groups, reps, twoshot):
        return json.dumps(M.make_key(R, NB, has_delta, groups, reps, twoshot), sort_keys=True) in listed

    for c in configs.GPU_CHECKS + configs.BENCH:
        assert prebuilt(c.R, c.NB, c.has_delta, c.groups, c.xmoe_replicas, c.twoshot), c.name
        if c.twoshot:  # the registry consumer of a twoshot config reads the gathered row: one slot
            assert prebuilt(1, c.NB, c.has_delta, c.groups, c.xmoe_replicas, False), c.name
    for groups in (1, 2, 3, 4):  # mode="peer" on 2 GPUs (tests/test_peer_gpu.py, bench/tp.py)
        for nb, delta, reps in ((0, False, 0), (0, False, 1), (8, True, 0)):
            assert prebuilt(2, nb, delta, groups, reps, False)


@pytest.mark.parametrize("key", KEYS, ids=M.describe)
def test_params_block_cluster_smem_follow_the_abi(built, key):
    _, manifest = built
    entry = M.find(manifest, key)
    assert entry["params"] == (TWOSHOT_PARAMS if key["twoshot"] else ONESHOT_PARAMS)
    assert entry["block"] == [128, 1, 1]
    assert entry["cluster"] == [7, 1, 1]
    # at least the prefetched rows (norm, query, out_norm, prefix, blocks: 2 KiB per CTA each)
    assert entry["dynamic_smem_bytes"] >= (4 + key["NB"]) * 2048
    assert entry["dynamic_smem_bytes"] <= 227 * 1024  # the sm_90 per-block opt-in limit


def test_ptx_params_parser_reads_the_entry_signature():
    from oproj_jax.cute.build import ptx_params

    ptx = (
        ".visible .entry k(\n\t.param .u64 .ptr .global .align 16 k_param_0,\n"
        "\t.param .f32 k_param_1,\n\t.param .u32 k_param_2\n)\n{\n\t.param .b32 x;\n}"
    )
    assert ptx_params(ptx) == [".u64", ".f32", ".u32"]


def test_find_unknown_variant_is_none(built):
    _, manifest = built
    assert M.find(manifest, M.make_key(16, 7, True, 4, 5, False)) is None


@pytest.mark.parametrize(
    "key, error, words",
    [
        ({"R": 16, "NB": 8}, ValueError, "missing"),
        ({**KEYS[0], "H": 7168}, ValueError, "unexpected"),
        ({**KEYS[0], "has_delta": 1}, TypeError, "has_delta"),
        ({**KEYS[0], "groups": 4.0}, TypeError, "groups"),
        ([16, 8, True, 4, 0, False], TypeError, "dict"),
    ],
)
def test_bad_keys_raise_clearly(key, error, words):
    manifest = {"arch": "sm_90a", "H": 7168, "kernels": [], "dir": "."}
    with pytest.raises(error, match=words):
        M.find(manifest, key)


def test_missing_manifest_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="oproj_jax.cute.build"):
        M.load_manifest(tmp_path)


def test_env_dir_overrides_the_package_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(M.ENV_DIR, str(tmp_path))
    assert M.default_dir() == tmp_path
    monkeypatch.delenv(M.ENV_DIR)
    assert M.default_dir().name == "cubins" and M.default_dir().parent.name == "cute"


def test_importing_the_package_does_not_import_the_dsl():
    import subprocess
    import sys

    code = "import sys, oproj_jax.cute, oproj_jax.cute.manifest; print('cutlass' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_trace_build_adds_timers_and_leaves_the_shipped_kernel_alone(built):
    # the phase-timer build changes the code; with trace off the
    # kernel is the same bytes as the manifest's (the marks emit nothing)
    from oproj_jax.cute import build

    out, manifest = built
    key = KEYS[0]
    traced = build.compile_variant(key, M.FOLDED, trace=True)["cubin_bytes"]
    shipped = (out / M.find(manifest, key)["cubin"]).read_bytes()
    assert build.compile_variant(key, M.FOLDED)["cubin_bytes"] == shipped
    assert traced != shipped and _elf_symbols(traced) == _elf_symbols(shipped)
