"""Ahead-of-time build of the CuTe consumer kernels: cubins + manifest.json, per arch (sm_90a, sm_100a).

Runs on any machine with `nvidia-cutlass-dsl` (4.8.1, no GPU or driver needed):

    python -m oproj_jax.cute.build                      # the default set, every arch, into the package dir
    python -m oproj_jax.cute.build --out DIR --all      # same, into DIR
    python -m oproj_jax.cute.build --key 16,8,1,4,0,0   # R,NB,has_delta,groups,reps,twoshot[,own]
    python -m oproj_jax.cute.build --arch sm_90a        # one arch only (repeatable)

Archs (manifest.ARCHS): sm_90a (compute capability 9.0: H100, H200) and sm_100a (10.0: B200,
GB200). Each arch has its own manifest with the same keys and file names: sm_90a's in the
output directory itself, sm_100a's in its subdirectory `sm_100a/` (manifest.arch_dir). The same
kernel source compiles for both (`--gpu-arch`); only sm_90a's cubins have run on a GPU so far.

How cubins reach a GPU machine: the GPU machine has no DSL (and the wheel is too big to
carry), so the kernels are built here and shipped as files. Either build into the package
directory `oproj_jax/cute/cubins/` (git-ignored, declared package data, so an installed wheel
or a carried checkout has them), or build into any directory, copy it over, and point
$OPROJ_JAX_CUBIN_DIR at it. oproj_jax.cute.manifest resolves the directory the same way.

Every cubin is the folded build (manifest.FOLDED), the one build every path launches. The
default set (default_set(); the argument for it: docs/cubins.md): the production family
R in {1, 2, 4, 8, 16} x NB 0..8 x has_delta both x groups 1..4 (as effective counts) x xmoe
0..3, oneshot, its own-partial variants at R = 16 (own_keys()) and the twoshot keys the GPU
tests and benchmarks run (twoshot_keys()): 1299 cubins; `--jobs` compiles in parallel
processes. A variant outside it compiles on first use where the DSL is installed
(cute/cache.py). Every build also compiles the publish kernel of mode="peer" (cute/publish.py),
recorded as the manifest's "publish" entry. Both archs get the whole default set
(docs/cubins.md, "Archs"): about 0.3 s and 29 KB (sm_90a) or 35 KB (sm_100a) per cubin.
R stays static: the polling loop is unrolled over the slots a group owns, and a runtime R
would cost registers and a dynamic loop on the critical path for no gain at the few R used.

Existing entries of a manifest in the output directory are kept unless rebuilt, so `--key`
adds one variant to a built set, as long as that manifest was built from the same kernel
sources (its fingerprint): otherwise they are dropped. The manifest records the source
fingerprint and each cubin's sha256; the backend refuses cubins that no longer match
(manifest.py, "Integrity").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import time
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from oproj_jax import abi
from oproj_jax.cute import manifest as M

# The primary arch (manifest.PRIMARY_ARCH): compile_variant's and compile_publish's default.
ARCH = "sm_90a"


# The production family, prebuilt. A deployment fixes R (its TP degree), groups (the summation
# order its prefix bits follow) and xmoe_replicas (its MoE layout), and then meets every NB (0..8
# completed blocks, by the layer's depth in its block) and both has_delta (a block's first
# layer or not) once per decode step; so the family is every (NB, has_delta) for every R,
# groups and xmoe_replicas a deployment may pick. groups 1..4 collapse to the effective
# counts (manifest.effective_groups): 14 (R, groups) pairs, 1008 keys.
FAMILY_R = (1, 2, 4, 8, 16)
FAMILY_GROUPS = (1, 2, 3, 4)
FAMILY_XMOE = (0, 1, 2, 3)
# The own-partial variants (consumer(partial=...)) prebuilt: the TP16 deployment's family, 288
# keys; another R's compile on first use.
OWN_R = (16,)


def _ident(key: dict) -> tuple:
    return tuple(key[f] for f in M.KEY_FIELDS)


def _unique(keys: list[dict]) -> list[dict]:
    """`keys` without repeats, in order."""
    seen, out = set(), []
    for key in keys:
        ident = _ident(key)
        if ident not in seen:
            seen.add(ident)
            out.append(key)
    return out


def production_keys() -> list[dict]:
    """The production family (FAMILY_*: every NB and has_delta), oneshot. The registry's twoshot
    layout consumes the gathered row as a one-slot mailbox: its keys are the family's R=1."""
    return _unique(
        [
            M.make_key(R, nb, has_delta, groups, reps, False)
            for R in FAMILY_R
            for groups in FAMILY_GROUPS
            for reps in FAMILY_XMOE
            for nb in range(9)
            for has_delta in (True, False)
        ]
    )


