"""CPU checks of the CuTe AOT build: cubins, entry names, the kernel ABI, the manifest.

Compiles a few variants (about 2-5 s each on 2 cores) into a temporary directory once per
module; skipped with the reason where the CuTe DSL is not importable.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import dsl_missing_reason
from cubin_elf import cuobjdump_sm, elf_arch, elf_symbols, register_count
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
ONESHOT_PARAMS = COMMON_PARAMS + [".u64", ".u64", ".u32"]  # 14 control, 15 own, 16 own_slot
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


@pytest.fixture(scope="module")
def built_sm100(built):
    """The same keys built for sm_100a into the same cubin directory (its subdirectory sm_100a/)."""
    from oproj_jax.cute import build

    out, _ = built
    build.build_cubins(out, KEYS, jobs=2, arch="sm_100a")
    return out, M.load_manifest(out, "sm_100a")


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
    assert entry["entry"].encode() in elf_symbols(data)


@pytest.mark.parametrize("key", KEYS, ids=M.describe)
def test_no_launch_bound_and_a_register_count_ptxas_allows(built, key):
    _, manifest = built
    entry = M.find(manifest, key)
    assert entry["min_ctas"] == 0
    assert register_count(M.cubin_path(manifest, entry).read_bytes()) <= 255


def test_each_arch_is_built_into_its_place_with_the_same_entries(built, built_sm100):
    """sm_100a's manifest and cubins go to the subdirectory sm_100a/ of the cubin directory, with
    the same keys, file names, entry names and launch as sm_90a's; building it leaves sm_90a's
    manifest and cubins as they were."""
    out, sm90 = built
    _, sm100 = built_sm100
    assert (sm90["arch"], sm100["arch"]) == ("sm_90a", "sm_100a")
    assert sm90["dir"] == str(out) and sm100["dir"] == str(out / "sm_100a")
    assert M.built_archs(out) == ["sm_90a", "sm_100a"]
    assert sm100["fingerprint"] == sm90["fingerprint"]  # the same sources
    for key in KEYS:
        a, b = M.find(sm90, key), M.find(sm100, key)
        for field in ("cubin", "entry", "params", "block", "cluster", "dynamic_smem_bytes", "min_ctas", "fold"):
            assert a[field] == b[field], (field, M.describe(key))
        assert a["sha256"] != b["sha256"]
        assert register_count(M.cubin_path(sm100, b).read_bytes()) <= 255
    assert (
        sm100["publish"]["entry"] == sm90["publish"]["entry"]
        and sm100["publish"]["params"] == sm90["publish"]["params"]
    )
    fresh = M.load_manifest(out, "sm_90a")
    for entry in fresh["kernels"] + [fresh["publish"]]:
        assert M.verified_cubin_path(fresh, entry).is_file()


def test_each_cubin_carries_its_arch(built, built_sm100):
    for _, manifest in (built, built_sm100):
        for entry in manifest["kernels"] + [manifest["publish"]]:
            path = M.cubin_path(manifest, entry)
            assert elf_arch(path.read_bytes()) == manifest["arch"], path
            assert cuobjdump_sm(path) in (None, manifest["arch"].removesuffix("a")), path


@pytest.mark.parametrize("arch", list(M.ARCHS))
def test_the_built_cubins_carry_their_arch(arch):
    """A sample of this checkout's prebuilt cubins of each arch (python -m oproj_jax.build): every
    37th entry and the publish kernel. Skipped where that arch is not built."""
    try:
        manifest = M.load_manifest(M.PACKAGE_DIR, arch)
    except FileNotFoundError as err:
        pytest.skip(f"no {arch} cubins built in this checkout ({err})")
    sample = manifest["kernels"][::37] + [manifest["publish"]]
    assert len(sample) > 1
    for entry in sample:
        path = M.verified_cubin_path(manifest, entry)
        assert elf_arch(path.read_bytes()) == arch, path
        assert cuobjdump_sm(path) in (None, arch.removesuffix("a")), path


def test_the_arch_layout():
    """One manifest per arch: the primary arch's in the cubin directory, the others' in a
    subdirectory named after the arch; the compile default is the primary arch; the build makes
    every arch."""
    from oproj_jax.cute import build

    assert M.ARCHS == {"sm_90a": "9.0", "sm_100a": "10.0"} and build.ARCH == M.PRIMARY_ARCH == "sm_90a"
    assert build.BUILD_ARCHS == ("sm_90a", "sm_100a")
    root = Path("/cubins")
    assert M.arch_dir("sm_90a", root) == root and M.arch_dir("sm_100a", root) == root / "sm_100a"
    assert [M.arch_for_capability(c) for c in ("9.0", "10.0", "8.0", "10.3", "12.0")] == [
        "sm_90a",
        "sm_100a",
        None,
        None,
        None,
    ]
    assert M.device_arch_name("12.0") == "sm_120"
    with pytest.raises(ValueError, match="arch"):
        M.arch_dir("sm_80", root)


def test_a_missing_arch_names_the_archs_built_and_the_build_command(tmp_path):
    (tmp_path / M.MANIFEST).write_text(json.dumps({"arch": "sm_90a", "H": 7168, "kernels": []}))
    with pytest.raises(FileNotFoundError) as err:
        M.load_manifest(tmp_path, "sm_100a")
    message = str(err.value)
    assert "sm_100a (compute capability 10.0)" in message and "archs built there: sm_90a" in message
    assert M.REBUILD_COMMAND in message and "python -m oproj_jax.cute.build --arch sm_100a" in message
    (tmp_path / "sm_100a").mkdir()
    (tmp_path / "sm_100a" / M.MANIFEST).write_text(json.dumps({"arch": "sm_90a", "H": 7168, "kernels": []}))
    with pytest.raises(ValueError, match="records arch 'sm_90a'"):
        M.load_manifest(tmp_path, "sm_100a")
    assert M.load_manifest(tmp_path, "sm_90a")["dir"] == str(tmp_path)


def test_the_cli_builds_every_arch_unless_told(monkeypatch):
    from oproj_jax.cute import build

    calls = []
    monkeypatch.setattr(build, "build_cubins", lambda out, keys, jobs, log, arch: calls.append((arch, keys)))
    assert build.main(["--key", "2,1,1,2,0,0"]) == 0
    assert [arch for arch, _ in calls] == ["sm_90a", "sm_100a"]
    calls.clear()
    assert build.main(["--arch", "sm_100a", "--arch", "sm_100a"]) == 0
    assert calls == [("sm_100a", None)]
    with pytest.raises(SystemExit):
        build.main(["--arch", "sm_120a"])


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
    """The production family, its own-partial variants at R = 16, and every key the GPU tests and
    benchmarks run (the twoshot ones added; the rest, mode="peer"'s too, are in the family)."""
    from oproj_jax import configs
    from oproj_jax.cute import build

    keys = build.default_set()
    family = build.production_keys()
    assert len(family) == 9 * 2 * 4 * (1 + 2 + 3 + 4 + 4)  # NB x has_delta x xmoe x effective (R, groups)
    listed = {json.dumps(k, sort_keys=True) for k in keys}
    own = build.own_keys()
    assert len(own) == 9 * 2 * 4 * 4 and all(k["own"] and k["R"] == 16 and not k["twoshot"] for k in own)
    assert not any(k["own"] for k in family + build.twoshot_keys())
    assert len(listed) == len(keys) == len(family) + len(own) + len(build.twoshot_keys())  # no repeats
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
        ({**KEYS[0], "own": 1}, TypeError, "own"),
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
    assert traced != shipped and elf_symbols(traced) == elf_symbols(shipped)
