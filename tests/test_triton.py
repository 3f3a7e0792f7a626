"""backend="triton" without a GPU: the kernels in Triton's interpreter against the oracle, the
same kernels compiled for sm_90, the JAX call lowered for CUDA, the plan, the PyTorch entry's
argument errors. The GPU runs are tests/test_triton_gpu.py.

  * interpreter: torch_launch.consumer on CPU tensors in a subprocess started with
    TRITON_INTERPRET=1 (Triton reads it when kernel.py's @triton.jit runs), every kernel kind
    over the summation orders, has_delta, NB = 0, xmoe, R = 1 and 2, -0.0, NaN and infinities,
    small H and H = 7168 once; each call held to testing.check_result (prefix bit for bit).
  * sm_90: triton.compile with GPUTarget("cuda", 90, 32) gives PTX and a cubin for every kernel
    of the plans the launchers run, with `.rn` on every f32 add, mul and FMA and no FMA but the
    sync kernel's written ones (contraction off: the prefix is adds only, and JAX's and PyTorch's
    launches emit the same arithmetic).
  * JAX: backend.launch(..., compute_capability=90) under jax.jit lowers for CUDA, through the
    package's FFI target and through jax_triton (jax_triton=True: its custom call, jax_triton
    compiling the PTX for sm_90 here; the CUDA plugin's kernel-call objects, absent from a CPU
    jaxlib, are stand-ins), the prefix operand aliased to output 0 (and donated). Under vmap: a
    loop of calls. For the other GPUs the backend serves (sm_80, 86, 89, 100, 120) the package's
    target on arrival counters, a cubin of the device's arch.
  * the plan (the default rule, shapes, refusals), the PyTorch entry's argument errors,
    testing.spread_tokens, and benchmarks/triton_gpu.py as far as it runs without a GPU.
"""

from __future__ import annotations

import ast
import hashlib
import dataclasses
import importlib.util
import json
import math
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

# Every test here compiles, interprets or lowers a Triton kernel: the `triton` extra. (CI's
# second venv, the newest jax without extras, skips the file.)
pytest.importorskip("triton", reason="the triton extra is not installed")

from conftest import benchmark_script, inplace_pairs, launch_attributes, worker_env
from cubin_elf import elf_arch
from oproj_jax import api, configs, testing
from oproj_jax.configs import Config
from oproj_jax import launch as ffi_launch
from oproj_jax.triton import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
EPS = dict(eps=0.5, out_eps=0.25)  # large against the sources' mean squares: a swapped epsilon shows
# every kernel path: row, tile, sync holding its blocks (the default at T <= 8), sync reading them again
KINDS = ("row-w16", "tile-512-w8", None, "sync-256-w1", "sync-1024-w4-reload-r64")


# ---- interpreter ------------------------------------------------------------------------------


def _nan_inf(x):
    """test_contract's non-finite case: a NaN slot (token 0), an infinite slot (token 1), with
    blocks an infinite block element (token 2), without a +inf and a -inf slot."""
    x["mailbox"][3, 0, 5] = np.nan
    x["mailbox"][7, 1, 9] = np.inf
    if x["blocks"].shape[1]:
        x["blocks"][2, 0, 3] = -np.inf
    else:
        x["mailbox"][2, 1, 9] = -np.inf


def _inf_prefix(x):  # NB = 0: output = p * rstd(p.p) = p * 0, NaN at the infinite element
    x["mailbox"][0, 0, 9] = np.inf


def _negative_zeros(x):  # every slot -0.0: the prefix is +0.0 there
    x["mailbox"][:, 1, :300] = -0.0


def _negative_zero_output(x):  # output -0.0 (p = +0.0 times a negative out_norm): +0.0 in xmoe
    x["mailbox"][:, 1, 9] = 0.0
    x["out_norm"][9] = -1.0


@dataclasses.dataclass(frozen=True)
class Case:
    config: Config
    variant: str | None  # None: the default rule
    change: object = None  # a function that edits the inputs in place
    own: int | None = None  # partial= given for this slot (the slot itself NaN: it must not be read)

    @property
    def id(self) -> str:
        tag = f"-{self.change.__name__.strip('_')}" if self.change else ""
        tag += "" if self.own is None else f"-own{self.own}"
        return f"{self.config.name}-H{self.config.H}-{self.variant or 'default'}{tag}"


def _cases() -> list[Case]:
    small = [
        Config(16, 3, 8, H=512),  # the production order (groups 4) with C = 2 chunks in sync-256-w1
        Config(16, 3, 8, groups=1, H=256),
        Config(16, 2, 3, groups=2, H=256, xmoe_replicas=2),
        Config(16, 3, 0, groups=3, has_delta=False, H=256),
        Config(2, 3, 1, groups=3, H=256),
        Config(1, 2, 8, groups=1, H=256, xmoe_replicas=1),
    ]
    cases = [Case(c, v) for c in small for v in KINDS]
    nonfinite = [Config(16, 4, 8, H=256), Config(16, 3, 0, groups=3, has_delta=False, H=256)]
    cases += [Case(c, v, _nan_inf) for c in nonfinite for v in KINDS]
    cases += [Case(Config(2, 2, 0, groups=1, H=256), v, _inf_prefix) for v in KINDS]
    cases += [Case(Config(16, 3, 0, groups=3, has_delta=False, H=512), v, _negative_zeros) for v in KINDS]
    cases += [
        Case(Config(2, 3, 0, groups=1, has_delta=False, xmoe_replicas=2, H=256), "row-w16", _negative_zero_output)
    ]
    # the production H: the default (28 chunks, their records added over a span of 32), 14 tiles, 4
    # chunks (the last one partial), 7 chunks reading the blocks again
    cases += [
        Case(Config(16, 2, 8, H=7168), v)
        for v in (None, "row-w16", "tile-512-w8", "sync-2048-w8", "sync-1024-w4-reload-r64", "sync-2048-w8-cluster")
    ]
    # the caller's own partial read in place of its slot: first of a group, inside one, the last rank
    cases += [Case(Config(16, 3, 8, H=512), v, own=own) for v in KINDS for own in (0, 9)]
    cases += [Case(Config(2, 3, 1, groups=3, H=256), v, own=1) for v in ("row-w16", None)]
    cases += [Case(Config(16, 2, 8, H=7168), None, own=15)]
    return cases


CASES = _cases()

_INTERPRET = textwrap.dedent("""
    import json, pathlib, sys
    import numpy as np, torch
    from oproj_jax.triton import torch_launch
    assert torch_launch.interpreted(), "TRITON_INTERPRET=1 did not reach kernel.py"
    folder = pathlib.Path(sys.argv[1])
    bf16 = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    for case in json.loads((folder / "cases.json").read_text()):
        x = np.load(folder / f"{case['id']}.in.npz")
        own = {k: bf16(x[k].copy()) for k in case["keywords"]}
        result = torch_launch.consumer(*(bf16(x[k].copy()) for k in case["args"]), **own, **case["options"])
        out = {k: v.view(torch.int16).numpy() for k, v in result._asdict().items() if v is not None}
        np.savez(folder / f"{case['id']}.out.npz", **out)
""")


