"""Ahead-of-time build of the CuTe consumer kernels: sm_90a cubins + manifest.json.

Runs on any machine with `nvidia-cutlass-dsl` (4.8.1, no GPU or driver needed):

    python -m oproj_jax.cute.build                      # the default set, into the package dir
    python -m oproj_jax.cute.build --out DIR --all      # same, into DIR
    python -m oproj_jax.cute.build --key 16,8,1,4,0,0   # R,NB,has_delta,groups,reps,twoshot

How cubins reach a GPU machine: the GPU machine has no DSL (and the wheel is too big to
carry), so the kernels are built here and shipped as files. Either build into the package
directory `oproj_jax/cute/cubins/` (git-ignored, declared package data, so an installed wheel
or a carried checkout has them), or build into any directory, copy it over, and point
$OPROJ_JAX_CUBIN_DIR at it. oproj_jax.cute.manifest resolves the directory the same way.

The default set: every key the GPU checks and benchmarks use (oproj_jax.configs.GPU_CHECKS,
BENCH) plus the production family R=16 x NB 0..8 x has_delta both x groups 1..4 x xmoe 0/1
(oneshot), each compiled as every build of manifest.BUILDS (the thread layout and the launch
bound; the backend picks by mode and T). About 470 cubins, 1-3 s each;
`--jobs` compiles in parallel processes. Every build also compiles the publish kernel of
mode="peer" (cute/publish.py), recorded as the manifest's "publish" entry.
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
import json
import os
import re
import sys
import tempfile
import time
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from oproj_jax.cute import manifest as M

ARCH = "sm_90a"
ABI_ONESHOT = [".u64"] * 10 + [".f32", ".f32", ".u32", ".u32"]  # cute/ABI.md params 0..13
ABI_TWOSHOT = ABI_ONESHOT + [".u64", ".u64", ".u32"]  # params 14..16


def default_keys() -> list[dict]:
    from oproj_jax import configs

    keys = []
    for c in configs.GPU_CHECKS + configs.BENCH:
        keys.append(M.make_key(c.R, c.NB, c.has_delta, c.groups, c.xmoe_replicas, c.twoshot))
        if c.twoshot:  # the registry consumes a twoshot config's gathered row: a one-slot mailbox
            keys.append(M.make_key(1, c.NB, c.has_delta, c.groups, c.xmoe_replicas, False))
    for nb in range(9):
        for has_delta in (True, False):
            for groups in (1, 2, 3, 4):
                for reps in (0, 1):
                    keys.append(M.make_key(configs.TP, nb, has_delta, groups, reps, False))
    # mode="peer" (oproj_jax/cute/peer.py) on a 2-GPU group: its GPU tests (NB=0, no delta,
    # groups 1..4, xmoe 0/1) and the TP benchmark's shape (NB=8, has_delta, groups=4)
    for groups in (1, 2, 3, 4):
        for reps in (0, 1):
            keys.append(M.make_key(2, 0, False, groups, reps, False))
    keys.append(M.make_key(2, 8, True, 4, 0, False))
    unique = []
    for k in keys:
        if k not in unique:
            unique.append(k)
    return unique


def cubin_name(key: dict, build: M.Build = M.GROUPED) -> str:
    k = M.normalize_key(key)
    delta = "d" if k["has_delta"] else "nd"
    shot = "_twoshot" if k["twoshot"] else ""
    if build.fold:
        suffix = f"_f{build.min_ctas}" if build.min_ctas else "_f"
    else:
        suffix = f"_m{build.min_ctas}" if build.min_ctas else ""
    return f"oproj_R{k['R']}_NB{k['NB']}_{delta}_G{k['groups']}_x{k['xmoe_replicas']}{shot}{suffix}.cubin"


def ptx_params(ptx: str) -> list[str]:
    """The .param types of the (single) .entry in `ptx`, in order (e.g. ".u64")."""
    start = ptx.index(".entry")
    signature = ptx[start : ptx.index(")", start)]
    return re.findall(r"\.param\s+(\.\w+)", signature)


def compile_variant(key: dict, build: M.Build = M.GROUPED, trace: bool = False) -> dict:
    """Compile one variant; returns {"key", "entry", "dynamic_smem_bytes", ..., "cubin_bytes"}.
    `trace`: the phase-timer build (kernel.TRACE_MARKS; benchmarks/cute_phases.py), never shipped."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Uint32
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    from oproj_jax.cute.kernel import OprojConsumer

    k = M.normalize_key(key)
    kernel = OprojConsumer(
        k["R"],
        k["NB"],
        has_delta=k["has_delta"],
        groups=k["groups"],
        xmoe_replicas=k["xmoe_replicas"],
        twoshot=k["twoshot"],
        min_ctas=build.min_ctas,
        fold=build.fold,
        trace=trace,
    )

    def ptr(dtype, align):  # a fake device address: only the type reaches the kernel
        return make_ptr(dtype, 16, cute.AddressSpace.gmem, assumed_align=align)

    args = [ptr(BFloat16, 16) for _ in range(8)] + [ptr(Uint32, 4), ptr(Int32, 4)]
    args += [Float32(0.0), Float32(0.0), Int32(1), Int32(0)]
    launch = kernel.launch_oneshot
    if k["twoshot"]:
        args += [ptr(BFloat16, 16), ptr(BFloat16, 16), Int32(0)]
        launch = kernel.launch_twoshot
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(
            launch, *args, make_fake_stream(), options=f"--gpu-arch {ARCH} --keep-cubin --keep-ptx --dump-dir {dump}"
        )
        cubin, ptx = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    (entry,) = compiled.kernel_info.keys()
    if cubin[:4] != b"\x7fELF" or entry.encode() not in cubin:
        raise RuntimeError(f"{M.describe(k)}: the DSL did not return an ELF cubin with entry {entry}")
    params = ptx_params(ptx)
    expected = ABI_TWOSHOT if k["twoshot"] else ABI_ONESHOT
    if params != expected:
        raise RuntimeError(f"{M.describe(k)}: PTX params {params} differ from the ABI {expected}")
    return dict(
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


def compile_publish() -> dict:
    """The publish kernel of mode="peer" (cute/publish.py): one cubin for every R and T; returns
    the manifest's "publish" entry plus "cubin_bytes"."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from oproj_jax.cute import publish

    args = publish.compile_args()
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(
            publish.Publish().launch,
            *args,
            make_fake_stream(),
            options=f"--gpu-arch {ARCH} --keep-cubin --keep-ptx --dump-dir {dump}",
        )
        cubin, ptx = compiled.artifacts.CUBIN, compiled.artifacts.PTX
    (entry,) = compiled.kernel_info.keys()
    if cubin[:4] != b"\x7fELF" or entry.encode() not in cubin or publish.ENTRY_HINT not in entry.lower():
        raise RuntimeError(f"publish kernel: the DSL did not return an ELF cubin with entry {entry}")
    params = ptx_params(ptx)
    if params != publish.PUBLISH_PARAMS:
        raise RuntimeError(f"publish kernel: PTX params {params} differ from the ABI {publish.PUBLISH_PARAMS}")
    return dict(cubin=M.PUBLISH_CUBIN, entry=entry, block=[publish.THREADS, 1, 1], params=params, cubin_bytes=cubin)


def _compile_to(args) -> dict:
    key, build, out_dir = args
    t0 = time.time()
    result = compile_variant(key, build)
    name = cubin_name(key, build)
    (Path(out_dir) / name).write_bytes(result.pop("cubin_bytes"))
    result["cubin"] = name
    result["build_s"] = round(time.time() - t0, 2)
    return result


def _dsl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return "unknown"


def build_cubins(out_dir=None, keys=None, jobs: int | None = None, log=None, builds=M.BUILDS) -> dict:
    """Build `keys` (default: default_keys()), each compiled as every one of `builds`, into
    `out_dir` (default: manifest.default_dir()); writes the cubins and manifest.json; returns
    the manifest."""
    from oproj_jax.configs import HIDDEN

    out = Path(out_dir) if out_dir is not None else M.default_dir()
    out.mkdir(parents=True, exist_ok=True)
    keys = [M.normalize_key(k) for k in (keys if keys is not None else default_keys())]
    jobs = jobs or min(len(keys), max(1, (os.cpu_count() or 1)))
    t0 = time.time()
    builds = [M.Build(*b) for b in builds]
    work = [(k, b, str(out)) for k in keys for b in builds]
    if jobs > 1 and len(keys) > 1:
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
        # entries of another build of the kernel sources are dropped: one fingerprint per manifest
        if (
            old.get("arch") == ARCH
            and old.get("H") == HIDDEN
            and old.get("fingerprint") == M.source_fingerprint(_dsl_version())
        ):
            rebuilt = [(w[0], w[1]) for w in work]
            kept = [
                e
                for e in old.get("kernels", [])
                if (e["key"], M.entry_build(e)) not in rebuilt and (out / e["cubin"]).is_file()
            ]
    publish = compile_publish()  # ~2 s: always rebuilt, so it follows publish.py
    (out / publish["cubin"]).write_bytes(publish.pop("cubin_bytes"))
    manifest = {"arch": ARCH, "cutlass_dsl": _dsl_version(), "H": HIDDEN, "kernels": kept + built, "publish": publish}
    M.seal(manifest, out)  # the source fingerprint and every cubin's sha256 (manifest.py, "Integrity")
    (out / M.MANIFEST).write_text(json.dumps(manifest, indent=1))
    if log:
        log(
            f"built {len(built)} variants into {out} in {time.time() - t0:.1f} s "
            f"({len(kept)} kept from the old manifest)"
        )
    return manifest


def _parse_builds(text: str) -> tuple[M.Build, ...]:
    try:
        return tuple(M.parse_build(v) for v in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--builds: {err}") from None


def _parse_key(text: str) -> dict:
    parts = text.split(",")
    if len(parts) != 6:
        raise argparse.ArgumentTypeError(
            f"--key: expected R,NB,has_delta,groups,reps,twoshot (6 integers), got {text!r}"
        )
    try:
        R, NB, delta, groups, reps, twoshot = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--key: expected 6 integers, got {text!r}") from None
    if delta not in (0, 1) or twoshot not in (0, 1):
        raise argparse.ArgumentTypeError(f"--key: has_delta and twoshot must be 0 or 1, got {text!r}")
    return M.make_key(R, NB, bool(delta), groups, reps, bool(twoshot))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oproj_jax.cute.build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help=f"output directory (default: ${M.ENV_DIR} or the package's cubins/)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--all", action="store_true", help="the default set (default)")
    group.add_argument(
        "--key", type=_parse_key, action="append", help="R,NB,has_delta,groups,reps,twoshot (repeatable)"
    )
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile processes")
    parser.add_argument(
        "--builds",
        type=_parse_builds,
        default=M.BUILDS,
        help="how to compile each key, comma-separated: m<N> the grouped layout "
        "(128 * groups threads), f<N> the folded one (128 threads), N the "
        "launch bound in CTAs per SM, 0 = none (default: " + ",".join(b.tag for b in M.BUILDS) + ", manifest.BUILDS)",
    )
    args = parser.parse_args(argv)
    build_cubins(args.out, args.key, jobs=args.jobs, log=lambda s: print(s, file=sys.stderr), builds=args.builds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
