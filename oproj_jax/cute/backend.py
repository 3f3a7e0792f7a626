"""backend="cute": the CuTe-DSL kernel (prebuilt cubins, or compiled on first use where the DSL is
installed: cute/cache.py) launched from XLA through FFI.

Archs: the cubins are built per arch (cute/manifest.py ARCHS); a call takes those of its devices'
compute capability (device_arch: 9.0 -> sm_90a, 10.0 -> sm_100a). sm_100a is opt-in: api.py's
auto does not pick cute on a 10.0 device until its cubins have run on one (CUTE_AUTO_CAPABILITIES).

Three layers of entry point:

* `consumer(...)`: the registry function (same signature as every backend). The mailbox is an
  XLA array, complete at launch: the kernel runs in ready mode (reads it once; no polling, no
  re-arming, no sanitizing pass, the mailbox not aliased) and returns `ConsumerResult`.
* `consume(...)`: also returns the re-armed mailbox, the `hints` counter and the `status`
  word, takes `published=True` for producers that already publish sanitized data, and a
  bounded `timeout_us`; `check_status(result.status)` raises if polling gave up.
* `consume_twoshot(recv, gather, ..., me=...)`: the twoshot kernel ABI.

Lamport mailbox and XLA. The kernel polls each 32-bit mailbox word until it is not the
sentinel 0x80000000 (the bf16 pair (+0.0, -0.0)), then re-arms it (stores the sentinel back).
Data computed by XLA may hold real -0.0 values that would read as "not published yet", so by
default the mailbox is sanitized first. That pass reads and writes the whole mailbox (R*T*H*4
bytes moved); but the kernel updates the mailbox in place (input_output_aliases), so when the
caller does not donate the mailbox XLA has to copy it anyway, and the sanitizing pass *is* that
copy. With `published=True` (sanitized data, or slots still being written by a producer on
another stream) nothing runs before the kernel, and a donated mailbox is polled in place.

`status` and `hints` are [1]-element buffers passed in and returned; the kernel only sets
status (nonzero: a slot stayed empty for `timeout_us` microseconds) and adds to hints, so
carry them through a loop and check status once at the end, or pass None for fresh zeros.
The host cannot see status before the call's stream has run: read it when you sync.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oproj_jax import abi
from oproj_jax import ffi, launch
from oproj_jax.cute import cache
from oproj_jax.contract import HIDDEN, ConsumerResult, Dims, check_arguments
from oproj_jax.cute import manifest as cute_manifest
from oproj_jax.options import DEFAULTS, Options, takes_options
from oproj_jax.reference import with_partial, without_negative_zero

MAX_TOKENS = 65535  # grid.y
MAX_RANKS = 16  # mailbox slots the kernel sums (cute/kernel.py; the publish kernel's destinations too)
# named in every limit's reason: what takes a shape the cubins do not
OTHERS = "backend='pallas' (H % 256 == 0) or 'triton' (R <= 64) on a GPU, or 'reference' anywhere, takes it"
BUILD_COMMAND = "python -m oproj_jax.build"
# Every wait on another stream or GPU is bounded in wall time (the kernel's %globaltimer): a slot
# that is never published becomes a status code, not a hung GPU. One second is far above any
# real producer skew and above a first call's allocations on other devices.
DEFAULT_TIMEOUT_US = 1_000_000
_STATUS = {abi.STATUS_MAILBOX: "a mailbox / gather-row slot", abi.STATUS_RECV: "a twoshot receive slot"}
ONESHOT_PARAMS = len(abi.CONSUMER_ONESHOT)
TWOSHOT_PARAMS = len(abi.CONSUMER_TWOSHOT)


class CuteResult(NamedTuple):
    prefix: jax.Array  # [T, H] bf16, updated
    output: jax.Array  # [T, H] bf16
    xmoe: jax.Array | None  # [reps, T, H] bf16, None when reps == 0
    mailbox: jax.Array  # [R, T, H] bf16 (twoshot: the gather row [1, T, H]), re-armed to the sentinel
    hints: jax.Array  # [1] u32: the counter passed in + one per publishing warp
    status: jax.Array  # [1] i32: 0, or nonzero if polling gave up (sticky)


class CuteTwoshotResult(NamedTuple):
    prefix: jax.Array  # [T, H] bf16, updated
    output: jax.Array  # [T, H] bf16
    xmoe: jax.Array | None  # [reps, T, H] bf16, None when reps == 0
    gather: jax.Array  # [1, T, H] bf16, re-armed
    recv: jax.Array  # [R, T, H/R] bf16, re-armed
    hints: jax.Array  # [1] u32
    status: jax.Array  # [1] i32


# ---- manifest ------------------------------------------------------------------------------


def kernel_key(R: int, NB: int, *, twoshot: bool, own: bool = False, **options) -> dict:
    """The manifest key of one cubin variant (cute/ABI.md) for the consumer's `options` (the
    missing ones at their defaults; eps and out_eps are kernel arguments, not part of the key),
    `groups` replaced by the effective count (manifest.effective_groups): options with the same
    summation order share a cubin. `own`: the variant that reads an own partial."""
    opts = Options.from_kwargs(options)
    return cute_manifest.make_key(R, NB, opts.has_delta, opts.groups, opts.xmoe_replicas, bool(twoshot), bool(own))


def _key_build_command(key: dict, arch: str = cute_manifest.PRIMARY_ARCH) -> str:
    fields = [k for k in cute_manifest.KEY_FIELDS if k not in cute_manifest.OPTIONAL_FIELDS or key[k]]
    flags = ",".join(str(int(key[k])) for k in fields)  # own: a 7th flag, only when set
    only = "" if arch == cute_manifest.PRIMARY_ARCH else f" --arch {arch}"
    return f"python -m oproj_jax.cute.build --key {flags}{only}"


# ---- the devices' arch ---------------------------------------------------------------------


@functools.cache
def _cuda_devices() -> tuple:
    """This process's CUDA devices (none: lowering for CUDA on a CPU machine). Asked once: every
    eager call looks up its kernel several times."""
    try:
        return tuple(jax.devices("cuda"))
    except RuntimeError:
        return ()


def device_arch() -> tuple[str | None, str]:
    """(the cubin arch of this process's CUDA devices, "") or (None, why no cubin serves them).
    The arch follows the compute capability (manifest.ARCHS: 9.0 -> sm_90a, 10.0 -> sm_100a); a
    process without CUDA devices (lowering for CUDA on a CPU machine) gets manifest.PRIMARY_ARCH."""
    archs: dict[str, object] = {}
    for device in _cuda_devices():
        capability = getattr(device, "compute_capability", None)
        arch = cute_manifest.arch_for_capability(capability)
        if arch is None:
            return None, cute_manifest.unserved_reason(device, capability)
        archs.setdefault(arch, device)
    if len(archs) > 1:
        devices = ", ".join(f"{device} ({arch})" for arch, device in archs.items())
        return (
            None,
            f"this process's CUDA devices need CuTe cubins of several archs ({devices}): run one arch per process",
        )
    return next(iter(archs), cute_manifest.PRIMARY_ARCH), ""


def _device_arch() -> str:
    """device_arch(), or its ValueError."""
    arch, why = device_arch()
    if arch is None:
        raise ValueError(why)
    return arch


@functools.lru_cache(maxsize=4)
def _parsed_manifest(directory: str, arch: str, stamp: tuple[int, int] | None) -> tuple[dict, dict]:
    del stamp  # the file's (mtime, size): part of the key only, so a rebuilt manifest is read again
    manifest = cute_manifest.load_manifest(directory, arch)
    return manifest, cute_manifest.index(manifest)


def _manifest(arch: str = cute_manifest.PRIMARY_ARCH) -> tuple[tuple[dict, dict] | None, str]:
    """((`arch`'s manifest, its index), its directory) or (None, why it is missing: the archs
    built and the build command). Parsed and indexed once per file version (~3 ms for the default
    set): every eager call asks for a kernel several times."""
    directory = cute_manifest.default_dir()
    where = cute_manifest.arch_dir(arch, directory)
    try:
        stat = (where / cute_manifest.MANIFEST).stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = None  # load_manifest raises the error that names the build command (never cached)
    try:
        return _parsed_manifest(str(directory), arch, stamp), str(where)
    except (FileNotFoundError, ValueError, OSError) as err:
        return None, str(err)


class _Kernel(NamedTuple):
    cubin: str  # absolute path
    entry: str
    smem: int
    block: int
    # [slots (R), NB, xmoe replicas] it is built for: consumer_launch checks the operands against it
    variant: tuple[int, int, int] | None = None
    cluster: tuple[int, int, int] = (7, 1, 1)  # CTAs per cluster: one cluster per token (cute/ABI.md)
    own: bool = False  # an own variant: reads param `own` in place of slot `own_slot` (kernel.py)


def _prebuilt(key: dict, arch: str) -> tuple[tuple[dict, dict] | None, str]:
    """((`arch`'s manifest, its entry for `key`), "") or (None, why no prebuilt cubin serves it: no
    manifest, a stale one, or the variant not in it)."""
    parsed, where = _manifest(arch)
    if parsed is None:
        return None, f"no CuTe cubins/manifest found ({where})"
    manifest, entries = parsed
    stale = cute_manifest.stale_reason(manifest)
    if stale:
        return None, stale
    entry = cute_manifest.find(manifest, key, entries)
    if entry is None:
        return None, f"no prebuilt CuTe cubin for key {cute_manifest.describe(key)} in {where} ({arch})"
    return (manifest, entry), ""


def _from_cache(key: dict, T: int, ready: bool, why: str, arch: str) -> str | None:
    """None if the cache serves `key` for `arch` (compiled there, or compiled on first use), else
    why not: `why` no prebuilt cubin serves it, and why none can be compiled."""
    cannot = cache.disabled_reason()
    if cannot:
        mode = "ready" if ready else "protocol"
        return f"{why} ({mode} mode, T={T}); build it with `{_key_build_command(key, arch)}`; {cannot}"
    if cache.cached(key, arch):
        return None
    rejected = cache.kernel_rejects(key)
    return f"{cute_manifest.describe(key)}: {rejected}" if rejected else None


def _kernel(key: dict, T: int, ready: bool, arch: str | None = None) -> _Kernel:
    """The cubin (manifest.FOLDED) for `key` and `arch` (default: device_arch(), the devices'),
    of a call with T tokens in ready or protocol mode (an error names both): the prebuilt one,
    else one compiled on first use (cute/cache.py: the CuTe DSL installed; cached on disk for
    later calls and processes), else a ValueError naming the key and the command that builds it.
    A prebuilt manifest must match the installed kernel sources (else it is passed over), and a
    cubin its recorded sha256 (manifest.py, "Integrity"; hashed once per process)."""
    arch = arch or _device_arch()
    found, why = _prebuilt(key, arch)
    rebuild = _key_build_command(key, arch)
    if found is not None:
        manifest, entry = found
        _check_abi(manifest, entry, key, rebuild)
        path = cute_manifest.verified_cubin_path(manifest, entry, rebuild)  # sha256, once
    else:
        cannot = _from_cache(key, T, ready, why, arch)
        if cannot:
            raise ValueError(cannot)
        manifest, entry, path = cache.kernel(key, why, rebuild, arch)
        _check_abi(manifest, entry, key, rebuild)
    return _Kernel(
        str(path),
        entry["entry"],
        int(entry["dynamic_smem_bytes"]),
        int(entry["block"][0]),
        (key["R"], key["NB"], key["xmoe_replicas"]),
        tuple(int(c) for c in entry["cluster"]),
        key["own"],
    )


def _check_abi(manifest: dict, entry: dict, key: dict, rebuild: str) -> None:
    want = TWOSHOT_PARAMS if key["twoshot"] else ONESHOT_PARAMS
    params, cluster = entry.get("params", ()), list(entry.get("cluster", ()))
    if len(params) != want or cluster != [7, 1, 1] or int(manifest["H"]) != HIDDEN:
        raise ValueError(
            f"cubin {entry['cubin']} ({cute_manifest.describe(key)}) does not follow cute/ABI.md: "
            f"expected {want} params, cluster [7, 1, 1], H {HIDDEN}; got {len(params)} params, "
            f"cluster {cluster}, H {manifest['H']}; rebuild it with `{rebuild}`"
        )


def _kernel_reason(key: dict, T: int, ready: bool) -> str | None:
    """None if _kernel(key, T, ready) serves the call (prebuilt and intact, or compiled on first
    use), else why not; compiles nothing."""
    arch, why = device_arch()
    if arch is None:
        return why
    found, why = _prebuilt(key, arch)
    if found is None:
        cannot = _from_cache(key, T, ready, why, arch)
        if cannot or not cache.cached(key, arch):
            return cannot
    try:  # a prebuilt or cached cubin: hashed (once per process), as the call would
        _kernel(key, T, ready, arch)
    except ValueError as err:
        return str(err)
    return None


# ---- registry interface --------------------------------------------------------------------


def _is_cuda(platform: str) -> bool:
    if platform == "cuda":
        return True
    if platform != "gpu":  # ROCm also calls itself "gpu": ask for CUDA devices explicitly
        return False
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def unavailable_reason(platform: str) -> str | None:
    if not _is_cuda(platform):
        archs = ", ".join(cute_manifest.ARCHS)
        return f"the CuTe kernel runs on NVIDIA CUDA GPUs ({archs}) only; the platform is {platform!r}"
    reason = ffi.unavailable_reason()
    if reason:
        return reason
    arch, why = device_arch()
    if arch is None:
        return why
    parsed, where = _manifest(arch)
    if parsed is None:
        reason = f"no CuTe cubins/manifest found ({where})" + (
            "" if BUILD_COMMAND in where else f"; `{BUILD_COMMAND}` builds cubins and library (no GPU needed)"
        )
    else:
        reason = cute_manifest.stale_reason(parsed[0])  # built from other kernel sources: names the rebuild
    if reason is None:
        return None
    cannot = cache.disabled_reason()  # without it every variant is compiled on first use
    return f"{reason}; {cannot}" if cannot else None


def unsupported_reason(dims: Dims, *, twoshot: bool = False, ready: bool = True, **options) -> str | None:
    """Why the cute backend cannot run this call, or None. ready: the registry's ready mode
    (an XLA-produced mailbox); consume/consume_twoshot run the polling protocol. `options`: the
    consumer's, the missing ones at their defaults."""
    return _launch_reason(dims) or _kernel_reason(
        kernel_key(dims.R, dims.NB, twoshot=twoshot, **options), dims.T, ready
    )


def _launch_reason(dims: Dims) -> str | None:
    """Why no cubin's launch fits these dimensions (whatever the variant), or None."""
    if dims.H != HIDDEN:
        return f"the CuTe cubins are built for H = {HIDDEN} only, got H = {dims.H}; {OTHERS}"
    if dims.T > MAX_TOKENS:
        return f"T = {dims.T} tokens exceeds the launch grid's y limit {MAX_TOKENS}; {OTHERS}"
    if dims.R > MAX_RANKS:
        return (
            f"R={dims.R}: the CuTe kernel sums at most {MAX_RANKS} mailbox slots (expected 1 <= R <= {MAX_RANKS}); "
            f"{OTHERS}"
        )
    return None


def explain_note(dims: Dims, **options) -> str | None:
    """What oproj_jax.explain adds when cute runs a call: that its cubin is not prebuilt and the
    first call compiles it (seconds, once; cached on disk), or that an earlier call did."""
    key = kernel_key(dims.R, dims.NB, twoshot=False, **options)
    arch = device_arch()[0] or cute_manifest.PRIMARY_ARCH
    if _prebuilt(key, arch)[0] is not None:
        return None
    if cache.cached(key, arch):
        return f"{cute_manifest.describe(key)} is not prebuilt; an earlier call compiled it into the cache"
    return f"{cute_manifest.describe(key)} is not prebuilt: the first call compiles it (seconds, once; cached on disk)"


def _supported_kernel(dims: Dims, opts: Options, *, twoshot: bool, ready: bool, own: bool = False) -> _Kernel:
    """The kernel that runs this call, or a ValueError with the reason the backend cannot (the
    reason unsupported_reason gives: _kernel raises what _kernel_reason returns, and compiles a
    variant that is only compilable)."""
    reason = _launch_reason(dims)
    if reason is None:
        try:
            return _kernel(kernel_key(dims.R, dims.NB, twoshot=twoshot, own=own, **opts.asdict()), dims.T, ready)
        except ValueError as err:
            reason = str(err)
    raise ValueError(f"backend 'cute' cannot run this call: {reason}")


READY_TIMEOUT_US = -1  # the kernel's ready mode: slots complete at launch, no poll, no re-arm
# Up to this many tokens the ready call enters XLA's command buffers through its record stage
# (a graph node with PDL edges); above, through stream capture (ffi.LAUNCH_TRACED_TARGET).
RECORD_MAX_T = ffi.RECORD_MAX_T


READS_PARTIAL = True  # consumer takes partial= and rank= (api.py)
GRAPH_NODE = True  # a kernel node up to RECORD_MAX_T tokens; consumer takes stream_capture= (api.py)


def partial_in_place(dims: Dims, **options) -> bool:
    """Whether `consumer(..., partial=...)` reads the partial in place (an own variant is
    prebuilt, cached or compilable here), else it is written into a copy of the mailbox first."""
    own_key = kernel_key(dims.R, dims.NB, twoshot=False, own=True, **options)
    return _launch_reason(dims) is None and _kernel_reason(own_key, dims.T, True) is None


def consumer(
    mailbox, prefix, blocks, norm, query, out_norm, *, partial=None, rank: int = 0, stream_capture=False, **options
) -> ConsumerResult:
    """The registry entry point (api.consumer has checked the arguments): the kernel in ready
    mode. The mailbox is an ordinary XLA array, complete before the launch, so there is nothing
    to poll and nothing to re-arm: it is read once and not aliased (no copy, no sanitizing pass;
    real -0.0 values are harmless, see kernel.py); the prefix is updated in place. `partial`
    [T, H] (or None) stands for slot `rank`: an own variant reads it in place (kernel.py, "Own
    partial"); where none is at hand (partial_in_place) it is written into a copy of the mailbox.
    `stream_capture`: the traced target at every T (api.consumer says when that is faster).
    Use `consume` for the Lamport protocol."""
    opts = Options.from_kwargs(options)
    dims = Dims(*mailbox.shape[:2], blocks.shape[1], mailbox.shape[2])
    _check_concrete_platform(mailbox, prefix, blocks)
    if partial is not None and not partial_in_place(dims, **opts.asdict()):
        mailbox, partial = with_partial(mailbox, partial, rank), None
    kernel = _supported_kernel(dims, opts, twoshot=False, ready=True, own=partial is not None)
    T, H = prefix.shape
    out_types = [
        jax.ShapeDtypeStruct((T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((opts.xmoe_replicas, T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((2,), jnp.uint32),
    ]
    # operands: mailbox 0, prefix 1, blocks 2, norm 3, query 4, out_norm 5[, partial 6]; then the
    # results: prefix, output, xmoe, scratch ([2] u32: the hints counter and the status word, never read)
    operands = (mailbox, prefix, blocks, norm, query, out_norm) + (() if partial is None else (partial,))
    b, n = launch.buffer, len(operands)
    own = launch.NULL if partial is None else b(6)
    kernel_launch = consumer_launch(
        kernel, tokens=T, variant=(dims.R, dims.NB, opts.xmoe_replicas), ready=True, twoshot=False, pdl=True,
        mailbox=b(0), prefix=b(n), blocks=b(2), norm=b(3), query=b(4), out_norm=b(5), output=b(n + 1),
        xmoe=b(n + 2), hints=b(n + 3, 0), status=b(n + 3, 4), eps=opts.eps, out_eps=opts.out_eps, T=T,
        timeout_us=READY_TIMEOUT_US, control=launch.NULL, own=own, own_slot=0 if partial is None else rank,
    )  # fmt: skip
    # jax.vmap runs one kernel call per batch element (the kernel has no batch dimension).
    new_prefix, output, xmoe, _ = launch.call(
        kernel_launch,
        operands,
        out_types,
        aliases={1: 0},
        inplace=[(1, 0)],
        traced=stream_capture or T > RECORD_MAX_T,
        vmap_method="sequential",
    )
    return ConsumerResult(new_prefix, output, xmoe if opts.xmoe_replicas else None)


# ---- the FFI calls ---------------------------------------------------------------------------


def _check_concrete_platform(*arrays) -> None:
    """Eagerly placed inputs must be on a CUDA device (under tracing, lowering decides)."""
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            platform = next(iter(x.devices())).platform
            if not _is_cuda(platform):
                raise ValueError(f"backend 'cute' cannot run here: {unavailable_reason(platform)}")


def _flags(hints, status):
    hints = jnp.zeros((1,), jnp.uint32) if hints is None else hints
    status = jnp.zeros((1,), jnp.int32) if status is None else status
    for name, x, dtype in (("hints", hints, jnp.uint32), ("status", status, jnp.int32)):
        if tuple(x.shape) != (1,) or jnp.dtype(x.dtype) != dtype:
            raise TypeError(f"{name}: expected a [1] {jnp.dtype(dtype).name} array, got {tuple(x.shape)} {x.dtype}")
    return hints, status


def check_timeout_us(timeout_us: Any) -> int:
    """The wait bound in microseconds: an int in [1, 2**31). There is no "wait forever": a wait
    on another stream or GPU always ends, in an error if nothing came."""
    if isinstance(timeout_us, (bool, np.bool_)) or not isinstance(timeout_us, (int, np.integer)):
        raise TypeError(f"timeout_us: expected an int (microseconds of wall time), got {type(timeout_us).__name__}")
    if not 1 <= timeout_us < 2**31:
        raise ValueError(
            f"timeout_us: expected 1 <= timeout_us < 2**31 microseconds (every wait is bounded), got {timeout_us}"
        )
    return int(timeout_us)


_VARIANT = ("slots (R)", "completed blocks (NB)", "xmoe replicas")


def consumer_launch(
    kernel: _Kernel, *, tokens: int, variant: tuple[int, int, int], ready: bool, twoshot: bool, pdl: bool, **values
) -> launch.Launch:
    """The consumer cubin's launch for one call (cute/ABI.md): grid (CTAs per token, tokens, 1)
    with the cubin's cluster, block and shared memory, and the parameters of abi.CONSUMER_ONESHOT
    (abi.CONSUMER_TWOSHOT) from `values` by name (launch.params). Where an operand holds no data
    (NB = 0: blocks; reps = 0: xmoe) the kernel reads nothing but wants a valid pointer: prefix's
    and output's. Refuses, before anything is launched, operands of another variant than the
    cubin's ([slots, NB, reps]: compile-time constants; others would be read or written out of
    bounds), more tokens than the slots hold (`T`), and a `timeout_us` of the other mode (< 0 is
    ready mode)."""
    for name, built, got in zip(_VARIANT, kernel.variant, variant):
        if built != got:
            raise ValueError(
                f"backend 'cute': the cubin {kernel.entry} is built for {name} = {built}, the operands have {got}"
            )
    if not 1 <= tokens <= values["T"]:
        raise ValueError(
            f"backend 'cute': {tokens} tokens, the slots hold T = {values['T']} (expected 1 <= tokens <= T)"
        )
    if (values["timeout_us"] < 0) != ready or values["timeout_us"] == 0:
        mode = "ready mode needs timeout_us < 0" if ready else "the protocol needs timeout_us > 0"
        raise ValueError(f"backend 'cute': {mode}, got {values['timeout_us']}")
    has_own = values.get("own", launch.NULL) != launch.NULL
    if has_own and not ready:
        raise ValueError("backend 'cute': an own partial is read in ready mode only (the protocol polls every slot)")
    if has_own != kernel.own:
        raise ValueError(
            f"backend 'cute': the cubin {kernel.entry} is {'an' if kernel.own else 'no'} own variant, "
            f'the call passes {"an" if has_own else "no"} own partial (kernel.py, "Own partial")'
        )
    _, NB, reps = variant
    values = dict(values, blocks=values["blocks"] if NB else values["prefix"])
    values["xmoe"] = values["xmoe"] if reps else values["output"]
    return launch.Launch(
        kernel.cubin,
        kernel.entry,
        grid=(kernel.cluster[0], tokens, 1),
        block=(kernel.block, 1, 1),
        cluster=kernel.cluster,
        smem=kernel.smem,
        pdl=pdl,
        params=launch.params(abi.CONSUMER_TWOSHOT if twoshot else abi.CONSUMER_ONESHOT, values),
    )


def _out_types(slots, prefix, xmoe_replicas, hints, status):
    T, H = prefix.shape
    bf16 = jnp.bfloat16
    return [
        jax.ShapeDtypeStruct(slots.shape, bf16),
        jax.ShapeDtypeStruct((T, H), bf16),
        jax.ShapeDtypeStruct((T, H), bf16),
        jax.ShapeDtypeStruct((xmoe_replicas, T, H), bf16),
        jax.ShapeDtypeStruct(hints.shape, hints.dtype),
        jax.ShapeDtypeStruct(status.shape, status.dtype),
    ]


# operand -> result: mailbox, prefix, hints, status are updated in place
_ALIASES = {0: 0, 1: 1, 6: 4, 7: 5}


def _consume(
    slots,  # the mailbox [R, T, H], or twoshot's gather row [1, T, H]
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    recv,  # consume_twoshot's [R, T, H/R] slots, None for consume
    me: int | None,
    defaults: Options,
    *,
    published: bool = False,
    timeout_us: int = DEFAULT_TIMEOUT_US,
    hints=None,  # [1] u32 or None (zeros)
    status=None,  # [1] i32 or None (zeros)
    pdl: bool = True,
    **options,
) -> CuteResult | CuteTwoshotResult:
    """consume and consume_twoshot: one call of the kernel in the polling protocol."""
    dims = check_arguments(slots, prefix, blocks, norm, query, out_norm, **options)
    opts = Options.from_kwargs(options, defaults)
    twoshot = recv is not None
    if twoshot:
        dims = _twoshot_dims(recv, me, slots, dims)
    extra = (recv,) if twoshot else ()  # an operand, and a result, after the status word
    timeout_us = check_timeout_us(timeout_us)
    _check_concrete_platform(*extra, slots, prefix, blocks)
    kernel = _supported_kernel(dims, opts, twoshot=twoshot, ready=False)
    hints, status = _flags(hints, status)
    if not published:
        extra = tuple(without_negative_zero(x) for x in extra)
        slots = without_negative_zero(slots)
    out_types = _out_types(slots, prefix, opts.xmoe_replicas, hints, status)
    out_types += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in extra]
    # operands: slots 0, prefix 1, blocks 2, norm 3, query 4, out_norm 5, hints 6, status 7[, recv 8];
    # results after them: slots, prefix, output, xmoe, hints, status[, recv]
    b, n = launch.buffer, 8 + len(extra)
    values = dict(
        mailbox=b(n), prefix=b(n + 1), blocks=b(2), norm=b(3), query=b(4), out_norm=b(5), output=b(n + 2),
        xmoe=b(n + 3), hints=b(n + 4), status=b(n + 5), eps=opts.eps, out_eps=opts.out_eps, T=dims.T,
        timeout_us=timeout_us,
    )  # fmt: skip
    if twoshot:  # one GPU: the gather target is the gather row itself
        values.update(recv=b(n + 6), gather=b(n), me=me)
    else:
        # no fail-stop words outside mode="peer"; no own partial in the protocol (every slot is polled)
        values.update(control=launch.NULL, own=launch.NULL, own_slot=0)
    kernel_launch = consumer_launch(
        kernel, tokens=dims.T, variant=(dims.R, dims.NB, opts.xmoe_replicas), ready=False, twoshot=twoshot, pdl=pdl,
        **values,
    )  # fmt: skip
    aliases = {**_ALIASES, 8: 6} if twoshot else _ALIASES
    out = launch.call(
        kernel_launch,
        (slots, prefix, blocks, norm, query, out_norm, hints, status, *extra),
        out_types,
        aliases=aliases,
        inplace=sorted(aliases.items()),  # every aliased operand is read in place
    )
    new_slots, new_prefix, output, xmoe, hints, status, *new_extra = out
    xmoe = xmoe if opts.xmoe_replicas else None
    if twoshot:
        return CuteTwoshotResult(new_prefix, output, xmoe, new_slots, *new_extra, hints, status)
    return CuteResult(new_prefix, output, xmoe, new_slots, hints, status)


def _twoshot_dims(recv, me, gather, dims: Dims) -> Dims:
    """The twoshot kernel's dimensions, R from `recv`; checks recv, me and the one-slot gather row."""
    if dims.R != 1:
        raise ValueError(f"gather: expected the one-slot gather row [1, T, H], got shape {tuple(gather.shape)}")
    if not hasattr(recv, "shape") or jnp.dtype(recv.dtype) != jnp.bfloat16 or len(recv.shape) != 3:
        raise TypeError(f"recv: expected a bf16 array [R, T, H/R], got {getattr(recv, 'shape', type(recv))}")
    R, T, cols = (int(d) for d in recv.shape)
    if T != dims.T or R < 1 or R * cols != dims.H:
        raise ValueError(
            f"recv: expected shape [R, T, H/R] with T={dims.T}, R*H/R = H = {dims.H}, got {tuple(recv.shape)}"
        )
    if isinstance(me, bool) or not isinstance(me, (int, np.integer)) or not 0 <= me < R:
        raise ValueError(f"me: expected a static int with 0 <= me < R = {R}, got {me!r}")
    return dims._replace(R=R)


TWOSHOT_DEFAULTS = dataclasses.replace(DEFAULTS, groups=1)  # the gather row is one slot: nothing to order


@takes_options(passes_on=_consume)
def consume(
    mailbox,  # [R, T, H] bf16: rank slots, polled then re-armed
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    **keywords,
) -> CuteResult:
    """The CuTe kernel on a oneshot mailbox; returns everything it writes (see module docstring).
    The other arrays and the options are oproj_jax.consumer's.

    `published=True`: the mailbox holds no -0.0 except in slots that are still to be published
    (e.g. by a producer on another stream): nothing is done to it before the kernel polls it.
    """
    return _consume(mailbox, prefix, blocks, norm, query, out_norm, None, None, DEFAULTS, **keywords)


@takes_options(TWOSHOT_DEFAULTS, passes_on=_consume)
def consume_twoshot(
    recv,  # [R, T, H/R] bf16: every rank's partial of this rank's column slice; polled, re-armed
    gather,  # [1, T, H] bf16: the gather row; columns owned by other ranks are polled, re-armed
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    *,
    me: int,
    **keywords,
) -> CuteTwoshotResult:
    """Twoshot: reduce this rank's slice of `recv` (rank order) into the gather row, then consume it.

    `me` (static int) owns columns [me*H/R, (me+1)*H/R). On one GPU the gather target is the
    gather row itself; the other ranks' columns must already be (or later get) published there.
    The other arrays and the options are oproj_jax.consumer's; `groups` defaults to 1.
    """
    return _consume(gather, prefix, blocks, norm, query, out_norm, recv, me, TWOSHOT_DEFAULTS, **keywords)


def check_status(status) -> None:
    """Raises RuntimeError if the kernel's status word (a [1] i32 result) reports that polling gave up.

    Reading it waits for the call to finish (a device -> host copy).
    """
    code = int(np.asarray(status).reshape(-1)[0])
    if code != 0:
        what = _STATUS.get(code, "unknown code")
        raise RuntimeError(
            f"CuTe consumer: polling gave up (status {code}: {what}): a slot was not published "
            "within timeout_us microseconds; the outputs of that call are not valid (with "
            "published=True the kernel polls the mailbox in place: a jitted caller must donate "
            "it, or XLA hands the kernel a copy that no producer writes)"
        )