def own_keys() -> list[dict]:
    """The own-partial variants of the production family at OWN_R (kernel.py, "Own partial")."""
    return _unique([M.make_key(**dict(k, own=True)) for k in production_keys() if k["R"] in OWN_R])


def twoshot_keys() -> list[dict]:
    """The twoshot keys of configs.GPU_CHECKS and BENCH (consume_twoshot), prebuilt so that the
    GPU tests and benchmarks run them on a machine without the DSL; any other twoshot key
    compiles on first use. Their other keys (the gathered row a twoshot config's registry
    consumer reads is an R=1 key) and mode="peer"'s are in the production family."""
    from oproj_jax import configs

    checks = configs.GPU_CHECKS + configs.BENCH
    return _unique([M.make_key(c.R, c.NB, c.has_delta, c.groups, c.xmoe_replicas, True) for c in checks if c.twoshot])


def default_set() -> list[dict]:
    """The keys `python -m oproj_jax.build` prebuilds: the production family, own_keys() and
    twoshot_keys()."""
    return _unique(production_keys() + own_keys() + twoshot_keys())


def cubin_name(key: dict) -> str:
    """The file name of `key`'s cubin (the folded build: suffix _f)."""
    k = M.normalize_key(key)
    delta = "d" if k["has_delta"] else "nd"
    shot = "_twoshot" if k["twoshot"] else "_own" if k["own"] else ""
    return f"oproj_R{k['R']}_NB{k['NB']}_{delta}_G{k['groups']}_x{k['xmoe_replicas']}{shot}_f.cubin"


def ptx_params(ptx: str) -> list[str]:
    """The .param types of the (single) .entry in `ptx`, in order (e.g. ".u64")."""
    start = ptx.index(".entry")
    signature = ptx[start : ptx.index(")", start)]
    return re.findall(r"\.param\s+(\.\w+)", signature)


def consumer_kernel(key: dict, build: M.Build = M.GROUPED, trace: bool = False):
    """The OprojConsumer of a variant key and build (its constructor checks the ranges: a
    ValueError says why a key cannot be built). Imports the DSL."""
    from oproj_jax.cute.kernel import OprojConsumer

    k = M.normalize_key(key)
    return OprojConsumer(
        k["R"],
        k["NB"],
        has_delta=k["has_delta"],
        groups=k["groups"],
        xmoe_replicas=k["xmoe_replicas"],
        twoshot=k["twoshot"],
        own=k["own"],
        min_ctas=build.min_ctas,
        fold=build.fold,
        trace=trace,
    )