def _inputs(case: Case) -> dict:
    x = {k: v.copy() for k, v in configs.make_inputs(case.config, seed=3).items()}
    if case.change:
        case.change(x)
    return x


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """case id -> (inputs, (prefix, output, xmoe) as numpy bf16): every case in one interpreter
    process (starting one costs seconds). Needs the `triton` extra (triton and torch)."""
    pytest.importorskip("torch", reason="the triton extra's PyTorch launch needs torch")
    folder = tmp_path_factory.mktemp("interpret")
    table = []
    for case in CASES:
        x, keywords, options = _inputs(case), [], dict(EPS, **case.config.options(), variant=case.variant)
        if case.own is not None:  # the slot's values passed as partial=, the slot itself NaN
            x["partial"] = x["mailbox"][case.own].copy()
            x["mailbox"][case.own] = np.nan
            keywords, options = ["partial"], dict(options, rank=case.own)
        np.savez(folder / f"{case.id}.in.npz", **{k: v.view(np.uint16) for k, v in x.items()})
        table.append(dict(id=case.id, args=ARGS, keywords=keywords, options=options))
    (folder / "cases.json").write_text(json.dumps(table))
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRET, str(folder)],
        env=worker_env(TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = {}
    for case in CASES:
        out = np.load(folder / f"{case.id}.out.npz")
        got = [out[k].view(ml_dtypes.bfloat16) if k in out else None for k in ("prefix", "output", "xmoe")]
        results[case.id] = (_inputs(case), tuple(got))
    return results


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_interpreter_matches_the_oracle(interpreted, case):
    inputs, result = interpreted[case.id]
    testing.check_result(case.config, inputs, result, **EPS, what=case.id)


def test_interpreter_nonfinite_rows(interpreted):
    """Where NaN and infinities land (the oracle checks positions; these are the expected ones)."""
    for case in CASES:
        if case.change is not _nan_inf:
            continue
        _, (prefix, output, _) = interpreted[case.id]
        prefix, output = prefix.astype(np.float32), output.astype(np.float32)
        assert np.isnan(prefix[0, 5]), case.id
        assert prefix[1, 9] == np.inf if case.config.NB else np.isnan(prefix[1, 9]), case.id
        assert np.isnan(output[:-1]).all() and np.isfinite(output[-1]).all(), case.id


def test_interpreter_zeros(interpreted):
    for case in CASES:
        _, (prefix, output, xmoe) = interpreted[case.id]
        if case.change is _negative_zeros:
            assert (testing.bits(prefix)[1, :300] == 0).all(), f"{case.id}: a sum of -0.0 slots is not +0.0"
        if case.change is _negative_zero_output:
            assert testing.bits(output)[1, 9] == 0x8000 and (testing.bits(xmoe)[:, 1, 9] == 0).all(), case.id
        if case.change is _inf_prefix:
            row = output[0].astype(np.float32)
            assert np.isnan(row[9]) and (np.delete(row, 9) == 0).all(), case.id


def test_interpreter_variants_agree_on_the_prefix(interpreted):
    """Every kernel kind writes the same prefix bits (they all follow the one summation order)."""
    by_input: dict = {}
    for case in CASES:
        by_input.setdefault((case.config, case.change), []).append(testing.bits(interpreted[case.id][1][0]))
    for key, prefixes in by_input.items():
        for other in prefixes[1:]:
            np.testing.assert_array_equal(other, prefixes[0], err_msg=str(key))


# ---- compiled for sm_90 -----------------------------------------------------------------------


def test_triton_is_the_real_compiler():
    """`import triton` inside oproj_jax.triton is the Triton package, not this one."""
    from oproj_jax.triton import kernel

    assert pathlib.Path(kernel.triton.__file__).parent.name == "triton"
    assert "oproj_jax" not in kernel.triton.__file__


def test_kernel_module_imports_neither_jax_nor_torch():
    from oproj_jax.triton import kernel

    tree = ast.parse(pathlib.Path(kernel.__file__).read_text())
    names = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names == {"triton"}, names


PRODUCTION = dict(eps=1e-6, out_eps=1e-6, has_delta=True, groups=4, xmoe_replicas=1)
FIRST_LAYER = dict(eps=1e-6, out_eps=1e-6, has_delta=False, groups=3, xmoe_replicas=0)
PLANS = {  # every kernel as the launchers run it, at R=16 NB=8 H=7168 and with the other branches
    **{f"T{T}-default": plan.make(16, T, 8, 7168, **PRODUCTION) for T in (1, 64, 4096)},
    "T64-tile": plan.make(16, 64, 8, 7168, **PRODUCTION, variant="tile-512-w8"),
    "T64-row": plan.make(16, 64, 8, 7168, **PRODUCTION, variant="row-w16"),
    # the caller's own partial read in place of slot 9 (its prefetch at T = 1 too)
    **{
        f"own-T{T}-{v or 'default'}": plan.make(16, T, 8, 7168, **PRODUCTION, variant=v, own=9, clusters=True)
        for T, v in ((1, None), (64, None), (4096, None), (8, "row-w16"), (8, "tile-512-w8"), (1, "sync-256-w1"))
    },
    **{
        f"NB0-{v}": plan.make(3, 2, 0, 7168, **FIRST_LAYER, variant=v)
        for v in ("row-w16", "tile-512-w8", "sync-256-w1", "sync-1024-w4-reload-r64")
    },
}


POINTER_TYPES = {"stats": "*fp32", "arrivals": "*i32"}  # every other pointer is to bf16


def _compile_sm90(launch: plan.Launch):
    import triton
    from triton.backends.compiler import GPUTarget

    from oproj_jax.triton import kernel

    fn = getattr(kernel, launch.kernel)
    constexprs = dict(launch.constexprs)
    pointers = [name for name in fn.arg_names if name not in constexprs]
    signature = {name: "constexpr" if name in constexprs else POINTER_TYPES.get(name, "*bf16") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}  # as jax_triton assumes
    source = triton.compiler.ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch.options())


@pytest.mark.parametrize("name", PLANS)
def test_kernels_compile_for_sm90_without_contraction(name, tmp_path, monkeypatch):
    """Every f32 add and mul rounded on its own (.rn: ptxas may not contract them); FMAs only where
    the sync kernel writes them (its dot products and mix as chains over a thread's columns and
    blocks, fma.rn.f32: one rounding, the same in every compiler), and there its bf16 roundings one
    cvt.rn.bf16x2.f32 per two values; the row and tile kernels have neither."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    launch = PLANS[name].launch
    compiled = _compile_sm90(launch)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and f".entry {launch.kernel}" in ptx
    assert compiled.asm["cubin"][:4] == b"\x7fELF", "no cubin"
    assert not re.findall(r"\bfma\.(?!rn\.f32\b)\S+", ptx), f"{launch.kernel}: an FMA without .rn"
    bare = re.findall(r"\b(?:add|sub|mul)\.f32\b", ptx)
    assert not bare, f"{launch.kernel}: {len(bare)} f32 add/mul without .rn (ptxas may contract them)"
    assert re.search(r"\badd\.rn\.f32\b", ptx)
    constexprs = dict(launch.constexprs)
    written = launch.kernel == "sync_kernel"
    assert ("cvt.rn.bf16x2.f32" in ptx) == written, "the sync kernel's roundings"
    fmas = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
    if not written:
        assert fmas == 0, f"{launch.kernel}: {fmas} FMAs"
    elif not constexprs["RELOAD"]:
        # the blocks' dots and squares and p's two: chains of LANES products, the first a multiply
        chains = 2 * constexprs["NB"] + 2
        assert fmas >= chains * (constexprs["LANES"] - 1), f"{fmas} FMAs"


def _registers(launch: plan.Launch, folder: pathlib.Path) -> tuple[int, int]:
    """(registers a thread, stack bytes) of the launch's kernel as ptxas built it (cuobjdump)."""
    import triton.backends.nvidia

    cuobjdump = pathlib.Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        pytest.skip(f"no cuobjdump in the triton wheel ({cuobjdump})")
    cubin = folder / f"{launch.kernel}-{launch.max_registers}.cubin"
    cubin.write_bytes(_compile_sm90(launch).asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout).groups()
    return int(registers), int(stack)