def compile_variant(
    key: dict, build: M.Build = M.GROUPED, trace: bool = False, with_ptx: bool = False, arch: str = ARCH
) -> dict:
    """Compile one variant for `arch` (manifest.ARCHS); returns {"key", "entry",
    "dynamic_smem_bytes", ..., "cubin_bytes"} (and "ptx", the PTX text, when `with_ptx`: tests
    read it). `trace`: the phase-timer build (kernel.TRACE_MARKS), never shipped."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64, Uint32
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    k = M.normalize_key(key)
    kernel = consumer_kernel(k, build, trace)

    def ptr(dtype, align):  # a fake device address: only the type reaches the kernel
        return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=align)

    args = [ptr(BFloat16, 16) for _ in range(8)] + [ptr(Uint32, 4), ptr(Int32, 4)]
    args += [Float32(0.0), Float32(0.0), Int32(1), Int32(0)]
    launch = kernel.launch_oneshot
    if not k["twoshot"]:
        args += [Int64(0), Int64(0), Int32(0)]  # control, own, own_slot
    else:
        args += [ptr(BFloat16, 16), ptr(BFloat16, 16), Int32(0)]
        launch = kernel.launch_twoshot
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(
            launch, *args, make_fake_stream(), options=f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir {dump}"
        )
        cubin, ptx = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    (entry,) = compiled.kernel_info.keys()
    if cubin[:4] != b"\x7fELF" or entry.encode() not in cubin:
        raise RuntimeError(f"{M.describe(k)}: the DSL did not return an ELF cubin with entry {entry}")
    params = ptx_params(ptx)
    expected = abi.ptx(abi.CONSUMER_TWOSHOT if k["twoshot"] else abi.CONSUMER_ONESHOT)
    if params != expected:
        raise RuntimeError(f"{M.describe(k)}: PTX params {params} differ from the ABI {expected}")
    extra = dict(ptx=ptx) if with_ptx else {}
    return dict(
        **extra,
        key=k,
        min_ctas=build.min_ctas,
        fold=build.fold,
        entry=entry,
        dynamic_smem_bytes=kernel.smem_bytes,
        block=[kernel.threads, 1, 1],
        cluster=[7, 1, 1],
        params=params,
        cubin_bytes=cubin,
    )


def compile_publish(arch: str = ARCH) -> dict:
    """The publish kernel of mode="peer" (cute/publish.py) for `arch`: one cubin for every R and T;
    returns the manifest's "publish" entry plus "cubin_bytes"."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from oproj_jax.cute import publish

    args = publish.compile_args()
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(
            publish.Publish().launch,
            *args,
            make_fake_stream(),
            options=f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir {dump}",
        )
        cubin, ptx = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    (entry,) = compiled.kernel_info.keys()
    if cubin[:4] != b"\x7fELF" or entry.encode() not in cubin or publish.ENTRY_HINT not in entry.lower():
        raise RuntimeError(f"publish kernel: the DSL did not return an ELF cubin with entry {entry}")
    params = ptx_params(ptx)
    if params != abi.ptx(abi.PUBLISH):
        raise RuntimeError(f"publish kernel: PTX params {params} differ from the ABI {abi.ptx(abi.PUBLISH)}")
    return dict(cubin=M.PUBLISH_CUBIN, entry=entry, block=[publish.THREADS, 1, 1], params=params, cubin_bytes=cubin)


def _compile_to(args) -> dict:
    key, out_dir, arch = args
    t0 = time.time()
    result = compile_variant(key, M.FOLDED, arch=arch)
    name = cubin_name(key)
    (Path(out_dir) / name).write_bytes(result.pop("cubin_bytes"))
    result["cubin"] = name
    result["build_s"] = round(time.time() - t0, 2)
    return result


@functools.cache
def dsl_version() -> str:
    """The installed nvidia-cutlass-dsl's version ("unknown" without it): part of every source
    fingerprint."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return "unknown"


def build_cubins(out_dir=None, keys=None, jobs: int | None = None, log=None, arch: str = ARCH) -> dict:
    """Build `keys` (default: default_set()) for `arch`, each as the folded build, into the cubin
    directory `out_dir` (default: manifest.default_dir()), in `arch`'s place there
    (manifest.arch_dir: sm_100a's in the subdirectory sm_100a/); writes the cubins and that
    arch's manifest.json; returns the manifest."""
    from oproj_jax.contract import HIDDEN

    out = M.arch_dir(arch, out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = default_set() if keys is None else [M.normalize_key(k) for k in keys]
    work = [(k, str(out), arch) for k in _unique(keys)]  # keys equal once groups are effective
    jobs = jobs or min(len(work), max(1, (os.cpu_count() or 1)))
    t0 = time.time()
    if jobs > 1 and len(work) > 1:
        # each worker imports the DSL once and compiles its share
        # forkserver: the caller may have JAX's threads running (forking those can deadlock)
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("forkserver")) as pool:
            built = list(pool.map(_compile_to, work, chunksize=max(1, len(work) // (4 * jobs))))
    else:
        built = [_compile_to(w) for w in work]
    kept = []
    old_path = out / M.MANIFEST
    if old_path.is_file():
        old = json.loads(old_path.read_text())
        # entries of another build of the kernel sources are dropped (one fingerprint per
        # manifest), and entries of a build other than FOLDED, which nothing launches
        if (
            old.get("arch") == arch
            and old.get("H") == HIDDEN
            and old.get("fingerprint") == M.source_fingerprint(dsl_version())
        ):
            rebuilt = {_ident(k) for k, _, _ in work}
            kept = [
                e
                for e in old.get("kernels", [])
                if M.entry_build(e) == M.FOLDED
                and _ident(M.normalize_key(e["key"])) not in rebuilt
                and (out / e["cubin"]).is_file()
            ]
    publish = compile_publish(arch)  # ~2 s: always rebuilt, so it follows publish.py
    (out / publish["cubin"]).write_bytes(publish.pop("cubin_bytes"))
    manifest = {"arch": arch, "cutlass_dsl": dsl_version(), "H": HIDDEN, "kernels": kept + built, "publish": publish}
    M.seal(manifest, out)  # the source fingerprint and every cubin's sha256 (manifest.py, "Integrity")
    (out / M.MANIFEST).write_text(json.dumps(manifest, indent=1))
    # the cubins of dropped entries (other sources or builds, keys no longer normalized that way) would
    # otherwise ship as package data next to the manifest that no longer lists them
    listed = {e["cubin"] for e in manifest["kernels"]}
    for orphan in out.glob("oproj_R*.cubin"):
        if orphan.name not in listed:
            orphan.unlink()
    if log:
        log(
            f"built {len(built)} {arch} variants into {out} in {time.time() - t0:.1f} s "
            f"({len(kept)} kept from the old manifest)"
        )
    return manifest


BUILD_ARCHS = tuple(M.ARCHS)  # what `python -m oproj_jax.build` builds: every arch


def build_all(out_dir=None, keys=None, jobs: int | None = None, log=None, archs=BUILD_ARCHS) -> dict[str, dict]:
    """build_cubins for each of `archs` into the cubin directory `out_dir`; arch -> its manifest."""
    return {arch: build_cubins(out_dir, keys, jobs=jobs, log=log, arch=arch) for arch in archs}


def _parse_key(text: str) -> dict:
    parts = text.split(",")
    if len(parts) not in (6, 7):
        raise argparse.ArgumentTypeError(
            f"--key: expected R,NB,has_delta,groups,reps,twoshot[,own] (6 or 7 integers), got {text!r}"
        )
    try:
        R, NB, delta, groups, reps, twoshot, own = (int(p) for p in [*parts, "0"][:7])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--key: expected 6 or 7 integers, got {text!r}") from None
    if delta not in (0, 1) or twoshot not in (0, 1) or own not in (0, 1):
        raise argparse.ArgumentTypeError(f"--key: has_delta, twoshot and own must be 0 or 1, got {text!r}")
    return M.make_key(R, NB, bool(delta), groups, reps, bool(twoshot), bool(own))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oproj_jax.cute.build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help=f"output directory (default: ${M.ENV_DIR} or the package's cubins/)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--all", action="store_true", help="the default set (default)")
    group.add_argument(
        "--key", type=_parse_key, action="append", help="R,NB,has_delta,groups,reps,twoshot[,own] (repeatable)"
    )
    parser.add_argument(
        "--arch",
        choices=list(M.ARCHS),
        action="append",
        help=f"the arch to build for (repeatable; default: every one, {', '.join(BUILD_ARCHS)})",
    )
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile processes")
    args = parser.parse_args(argv)
    archs = tuple(dict.fromkeys(args.arch)) if args.arch else BUILD_ARCHS
    build_all(args.out, args.key, jobs=args.jobs, log=lambda s: print(s, file=sys.stderr), archs=archs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