def test_register_cap_reaches_ptxas(tmp_path, monkeypatch):
    """The configuration with a register cap (the default at T = 4096) is compiled with it
    (.maxnreg) and ptxas fits the kernel in it without spilling; the same launch uncapped takes
    more registers (the cap is what buys the occupancy)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    capped = PLANS["T4096-default"].launch
    uncapped = dataclasses.replace(capped, max_registers=None)
    assert capped.options()["maxnreg"] == 64 and "maxnreg" not in uncapped.options()
    assert dict(capped.constexprs)["RELOAD"] is True
    assert _registers(capped, tmp_path) == (64, 0)
    assert _registers(uncapped, tmp_path)[0] > 64


def test_sync_kernel_barriers_as_compiled(tmp_path, monkeypatch):
    """The sync kernel's two barriers in the PTX: one thread of a program counts it in (acq_rel),
    the last arrival sets the counter back to zero (release) and the others poll (acquire), all
    predicated, at GPU scope; a counter that was not zero at launch and the poll bound end in a
    trap. Its stages (the interpreter's launches) have no barrier."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    whole = PLANS["T1-default"]
    ptx = _compile_sm90(whole.launch).asm["ptx"]
    assert len(re.findall(r"@%p\d+ atom\.global\.gpu\.acq_rel\.add\.u32", ptx)) == 2, "the arrivals"
    assert len(re.findall(r"@%p\d+ atom\.global\.gpu\.release\.exch\.b32", ptx)) == 2, "the resets"
    # Triton emits the polls (atomic adds of 0) as acquire loads.
    assert len(re.findall(r"@%p\d+ ld\.global\.gpu\.acquire\.b32", ptx)) == 2, "the polls"
    assert ptx.count("trap;") == 4 and "ld.global.cg" in ptx
    assert "griddepcontrol" not in ptx, "a launch without PDL"
    for stage in whole.stages():
        assert "atom." not in _compile_sm90(stage).asm["ptx"], dict(stage.constexprs)["PHASE"]


@pytest.mark.parametrize(("variant", "sends"), [("sync-1024-w4-cluster", 2)])
def test_cluster_configuration_sends_its_records_to_the_peers_barriers(tmp_path, monkeypatch, variant, sends):
    """A sync configuration launched in clusters: thread 0 makes two transaction barriers
    (mbarrier, one per meeting) past Triton's shared memory (the launch asks for the exchange's
    bytes more), fences them for the cluster, then one relaxed arrival and wait lets the programs
    write into each other's shared memory; each sends its record to the peers with st.async
    (indexed by thread: 6 peers x 18 lanes, one pass of 128 threads), then each warp's y.y (lanes
    0 .. 6 of a warp to the 7 programs, its own included, after a butterfly over the warp's lanes)
    and waits on its own barrier for their bytes; no cluster barrier with release or acquire (no
    fence waits for the prefix's stores), no atomic, no poll, no trap, no record in global memory;
    the launch names clusters of its C = 7 programs and has no counters; the interpreter's
    stages, none."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    clustered = plan.make(16, 3, 8, 7168, **PRODUCTION, variant=variant, clusters=True)
    launch = clustered.launch
    assert launch.cluster == 7 and launch.grid == (7, 3) and dict(launch.constexprs)["CLUSTER"] is True
    # the records (16-byte words: 18 lanes, padding, then a y.y lane for each of the 4 warps), two barriers
    assert dict(launch.constexprs)["YY_WARPS"] == 4 and dict(launch.constexprs)["RECORD"] == 20 + 4
    assert launch.exchange == 7 * 24 * 4 + 16
    assert clustered.arrivals_shape is None and clustered.stats_shape == (3, 7, 24)
    ptx = _compile_sm90(launch).asm["ptx"]
    assert ptx.count("mbarrier.init.shared::cta.b64") == 2 and ptx.count("mbarrier.arrive.expect_tx") == 2
    assert ptx.index("fence.mbarrier_init.release.cluster") < ptx.index("barrier.cluster.arrive.relaxed.aligned")
    assert ptx.count("barrier.cluster.arrive.relaxed.aligned") == 1 and ptx.count("barrier.cluster.wait.aligned") == 1
    assert ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32") == sends
    assert ptx.count("shfl.sync.bfly.b32 xt") == 5 and ptx.index("shfl.sync.bfly.b32 xt") < ptx.rindex("st.async")
    assert ptx.index("barrier.cluster.wait.aligned") < ptx.index("st.async.shared::cluster")
    assert "mbarrier.try_wait.parity.shared::cta.b64" in ptx and "mapa.shared::cluster.u32" in ptx
    assert "barrier.cluster.arrive.release" not in ptx and "wait.acquire" not in ptx and "st.shared::cluster" not in ptx
    assert (
        "%dynamic_smem_size" in ptx and "ld.shared.v4.f32" in ptx and "membar" not in ptx and "fence.acq_rel" not in ptx
    )
    assert "atom." not in ptx and "trap;" not in ptx and "ld.global.cg" not in ptx and "st.global.b32" not in ptx
    counterpart = plan.make(16, 3, 8, 7168, **PRODUCTION, variant=variant.replace("-cluster", "")).launch
    assert counterpart.cluster == 0 and dict(counterpart.constexprs)["CLUSTER"] is False
    for stage in clustered.stages():
        assert stage.cluster == 0 and dict(stage.constexprs)["CLUSTER"] is False
        assert (
            stage.constexprs
            == dataclasses.replace(
                counterpart,
                constexprs=tuple(
                    sorted(
                        {
                            **dict(counterpart.constexprs),
                            "PHASE": dict(stage.constexprs)["PHASE"],
                            "PREFETCH": False,
                        }.items()
                    )
                ),
            ).constexprs
        ), "the stages of the counterpart"


def test_prefetch_only_at_few_tokens(tmp_path, monkeypatch):
    """Up to plan.PREFETCH_MAX_T tokens the sync kernel asks L2 for every row a program reads
    (R mailbox rows, NB blocks, prefix, norm, query: one prefetch.global.L2 each) before its
    first load; above, and in the interpreter's stages, none."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    few, many = (plan.make(16, T, 8, 7168, **PRODUCTION, clusters=True) for T in (plan.PREFETCH_MAX_T, 64))
    assert dict(few.launch.constexprs)["PREFETCH"] is True and dict(many.launch.constexprs)["PREFETCH"] is False
    assert all(dict(stage.constexprs)["PREFETCH"] is False for stage in few.stages())
    ptx = _compile_sm90(few.launch).asm["ptx"]
    assert ptx.count("prefetch.global.L2") == 16 + 8 + 3
    assert ptx.index("prefetch.global.L2") < re.search(r"ld\.(?:volatile\.)?global", ptx).start()
    assert "prefetch" not in _compile_sm90(many.launch).asm["ptx"]


def test_loads_first_at_few_tokens_where_the_rows_fit(tmp_path, monkeypatch):
    """Up to plan.LOADS_FIRST_MAX_T tokens a sync program whose rows fit in registers loads all
    of them (R partials, the old prefix, norm, query, out_norm, NB blocks: volatile loads) in one
    loop body before any arithmetic; with more tokens, R = 64 ranks (rows beyond the register
    budget) or blocks read again, it loads among the sums (no volatile load)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    first = lambda p: dict(p.launch.constexprs)["LOADS_FIRST"]  # noqa: E731
    few = plan.make(16, plan.LOADS_FIRST_MAX_T, 8, 7168, **PRODUCTION, clusters=True)
    assert first(few) and first(plan.make(16, 1, 8, 7168, **PRODUCTION, variant="sync-256-w1"))
    assert not first(plan.make(16, plan.LOADS_FIRST_MAX_T + 1, 8, 7168, **PRODUCTION, clusters=True))
    assert not first(plan.make(64, 1, 8, 7168, **PRODUCTION, clusters=True))
    assert not first(plan.make(16, 1, 8, 7168, **PRODUCTION, variant="sync-1024-w4-reload-r64"))
    ptx = _compile_sm90(few.launch).asm["ptx"]
    volatile = [m.start() for m in re.finditer(r"ld\.volatile\.global", ptx)]
    assert len(volatile) == 16 + 1 + 3 + 8 and "ld.global" not in ptx.replace("ld.global.nc", "")[: volatile[0]]
    body = ptx[volatile[0] : volatile[-1]]
    assert not re.search(r"\b(?:add|mul)\.rn\.f32\b", body), "arithmetic among the loads"
    assert "ld.volatile" not in _compile_sm90(plan.make(16, 16, 8, 7168, **PRODUCTION, clusters=True).launch).asm["ptx"]
    # ptxas's schedule: the 28 loads one after another, no float arithmetic among them
    import triton.backends.nvidia

    cuobjdump = pathlib.Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        pytest.skip("no cuobjdump in Triton's NVIDIA backend")
    cubin = tmp_path / "few.cubin"
    cubin.write_bytes(_compile_sm90(few.launch).asm["cubin"])
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\d\s+)?([A-Z][A-Z0-9.]*)", sass)
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    assert len(loads) == 16 + 1 + 3 + 8, len(loads)
    among = [op for op in ops[loads[0] : loads[-1]] if op.split(".")[0] in ("FADD", "FMUL", "FFMA", "FSEL", "FSETP")]
    assert not among and loads[-1] - loads[0] < 100, (loads, among)


def test_sync_kernel_with_pdl_waits_before_reading(tmp_path, monkeypatch):
    """pdl=True: the launch asks for programmatic dependent launch (Triton's launch_pdl) and the
    kernel's first instructions wait for the grid ahead (griddepcontrol.wait), before any load;
    the interpreter's stages never use it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with_pdl = plan.make(16, 1, 8, 7168, **PRODUCTION, pdl=True)
    launch = with_pdl.launch
    assert launch.pdl and launch.options()["launch_pdl"] is True and dict(launch.constexprs)["PDL"] is True
    compiled = _compile_sm90(launch)
    assert compiled.metadata.launch_pdl
    body = compiled.asm["ptx"].split(".entry sync_kernel", 1)[1]
    wait = body.index("griddepcontrol.wait")
    assert wait < body.index("ld.global") and wait < body.index("griddepcontrol.launch_dependents")
    assert all(not s.pdl and dict(s.constexprs)["PDL"] is False for s in with_pdl.stages())
    row = plan.make(16, 1, 8, 7168, **PRODUCTION, variant="row-w16", pdl=True).launch
    assert not row.pdl and "launch_pdl" not in row.options(), "only the sync kernel waits for the grid ahead"


# ---- the JAX call, lowered for CUDA -----------------------------------------------------------


@pytest.fixture
def cuda_triton_stand_ins(monkeypatch, tmp_path):
    """jaxlib's Triton kernel-call objects (the CUDA plugin's, missing from a CPU jaxlib) as
    stand-ins that record what jax_triton compiled; asking a GPU for its capability fails."""
    if importlib.util.find_spec("jax_triton") is None:  # found, not imported: it needs the stand-ins below
        pytest.skip("the JAX launch needs jax-triton: pip install oproj-jax[triton]")
    from jaxlib import gpu_triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # importing jax_triton overwrites it

    compiled = []

    class TritonKernel:
        def __init__(self, name, num_warps, num_ctas, shared_mem, ptx, ttir, compute_capability):
            compiled.append(dict(name=name, num_warps=num_warps, ptx=ptx, compute_capability=compute_capability))

    class TritonKernelCall:
        def __init__(self, kernel, grid_x, grid_y, grid_z, params):
            compiled[-1]["params"] = params  # (bytes to zero, pointer divisibility) per array

        def to_proto(self, name, metadata):
            return name.encode()

    def no_gpu(*args):
        raise AssertionError("asked a GPU")

    stand_ins = dict(
        TritonKernel=TritonKernel,
        TritonKernelCall=TritonKernelCall,
        create_array_parameter=lambda *a: a,
        create_scalar_parameter=lambda *a: a,
        get_compute_capability=no_gpu,
        get_serialized_metadata=no_gpu,
    )
    for name, value in stand_ins.items():
        monkeypatch.setattr(gpu_triton, name, value, raising=False)
    from jax_triton import triton_lib

    monkeypatch.setattr(triton_lib, "_COMPILED_KERNEL_CACHE", {})
    return compiled


def _lowered(variant, T, *, jax_triton=False, vmap=False, own=None, stream_capture=False, cc=90):
    from oproj_jax.triton import backend

    R, NB, H = 16, 8, 7168
    shapes = [(R, T, H), (T, H), (T, NB, H), (H,), (H,), (H,)] + ([] if own is None else [(T, H)])
    if vmap:
        shapes = [(2, *s) if i < 2 else s for i, s in enumerate(shapes)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]

    def step(*arrays):
        partial = dict(partial=arrays[6], rank=own) if own is not None else {}
        return backend.launch(
            *arrays[:6], **partial, **PRODUCTION, variant=variant, compute_capability=cc, jax_triton=jax_triton,
            stream_capture=stream_capture,
        )  # fmt: skip

    if vmap:
        step = jax.vmap(step, in_axes=(0, 0, None, None, None, None))
    return jax.jit(step, donate_argnums=1).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


JAX_TRITON_TARGET = "triton_kernel_call"  # jax-triton 0.3.1's (legacy) custom call
ALIASED = "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [0], operand_index = 1,"


def _jax_triton_calls(text: str) -> list[str]:
    return re.findall(rf"stablehlo\.custom_call @{JAX_TRITON_TARGET}\(.*", text)


@pytest.mark.parametrize(("variant", "T"), [(None, 1), ("row-w16", 64), ("tile-512-w8", 8), ("sync-2048-w8", 5)])
def test_jax_triton_call_lowers_for_cuda_with_the_prefix_aliased(cuda_triton_stand_ins, variant, T):
    """jax_triton=True: one triton_call per call, jax_triton compiling the plan's kernel for sm_90."""
    text = _lowered(variant, T, jax_triton=True)
    (call,) = _jax_triton_calls(text)
    assert ALIASED in call, "the prefix (operand 1) is not aliased to output 0"
    assert re.search(r"%arg1: tensor<\d+x7168xbf16> \{tf\.aliasing_output = 0", text), "the donated prefix"
    (kernel,) = cuda_triton_stand_ins
    assert kernel["compute_capability"] == 90 and ".target sm_90" in kernel["ptx"], kernel["name"]
    zeroed = [size for size, _ in kernel["params"]]
    # sync: the kernel call zeroes the arrival counters (T x 2 int32, the last array) before
    # each launch; nothing else is zeroed
    counters = plan.make(16, T, 8, 7168, **PRODUCTION, variant=variant).arrivals_shape
    assert zeroed == [0] * (len(zeroed) - 1) + [4 * math.prod(counters) if counters else 0]


def test_jax_call_under_vmap_runs_once_per_element(cuda_triton_stand_ins):
    text = _lowered("row-w16", 3, jax_triton=True, vmap=True)
    assert "stablehlo.while" in text and len(_jax_triton_calls(text)) == 1


@pytest.fixture
def library_cache(monkeypatch, tmp_path):
    """The package's FFI library (built by the install) and a fresh cubin cache."""
    from oproj_jax import ffi

    reason = ffi.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from oproj_jax.triton import library

    monkeypatch.setenv("OPROJ_JAX_CACHE_DIR", str(tmp_path))
    library.compile_launch.cache_clear()  # compiled in this test, stored here
    yield tmp_path / "triton"
    library.compile_launch.cache_clear()


LIBRARY_CALL = re.compile(r"stablehlo\.custom_call @(oproj_launch\w*)\((.*?)\) \{.*")


def test_stream_capture_names_the_traced_target(library_cache):
    """stream_capture=True: the same launch through the target without a record stage at a few
    tokens too (api.consumer's option)."""
    # 7 tokens: a shape no other test lowers (JAX keeps the traced call of a shape, its cubin path with it)
    node, captured = (LIBRARY_CALL.findall(_lowered(None, 7, stream_capture=c)) for c in (False, True))
    assert [name for name, _ in node] == ["oproj_launch"] and [name for name, _ in captured] == ["oproj_launch_traced"]
    assert node[0][1] == captured[0][1], "the same operands"


@pytest.mark.parametrize(
    ("variant", "T", "target"),
    [
        (None, 5, "oproj_launch"),
        ("sync-2048-w8-cluster", 5, "oproj_launch"),
        ("tile-512-w8", 3, "oproj_launch"),
        ("row-w16", 64, "oproj_launch"),
        ("row-w16", 65, "oproj_launch_traced"),
        (None, 80, "oproj_launch_traced"),
    ],
)
def test_library_lowering_names_a_stored_cubin_and_its_parameters(library_cache, variant, T, target):
    """The default launch: a call of the package's target (traced above library.RECORD_MAX_T
    tokens) naming a cubin stored under its sha256, the kernel's pointers in Triton's order
    (operands, results, then Triton's two null scratch pointers), the launch shape of the plan;
    the sync counters start from a zeros operand aliased to them (none in a cluster
    configuration, the default on sm_90, launched in clusters of its programs with the exchange's
    shared memory added, its counter pointer an int32 placeholder); the sync kernel launched with
    PDL."""
    text = _lowered(variant, T)
    calls = LIBRARY_CALL.findall(text)
    launch = plan.make(16, T, 8, 7168, **PRODUCTION, variant=variant, clusters=True).launch
    assert len(calls) == 1, text[:3000]
    assert re.search(r"%arg1: tensor<\d+x7168xbf16> \{tf\.aliasing_output = 0", text), "the donated prefix"
    ((name, operands),) = calls
    assert name == target
    call = next(line for line in text.splitlines() if f"stablehlo.custom_call @{name}(" in line)
    attrs = launch_attributes(call)
    path = pathlib.Path(attrs["cubin"])
    image = path.read_bytes()
    assert path.parent == library_cache and hashlib.sha256(image).hexdigest()[:24] in path.name
    assert image[:4] == b"\x7fELF", "a cubin"
    assert attrs["entry"] == launch.kernel
    assert attrs["block"] == (32 * launch.num_warps, 1, 1)
    assert attrs["cluster"] == ((launch.cluster, 1, 1) if launch.cluster else (0, 0, 0))
    assert launch.cluster == {None: 7, "sync-2048-w8-cluster": 4}.get(variant, 0), "sm_90: clusters"
    # the records (whole 16-byte words: 18 lanes and padding, then a y.y lane a warp; under RELOAD one y.y lane and
    # padding) and two 8-byte barriers
    reload = launch.kernel == "sync_kernel" and dict(launch.constexprs)["RELOAD"]
    record = 2 * 8 + 4 if reload else 20 + (launch.num_warps + 3) // 4 * 4
    assert launch.exchange == (launch.cluster * record * 4 + 16 if launch.cluster else 0)
    assert attrs["smem"] >= launch.exchange, "the cluster's exchange past Triton's shared memory"
    assert attrs["smem"] % 16 == 0, "the exchange's records 16-byte aligned from the end"
    assert attrs["grid"] == (*launch.grid, 1, 1)[:3]
    n_in = operands.count("%")
    zeroed = launch.kernel == "sync_kernel" and not launch.cluster
    n_arrays = n_in - zeroed
    params = attrs["params"]
    B = ffi_launch.buffer
    assert params[:n_arrays] == [B(i) for i in range(n_arrays)] and params[-2:] == [ffi_launch.NULL] * 2, params
    results = params[n_arrays:-2]
    assert results == [B(i) for i in range(n_in, n_in + len(results))], params
    # PDL (sm_90 here) for the sync kernel, the one that waits for the grid ahead
    assert attrs["pdl"] is (launch.kernel == "sync_kernel")
    if zeroed:  # the counters: the last result, read in place from the zeros operand
        assert inplace_pairs(call) == [(n_arrays, len(results) - 1)]
        assert f"output_tuple_indices = [{len(results) - 1}], operand_index = {n_arrays}," in text
    else:
        assert inplace_pairs(call) == []


# The GPUs other than sm_90 that the Triton backend serves (api.TRITON_MIN_CAPABILITY on), each with the arch
# Triton compiles for: A100, A10 / RTX 30xx, L40S / RTX 40xx, B200, RTX 50xx.
OTHER_ARCHS = {80: "sm_80", 86: "sm_86", 89: "sm_89", 100: "sm_100a", 120: "sm_120a"}


@pytest.mark.parametrize("cc", sorted(OTHER_ARCHS))
def test_library_lowering_compiles_for_every_other_arch_it_serves(library_cache, cc):
    """Off sm_90 the package's target launches the sync kernel on arrival counters (no clusters:
    plan.CLUSTER_CAPABILITIES), with PDL from sm_90 on, compiled for the device's own arch: at T =
    1 and at T = 4096 (RELOAD), a cubin for that arch (read from its ELF header and, from sm_100 on,
    ptxas's note), so no sm_90-only instruction (st.async, mbarrier transactions, mapa) is left in
    that path."""
    assert divmod(cc, 10) >= api.TRITON_MIN_CAPABILITY and cc not in plan.CLUSTER_CAPABILITIES
    for T in (1, 4096):
        text = _lowered(None, T, cc=cc)
        ((name, operands),) = LIBRARY_CALL.findall(text)
        call = next(line for line in text.splitlines() if f"stablehlo.custom_call @{name}(" in line)
        attrs = launch_attributes(call)
        launch = plan.make(16, T, 8, 7168, **PRODUCTION).launch  # clusters=False: the counters' configuration
        assert attrs["entry"] == launch.kernel == "sync_kernel"
        assert dict(launch.constexprs)["RELOAD"] is (T > 64)
        assert attrs["block"] == (32 * launch.num_warps, 1, 1) and attrs["grid"] == (*launch.grid, 1, 1)[:3]
        assert attrs["cluster"] == (0, 0, 0) and attrs["pdl"] is (cc >= plan.PDL_MIN_CAPABILITY)
        n_arrays = operands.count("%") - 1  # the counters' zeros operand last
        results = len(attrs["params"]) - n_arrays - 2  # Triton's two null pointers last
        assert inplace_pairs(call) == [(n_arrays, results - 1)], "the counters: the zeros operand, read in place"
        assert elf_arch(pathlib.Path(attrs["cubin"]).read_bytes()) == OTHER_ARCHS[cc]


@pytest.mark.parametrize(("variant", "T"), [(None, 1), ("row-w16", 3), ("sync-1024-w4-reload-r64", 80)])
def test_library_lowering_passes_the_own_partial_after_the_results(library_cache, variant, T):
    """partial= through the package's target: the partial is the seventh operand, its pointer
    the kernel's last (after the results, before Triton's two null pointers), no slot written
    (no dynamic-update-slice), the prefix still aliased."""
    text = _lowered(variant, T, own=9)
    ((name, operands),) = LIBRARY_CALL.findall(text)
    assert "dynamic_update_slice" not in text, "the partial written into the mailbox"
    assert re.search(r"%arg1: tensor<\d+x7168xbf16> \{tf\.aliasing_output = 0", text), "the donated prefix"
    call = next(line for line in text.splitlines() if f"stablehlo.custom_call @{name}(" in line)
    params = launch_attributes(call)["params"]
    B = ffi_launch.buffer
    n_in = operands.count("%")
    zeroed = variant == "sync-1024-w4-reload-r64"  # counters: a zeros operand after the partial
    assert n_in == 7 + zeroed, operands
    results = params[6:-3]
    assert params[:6] == [B(i) for i in range(6)] and results == [B(i) for i in range(n_in, n_in + len(results))]
    assert params[-3:] == [B(6), ffi_launch.NULL, ffi_launch.NULL], params
    if zeroed:
        assert inplace_pairs(call) == [(7, len(results) - 1)]


def test_jax_triton_launch_writes_the_own_partial_into_the_mailbox(cuda_triton_stand_ins):
    """jax_triton=True takes no operand after its results: the partial goes into a copy of the
    mailbox (a dynamic-update-slice), the kernel compiled without `own`."""
    text = _lowered("row-w16", 3, jax_triton=True, own=9)
    assert len(_jax_triton_calls(text)) == 1 and "dynamic_update_slice" in text, text[:3000]
    ptx = cuda_triton_stand_ins[-1]["ptx"]  # 9 pointers and Triton's 2 scratch pointers: no own partial
    assert "row_kernel_param_10" in ptx and "row_kernel_param_11" not in ptx


def test_library_lowering_compiles_each_kernel_once(library_cache):
    """Five token counts of the sync kernel (T is not a constant of it): one cubin (and no
    temporary or lock file left)."""
    for T in (1, 2, 3, 5, 8):
        _lowered(None, T)
    stored = [p.name for p in library_cache.iterdir()]
    assert [name.split("-")[0] for name in stored] == ["sync_kernel"] and stored[0].endswith(".cubin"), stored


def test_library_cache_dir_follows_platformdirs_unless_overridden(monkeypatch, tmp_path):
    """$OPROJ_JAX_CACHE_DIR/triton; unset or empty, platformdirs' user cache directory:
    $XDG_CACHE_HOME/oproj_jax/triton, else ~/.cache/oproj_jax/triton (Linux)."""
    from oproj_jax.triton import library

    monkeypatch.setenv("OPROJ_JAX_CACHE_DIR", str(tmp_path / "mine"))
    assert library.cache_dir() == tmp_path / "mine" / "triton"
    monkeypatch.setenv("OPROJ_JAX_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert library.cache_dir() == tmp_path / "xdg" / "oproj_jax" / "triton"
    monkeypatch.delenv("OPROJ_JAX_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if sys.platform == "linux":
        assert library.cache_dir() == tmp_path / "home" / ".cache" / "oproj_jax" / "triton"


def test_jax_triton_launch_refuses_pdl():
    from oproj_jax.triton import backend

    arrays = [jnp.zeros(s, jnp.bfloat16) for s in [(1, 1, 16), (1, 16), (1, 0, 16), (16,), (16,), (16,)]]
    with pytest.raises(ValueError, match=r"pdl: programmatic dependent launch needs the package's launch target"):
        backend.launch(*arrays, **PRODUCTION, jax_triton=True, pdl=True)


def test_unavailable_reasons_name_what_is_missing():
    """No CPU path; the default launch needs the package's FFI library, jax_triton=True the CUDA
    plugin's Triton kernel call."""
    from jaxlib import gpu_triton

    from oproj_jax import ffi
    from oproj_jax.triton import backend

    assert "no CPU or interpret path" in backend.unavailable_reason("cpu")
    assert backend.launch_reason() == (
        ffi.unavailable_reason()
        and f"the Triton kernels launch through the package's FFI library: {ffi.unavailable_reason()}"
    )
    if not hasattr(gpu_triton, "TritonKernelCall"):
        assert "JAX CUDA plugin" in backend.launch_reason(jax_triton=True)


# ---- the plan ---------------------------------------------------------------------------------


def test_default_rule_with_clusters():
    """Where the launch uses clusters: sync-1024-w4-cluster up to 64 tokens (7 programs a token at the
    production H), sync-2048-w8-cluster where H needs more than 8 programs of 1024 columns, from 65
    tokens sync-1024-w4-reload-cluster-r64, the rule without clusters past the programs' bound."""
    by_t = [plan.default_variant(t, 7168, clusters=True) for t in (1, 32, 33, 64, 65, 4096)]
    assert by_t == ["sync-1024-w4-cluster"] * 4 + ["sync-1024-w4-reload-cluster-r64"] * 2
    assert plan.default_variant(64, 8192, clusters=True) == "sync-1024-w4-cluster"  # 8 programs
    assert plan.default_variant(65, 8193, clusters=True) == plan.default_variant(65, 8193) == "sync-1024-w4-reload-r64"
    assert plan.default_variant(1, 8192, clusters=True) == "sync-1024-w4-cluster"  # 8 programs
    assert plan.default_variant(1, 8193, clusters=True) == "sync-2048-w8-cluster"
    assert plan.default_variant(1, 16385, clusters=True) == plan.default_variant(1, 16385) == "sync-1024-w4"
    assert plan.CLUSTER_CAPABILITIES == {90}
    for T in (1, 8, 64):
        for H in (256, 7168, 8193, 16384):
            launch = plan.make(16, T, 8, H, **PRODUCTION, clusters=True).launch
            assert launch.cluster == -(-H // plan.VARIANTS[plan.default_variant(T, H, True)].block) <= plan.CLUSTER_MAX


def test_default_rule_by_tokens():
    assert [plan.default_variant(t, 7168) for t in (1, 8, 9, 64, 65, 512, 513, 4096)] == [
        "sync-256-w1",
        "sync-256-w1",
        "sync-2048-w8",
        "sync-2048-w8",
        "sync-1024-w4-reload-r64",
        "sync-1024-w4-reload-r64",
        "sync-1024-w4-reload-r64",
        "sync-1024-w4-reload-r64",
    ]
    # sync-256-w1 would run 64 chunks: the first wider sync configuration that fits, 32 chunks of 512
    assert plan.default_variant(1, 16384) == "sync-512-w4"
    assert plan.default_variant(1, 16896) == "sync-1024-w4"  # 33 chunks of 512: too many
    assert plan.default_variant(1, 65537) == plan.WIDE_ROW.name  # no sync configuration fits, nor a row in registers
    assert plan.default_variant(512, 65537) == plan.WIDE_ROW.name
    assert plan.default_variant(4096, 32768) == "sync-1024-w4-reload-r64"  # 32 chunks
    assert plan.default_variant(4096, 32769) == "sync-2048-w8"  # 33 chunks of 1024: the wider one
    assert plan.default_variant(65536, 7168) == plan.ROW.name == "row-w16"  # more tokens than a sync grid takes
    for T in (1, 64, 512, 4096, 65536):  # every default is a configuration the plan accepts at that T and H
        for H in (256, 7168, 16384, 16896, 32768):
            plan.make(16, T, 8, H, **PRODUCTION, variant=plan.default_variant(T, H))
    assert all(plan.VARIANTS[name].name == name for name in plan.VARIANTS)
    # every configuration is one the rule takes at some shape, or a cluster configuration's counterpart
    shapes = [(T, H) for T in (1, 64, 512, 65536) for H in (7168, 16384, 16896, 32769, 65537)]
    taken = {plan.default_variant(T, H, clusters) for T, H in shapes for clusters in (False, True)}
    counterparts = {name.replace("-cluster", "") for name in taken if "-cluster" in name}
    assert taken | counterparts == set(plan.VARIANTS)
    # a sync program's thread holds 4 or 8 columns, the lengths of the kernel's FMA chains (its LANES)
    for name, variant in plan.VARIANTS.items():
        if variant.kind == "sync":
            launch = plan.make(16, 3, 8, 7168, **PRODUCTION, variant=name, clusters=variant.cluster).launch
            assert dict(launch.constexprs)["LANES"] == variant.block // (32 * variant.num_warps) in (4, 8), name


def test_plan_shapes():
    tile = plan.make(16, 3, 8, 7168, **PRODUCTION, variant="tile-512-w8")
    assert tile.launch.kernel == "tile_kernel" and tile.launch.grid == (3,) and tile.launch.num_warps == 8
    assert dict(tile.launch.constexprs)["SUB"] == 512 and dict(tile.launch.constexprs)["SOURCES"] == plan.SOURCES
    row = plan.make(16, 3, 8, 7168, **PRODUCTION, variant="row-w16")
    assert row.launch.grid == (3,) and dict(row.launch.constexprs)["BLOCK"] == 8192
    assert row.launch.options() == dict(num_warps=16, num_stages=1, enable_fp_fusion=False)
    assert row.stats_shape is row.arrivals_shape is tile.stats_shape is tile.arrivals_shape is None
    sync = plan.make(16, 3, 8, 7168, **PRODUCTION, variant="sync-512-w4")
    whole = sync.launch
    assert whole.kernel == "sync_kernel" and whole.grid == (14, 3) and whole.num_warps == 4  # chunks fastest
    assert sync.stats_shape == (3, 14, 2 * 8 + 3) and sync.arrivals_shape == (3, 2)
    assert dict(whole.constexprs)["PHASE"] == 0 and dict(whole.constexprs)["SPAN"] == 16
    # the records added in every thread up to plan.THREAD_SUMS_MAX_CHUNKS chunks, as tiles above
    assert dict(whole.constexprs)["CHUNKS"] == 14 and dict(whole.constexprs)["THREAD_SUMS"] is False
    for variant, chunks in (("sync-1024-w4-cluster", 7), ("sync-1024-w4", 7), ("sync-2048-w8", 4), ("sync-256-w1", 28)):
        constexprs = dict(plan.make(16, 3, 8, 7168, **PRODUCTION, variant=variant, clusters=True).launch.constexprs)
        assert constexprs["CHUNKS"] == chunks and constexprs["THREAD_SUMS"] is (chunks <= plan.THREAD_SUMS_MAX_CHUNKS)
        # a record of whole 16-byte words where every thread reads it four lanes at a time (each warp's
        # y.y from lane 20), one y.y lane where the tiles are reduced across the program
        warps = plan.VARIANTS[variant].num_warps
        thread_sums = constexprs["THREAD_SUMS"]
        assert constexprs["YY_WARPS"] == (warps if thread_sums else 0)
        assert constexprs["RECORD"] == (20 + (warps + 3) // 4 * 4 if thread_sums else 2 * 8 + 3)
    assert dict(plan.make(16, 3, 3, 7168, **PRODUCTION, variant="sync-512-w4").launch.constexprs)["ROWS"] == 4
    assert [dict(h.constexprs)["PHASE"] for h in sync.stages()] == [1, 2, 3]
    assert {h.grid for h in sync.stages()} == {whole.grid}
    assert tile.stages() == (tile.launch,) and row.stages() == (row.launch,)


def test_plan_refuses_unknown_and_oversized_variants():
    with pytest.raises(ValueError, match=r"variant: expected None or one of \[.*'row-w16'"):
        plan.make(16, 3, 8, 7168, **PRODUCTION, variant="row")
    with pytest.raises(ValueError, match="variant: 'row-w16' holds a row in registers.*take 'tile-512-w8'"):
        plan.make(16, 3, 8, 32768, **PRODUCTION, variant="row-w16")
    with pytest.raises(ValueError, match=r"variant: 'sync-256-w1' runs H / 256 programs per token .* at most 32"):
        plan.make(16, 3, 8, 8448, **PRODUCTION, variant="sync-256-w1")  # 33 chunks
    assert plan.make(16, 3, 8, 8192, **PRODUCTION, variant="sync-256-w1").launch.grid == (32, 3)
    with pytest.raises(
        ValueError, match=r"variant: 'sync-1024-w4' puts the tokens on the grid's second axis, T <= 65535"
    ):
        plan.make(16, 65536, 8, 7168, **PRODUCTION, variant="sync-1024-w4")
    assert plan.make(16, 65535, 8, 7168, **PRODUCTION, variant="sync-1024-w4").launch.grid == (7, 65535)
    with pytest.raises(ValueError, match=r"variant: 'sync-1024-w4-cluster' runs in thread block clusters, .* 9\.0"):
        plan.make(16, 3, 8, 7168, **PRODUCTION, variant="sync-1024-w4-cluster")  # clusters=False: jax-triton, sm_80
    with pytest.raises(ValueError, match=r"'sync-1024-w4-cluster' runs H / 1024 programs per token in one cluster"):
        plan.make(16, 3, 8, 9216, **PRODUCTION, variant="sync-1024-w4-cluster", clusters=True)  # 9 programs
    assert plan.make(16, 3, 8, 8192, **PRODUCTION, variant="sync-1024-w4-cluster", clusters=True).launch.cluster == 8
    assert "R <= 64" in plan.unsupported_reason(65) and plan.unsupported_reason(16) is None


# ---- the PyTorch entry's argument errors ------------------------------------------------------


def _tensors(**changes):
    torch = pytest.importorskip("torch")
    from oproj_jax import torch_ref

    x = {k: torch_ref.from_numpy(v) for k, v in configs.make_inputs(Config(2, 2, 1, H=256), seed=1).items()}
    for name, how in changes.items():
        x[name] = how(torch, x[name])
    return [x[k] for k in ARGS]


BAD = [
    ("dtype", dict(mailbox=lambda torch, t: t.float()), {}, TypeError, "mailbox: expected a bfloat16 torch.Tensor"),
    ("shape", dict(prefix=lambda torch, t: t[:1]), {}, ValueError, "prefix: expected shape (2, 256)"),
    ("blocks", dict(blocks=lambda torch, t: t.repeat(1, 9, 1)), {}, ValueError, "blocks: expected shape [T, NB, H]"),
    ("layout", dict(prefix=lambda torch, t: t.t().contiguous().t()), {}, ValueError, "prefix: expected a contiguous"),
    ("layout-norm", dict(norm=lambda torch, t: t.repeat(2)[::2]), {}, ValueError, "norm: expected a contiguous"),
    (
        "no-tokens",
        dict(mailbox=lambda torch, t: t[:, :0], prefix=lambda torch, t: t[:0], blocks=lambda torch, t: t[:0]),
        {},
        ValueError,
        "mailbox: expected R, T, H >= 1",
    ),
    ("device", {}, {}, ValueError, "mailbox: expected CUDA tensors"),
    ("option", {}, dict(groups=5), ValueError, "groups: expected 1 <= groups <= 4, got 5"),
    ("variant", {}, dict(variant="fast"), ValueError, "variant: expected None or one of"),
    (
        "ranks",
        dict(mailbox=lambda torch, t: t[:1].repeat(65, 1, 1)),
        {},
        ValueError,
        "mailbox: the Triton kernel unrolls",
    ),
]


@pytest.mark.parametrize(("changes", "options", "error", "text"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_torch_entry_names_the_bad_argument(changes, options, error, text):
    """Raised before anything launches (CPU tensors outside the interpreter are themselves an
    error, the last one checked)."""
    from oproj_jax.triton import torch_launch

    tensors = _tensors(**changes)
    before = [t.clone() for t in tensors]
    with pytest.raises(error) as info:
        torch_launch.consumer(*tensors, **options)
    assert str(info.value).startswith(text), str(info.value)
    assert all(a.equal(b) for a, b in zip(tensors, before)), "the call modified its arguments"


BAD_KEPT = [  # (what, the `arrivals` or `pdl` argument made from torch, the message's start)
    ("arrivals-type", dict(arrivals=lambda torch: [0, 0]), TypeError, "arrivals: expected None or a torch.Tensor"),
    (
        "arrivals-dtype",
        dict(arrivals=lambda torch: torch.zeros((2, 2), dtype=torch.int64)),
        ValueError,
        "arrivals: expected a contiguous int32 tensor on cpu",
    ),
    (
        "arrivals-layout",
        dict(arrivals=lambda torch: torch.zeros((2, 4), dtype=torch.int32)[:, ::2]),
        ValueError,
        "arrivals: expected a contiguous int32 tensor",
    ),
    (
        "arrivals-size",
        dict(arrivals=lambda torch: torch.zeros((1, 2), dtype=torch.int32)),
        ValueError,
        "arrivals: expected at least 2 * T = 4 counters",
    ),
    ("pdl", dict(pdl=lambda torch: True), ValueError, "pdl: programmatic dependent launch needs a CUDA GPU"),
]


@pytest.mark.parametrize(("made", "error", "text"), [b[1:] for b in BAD_KEPT], ids=[b[0] for b in BAD_KEPT])
def test_torch_entry_names_a_bad_counter_set_or_pdl(made, error, text):
    """The caller's arrival counters and the PDL request are checked before anything launches."""
    torch = pytest.importorskip("torch")
    from oproj_jax.triton import torch_launch

    tensors = _tensors()
    before = [t.clone() for t in tensors]
    with pytest.raises(error) as info:
        torch_launch.consumer(*tensors, **{name: make(torch) for name, make in made.items()})
    assert str(info.value).startswith(text), str(info.value)
    assert all(a.equal(b) for a, b in zip(tensors, before)), "the call modified its arguments"


BAD_PARTIAL = [  # (what, the partial made from the mailbox, rank, error, the message's start)
    ("dtype", lambda t: t[0].float(), 0, TypeError, "partial: expected None or a bfloat16 torch.Tensor [T, H]"),
    ("shape", lambda t: t[0, :1], 1, ValueError, "partial: expected shape [T, H] = (2, 256)"),
    ("rank", lambda t: t[0], 2, ValueError, "rank: expected 0 <= rank < R = 2"),
    ("rank-type", lambda t: t[0], 1.0, TypeError, "rank: expected a Python int"),
    ("rank-alone", lambda t: None, 1, ValueError, "rank: names the slot of `partial`, which is None"),
]


@pytest.mark.parametrize(
    ("made", "rank", "error", "text"), [b[1:] for b in BAD_PARTIAL], ids=[b[0] for b in BAD_PARTIAL]
)
def test_torch_entry_names_a_bad_partial(made, rank, error, text):
    from oproj_jax.triton import torch_launch

    tensors = _tensors()
    before = [t.clone() for t in tensors]
    with pytest.raises(error) as info:
        torch_launch.consumer(*tensors, partial=made(tensors[0]), rank=rank)
    assert str(info.value).startswith(text), str(info.value)
    assert all(a.equal(b) for a, b in zip(tensors, before)), "the call modified its arguments"


def test_arrival_counters_are_zero_and_sized_for_the_tokens():
    torch = pytest.importorskip("torch")
    from oproj_jax.triton import torch_launch

    counters = torch_launch.arrival_counters(5, "cpu")
    assert counters.shape == (5, 2) and counters.dtype == torch.int32 and not counters.any()


def test_torch_entry_refuses_an_old_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from oproj_jax.triton import torch_launch

    class OnOldGPU:  # what _check_launchable reads of a tensor
        shape = (2, 2, 256)
        device = types.SimpleNamespace(type="cuda")

        def is_contiguous(self):
            return True

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 5))
    with pytest.raises(
        ValueError, match=r"mailbox: device .* has compute capability 7\.5; the Triton kernel needs 8\.0"
    ):
        torch_launch._check_launchable(torch, dict.fromkeys(ARGS, OnOldGPU()))


# ---- the GPU benchmark script, what runs without a GPU ----------------------------------------


def test_benchmark_script_without_a_gpu_records_every_step_as_skipped(tmp_path):
    try:
        if jax.devices("gpu"):
            pytest.skip("a GPU is here: the script checks and times for real (it runs on the GPU machine)")
    except RuntimeError:
        pass  # no GPU: the case this test is about
    script = benchmark_script("triton_gpu")
    assert script.main(["--allow-cpu", "--out", str(tmp_path), "--tokens", "1,4096", "--budget", "30"]) == 0
    (path,) = tmp_path.glob("*-triton.json")
    records = json.loads(path.read_text())
    assert records[0]["kind"] == "header" and "triton" in records[0]["backends"]
    skipped = [r for r in records[1:] if r["kind"] == "skipped"]
    assert [(r["T"], r["variant"]) for r in skipped] == [(T, plan.default_variant(T, 7168)) for T in (1, 4096)]
    assert all("no CPU or interpret path" in r["reason"] for r in skipped)


def test_spread_tokens_checks_a_sample_of_tokens():
    """testing.spread_tokens (the GPU checks at large T): the first and last token among an even
    spread, the arrays cut consistently, so check_result of the reference passes on the cut."""
    from oproj_jax import reference

    config = Config(2, 40, 1, groups=1, H=256, xmoe_replicas=1)
    x = configs.make_inputs(config, seed=2)
    result = reference.consumer(*(jnp.asarray(x[k]) for k in ARGS), **EPS, **config.options())
    cut, inputs, got = testing.spread_tokens(config, x, tuple(np.asarray(r) for r in result), 8)
    assert cut.T == 8 and inputs["mailbox"].shape == (2, 8, 256) and got[2].shape == (1, 8, 256)
    np.testing.assert_array_equal(testing.bits(inputs["prefix"][[0, -1]]), testing.bits(x["prefix"][[0, -1]]))
    testing.check_result(cut, inputs, got, **EPS)
    assert testing.spread_tokens(config, x, result, 64)[0] is config
