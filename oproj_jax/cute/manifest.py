"""The cubin manifest: where the prebuilt kernels live and which variant is which.

No CuTe DSL import here: the FFI side reads the manifest on machines without the DSL.

Directory: $OPROJ_JAX_CUBIN_DIR if set, else the package's `oproj_jax/cute/cubins/`. One manifest
per arch (ARCHS): the primary arch's (sm_90a) is the directory's own `manifest.json`, every other
arch's is in a subdirectory named after it (`sm_100a/manifest.json`, its cubins beside it), same
schema and file names (arch_dir). Each `manifest.json` (written by `oproj_jax.cute.build`):
  {"arch": "sm_90a", "cutlass_dsl": "4.8.1", "H": 7168,
   "kernels": [{"key": {...}, "min_ctas": 0, "fold": true, "cubin": "...", "entry": "...",
                "dynamic_smem_bytes": N, "block": [128, 1, 1], "cluster": [7, 1, 1],
                "params": [".u64", ...]}],
   "publish": {"cubin": "oproj_publish.cubin", "entry": "...", "block": [128, 1, 1],
               "params": [...]},   (mode="peer"'s publish kernel, cute/publish.py)
   "fingerprint": "<sha256 hex>"}    (source_fingerprint: the sources the cubins were built from)
and every kernel entry (and "publish") carries "sha256", the hex digest of its cubin file.

Keys: make_key / normalize_key check the fields and replace `groups` by effective_groups (the
groups that own a slot), so every option with the same summation order finds the same cubin.

Integrity (seal() writes it, the checks below read it):
* `stale_reason(manifest)`: the manifest's fingerprint must equal source_fingerprint() of the
  installed sources with the manifest's DSL version; otherwise the cubins were built from other
  sources and the cute backend reports itself unavailable, naming the rebuild command. A
  manifest without a fingerprint (built before fingerprints) is stale too.
* What the fingerprint covers (fingerprint_sources()): the device code's import closure, i.e.
  FINGERPRINT_ROOTS (kernel.py, publish.py) and every `oproj_jax.*` module they import, directly
  or through each other (primitives.py, row_stats.py, oproj_jax/dsmem_ptx.py, ...), found by
  parsing their `import` statements with `ast` (imports inside functions included); plus the
  compile step's own definitions in build.py (COMPILE_DEFINITIONS: the arch, the argument types,
  the compile options) and the CuTe DSL version. The rest of build.py and what only it imports
  (the default set, configs' shape table) is not covered: editing it leaves the cubins valid.
  A package's __init__.py counts only where an import names the package itself (`from
  oproj_jax.cute import X` with X not a module).
* `verified_cubin_path(manifest, entry)`: a cubin whose sha256 differs from its entry's (edited,
  truncated, swapped) is refused with a ValueError naming the file and the rebuild command. Each
  file is hashed once per process (again only if its size or mtime changes), when first used.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import NamedTuple

ENV_DIR = "OPROJ_JAX_CUBIN_DIR"
MANIFEST = "manifest.json"
KEY_FIELDS = ("R", "NB", "has_delta", "groups", "xmoe_replicas", "twoshot", "own")
_BOOL_FIELDS = ("has_delta", "twoshot", "own")
OPTIONAL_FIELDS = {"own": False}  # a key may leave these out: the value here


PACKAGE_DIR = Path(__file__).resolve().parent / "cubins"  # resolved once: asked for on every call
SOURCE_DIR = Path(__file__).resolve().parent
PACKAGE = "oproj_jax"
PACKAGE_ROOT = SOURCE_DIR.parent.parent  # the directory that holds oproj_jax/
# The modules whose code becomes the cubins; their `oproj_jax.*` imports are followed ("Integrity").
FINGERPRINT_ROOTS = ("oproj_jax.cute.kernel", "oproj_jax.cute.publish")
# The build driver's module and its top-level definitions that decide what a compile emits; the
# rest of that module (the default set) is not fingerprinted.
COMPILE_MODULE = "oproj_jax.cute.build"
COMPILE_DEFINITIONS = ("ARCH", "consumer_kernel", "compile_variant", "compile_publish")
REBUILD_COMMAND = "python -m oproj_jax.build"  # cubins + manifest (and the FFI library)


# The archs the cubins are built for -> the CUDA compute capability of the devices that load
# them (an sm_XXa cubin runs on that one capability only). PRIMARY_ARCH's manifest is the cubin
# directory's own, every other arch's is in the subdirectory named after it (arch_dir).
ARCHS = {"sm_90a": "9.0", "sm_100a": "10.0"}
PRIMARY_ARCH = "sm_90a"


def default_dir() -> Path:
    """$OPROJ_JAX_CUBIN_DIR if set (and non-empty), else oproj_jax/cute/cubins/."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    return PACKAGE_DIR


def arch_dir(arch: str, directory=None) -> Path:
    """Where `arch`'s manifest and cubins are under the cubin directory `directory` (default:
    default_dir()): the directory itself for PRIMARY_ARCH, else its subdirectory `arch`."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {sorted(ARCHS)}, got {arch!r}")
    base = Path(directory) if directory is not None else default_dir()
    return base if arch == PRIMARY_ARCH else base / arch


def arch_for_capability(capability) -> str | None:
    """The arch whose cubins run on a device of this compute capability ("9.0" -> "sm_90a"), or None."""
    return next((arch for arch, cc in ARCHS.items() if cc == str(capability)), None)


def device_arch_name(capability) -> str:
    """The device's own arch name for a compute capability ("10.0" -> "sm_100", "12.0" -> "sm_120")."""
    try:
        major, minor = (int(part) for part in str(capability).split("."))
    except ValueError:
        return f"compute capability {capability}"
    return f"sm_{major}{minor}"


def unserved_reason(device, capability) -> str:
    """Why no CuTe cubin runs on `device` of this compute capability (one ARCHS has no arch for)."""
    built = ", ".join(f"{arch} (compute capability {cc})" for arch, cc in ARCHS.items())
    return (
        f"device {device} has compute capability {capability} ({device_arch_name(capability)}): no CuTe cubin "
        f"runs there; the CuTe kernel is built for {built} only"
    )


def built_archs(directory=None) -> list[str]:
    """The archs (ARCHS order) with a manifest.json under the cubin directory `directory`."""
    return [arch for arch in ARCHS if (arch_dir(arch, directory) / MANIFEST).is_file()]


def make_key(R, NB, has_delta, groups, xmoe_replicas, twoshot, own=False) -> dict:
    """A normalized variant key; TypeError/ValueError naming the field on bad input. `own`: the
    variant reads the caller's own partial in place of a slot (kernel.py, "Own partial")."""
    return normalize_key(
        dict(R=R, NB=NB, has_delta=has_delta, groups=groups, xmoe_replicas=xmoe_replicas, twoshot=twoshot, own=own)
    )


def normalize_key(key) -> dict:
    if not isinstance(key, dict):
        raise TypeError(f"key: expected a dict with fields {KEY_FIELDS}, got {type(key).__name__}")
    key = {**OPTIONAL_FIELDS, **key}
    missing = [f for f in KEY_FIELDS if f not in key]
    extra = [f for f in key if f not in KEY_FIELDS]
    if missing or extra:
        raise ValueError(f"key: expected exactly the fields {KEY_FIELDS}, missing {missing}, unexpected {extra}")
    out = {}
    for field in KEY_FIELDS:
        value = key[field]
        if field in _BOOL_FIELDS:
            if not isinstance(value, bool) and type(value).__name__ != "bool_":
                raise TypeError(f"key[{field!r}]: expected a bool, got {type(value).__name__} {value!r}")
            out[field] = bool(value)
        else:
            if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
                raise TypeError(f"key[{field!r}]: expected an int, got {type(value).__name__} {value!r}")
            out[field] = int(value)
    for field in ("R", "groups"):
        if out[field] < 1:
            raise ValueError(f"key[{field!r}]: expected an int >= 1, got {out[field]}")
    if out["own"] and out["twoshot"]:
        raise ValueError("key['own']: an own partial is read by one-shot variants only, got twoshot=True")
    out["groups"] = effective_groups(out["R"], out["groups"], out["twoshot"])
    return out


def effective_groups(R: int, groups: int, twoshot: bool = False) -> int:
    """The groups that own at least one slot: (R, groups) and (R, effective_groups) sum in the
    same order (docs/spec.md, "Summation order": it depends only on S = ceil(slots/groups)), so
    they give the same bits and share one cubin. A twoshot kernel polls one slot (the gather
    row): always 1.

    S' = ceil(slots/G') equals S for G' = ceil(slots/S): G' <= G gives S' >= S, and
    G' >= slots/S gives S' <= S."""
    slots = 1 if twoshot else R
    per_group = -(-slots // groups)
    return -(-slots // per_group)


def load_manifest(directory=None, arch: str | None = None) -> dict:
    """Read manifest.json from `directory` (default: default_dir()), or with `arch` the manifest of
    that arch under the cubin directory `directory` (arch_dir), which must record that arch.
    Adds "dir" (a str: where its cubins are)."""
    root = Path(directory) if directory is not None else default_dir()
    directory = root if arch is None else arch_dir(arch, root)
    path = directory / MANIFEST
    if not path.is_file():
        if arch is None:
            raise FileNotFoundError(
                f"no CuTe cubin manifest at {path}: build the kernels with "
                f"`python -m oproj_jax.cute.build --out {directory}` on a machine with "
                f"nvidia-cutlass-dsl (pip install oproj-jax[cute]), or point ${ENV_DIR} at a "
                f"directory that has them"
            )
        built = ", ".join(built_archs(root)) or "none"
        raise FileNotFoundError(
            f"no CuTe cubins for {arch} (compute capability {ARCHS[arch]}) in {root}: {path} is missing "
            f"(archs built there: {built}); build them with `{REBUILD_COMMAND}` (every arch) or "
            f"`python -m oproj_jax.cute.build --arch {arch} --out {root}` on a machine with nvidia-cutlass-dsl "
            f"(pip install oproj-jax[cute]), or point ${ENV_DIR} at a directory that has them"
        )
    manifest = json.loads(path.read_text())
    for field in ("arch", "H", "kernels"):
        if field not in manifest:
            raise ValueError(f"{path}: malformed manifest, field {field!r} missing")
    if arch is not None and manifest["arch"] != arch:
        raise ValueError(
            f"{path}: the manifest of {arch} records arch {manifest['arch']!r}; rebuild it with `{REBUILD_COMMAND}`"
        )
    manifest["dir"] = str(directory)
    return manifest


class Build(NamedTuple):
    """How a key is compiled: kernel.OprojConsumer's launch bound and thread layout, which
    build.compile_variant takes and every manifest entry records ("min_ctas", "fold")."""

    min_ctas: int = 0  # CTAs per SM the register allocation must allow (ptxas); 0 = no bound
    fold: bool = False  # 128 threads per CTA, one group doing every polling group's work


# The one build every path launches (ready mode, protocol mode, mode="peer", every T): the
# folded layout, no launch bound. Its one thread group polls and re-arms every slot itself
# (kernel.py, "FOLDED"): fewer threads than the grouped layout (128 * groups), no hand-off
# between groups and more resident clusters, faster at every T measured on the H200
# (docs/perf.md). The manifest and the compile-on-first-use cache hold only this build.
FOLDED = Build(0, fold=True)
# The kernel's grouped layout: never built or launched. It is named here only because it is the
# default `build` of build.consumer_kernel and build.compile_variant, whose source text is part
# of the cubin fingerprint (COMPILE_DEFINITIONS): editing it would make every manifest stale.
GROUPED = Build()


def entry_build(entry: dict) -> Build:
    return Build(int(entry.get("min_ctas", 0)), bool(entry.get("fold", False)))


def index(manifest: dict) -> dict:
    """key fields -> entry, for every FOLDED entry: build it once where lookups are frequent."""
    return {
        tuple(normalize_key(e["key"])[f] for f in KEY_FIELDS): e
        for e in manifest["kernels"]
        if entry_build(e) == FOLDED
    }


def find(manifest: dict, key, entries: dict | None = None) -> dict | None:
    """The manifest entry for `key` (a dict of KEY_FIELDS), or None if that variant was not
    built. `entries`: index(manifest), if the caller keeps one."""
    entries = index(manifest) if entries is None else entries
    k = normalize_key(key)
    return entries.get(tuple(k[f] for f in KEY_FIELDS))


PUBLISH_CUBIN = "oproj_publish.cubin"


def find_publish(manifest: dict) -> dict | None:
    """The publish kernel's entry (mode="peer"), or None if the manifest has none."""
    return manifest.get("publish")


def cubin_path(manifest: dict, entry: dict) -> Path:
    return Path(manifest["dir"]) / entry["cubin"]


def describe(key) -> str:
    k = normalize_key(key)
    return (
        f"R={k['R']} NB={k['NB']} has_delta={k['has_delta']} groups={k['groups']} "
        f"xmoe_replicas={k['xmoe_replicas']} twoshot={k['twoshot']}" + (" own=True" if k["own"] else "")
    )


# ---- integrity ------------------------------------------------------------------------------


def source_fingerprint(dsl_version: str, root: str | os.PathLike | None = None) -> str:
    """sha256 (hex) over the CuTe DSL version and the sources a manifest's cubins are built from
    (fingerprint_sources: each file's path, then its bytes, or the definition's source text),
    read under `root`, the directory holding oproj_jax/ (default: this installation's, hashed
    once per process and version)."""
    if root is None:
        return _installed_fingerprint(dsl_version)
    return _fingerprint(dsl_version, Path(root))


@functools.lru_cache(maxsize=8)
def _installed_fingerprint(dsl_version: str) -> str:
    return _fingerprint(dsl_version, PACKAGE_ROOT)


def _fingerprint(dsl_version: str, root: Path) -> str:
    digest = hashlib.sha256(f"cutlass_dsl={dsl_version}\0".encode())
    for name, text in _sources(root):
        digest.update(f"{name}\0".encode())
        digest.update(text)
        digest.update(b"\0")
    return digest.hexdigest()


def fingerprint_sources(root: str | os.PathLike | None = None) -> list[str]:
    """What source_fingerprint hashes, in order: the files of the device code's import closure
    (paths relative to `root`, default this installation's) and the compile definitions
    ("oproj_jax/cute/build.py:compile_variant"); "(missing)" marks one that was not found."""
    return [name for name, _ in _sources(Path(root) if root is not None else PACKAGE_ROOT)]


def _module_file(root: Path, module: str) -> Path | None:
    """The file of `module` (dotted, under `root`): a module's .py or a package's __init__.py."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_modules(tree: ast.AST, module: str, is_package: bool, root: Path) -> list[str]:
    """The `oproj_jax.*` modules that the statements of `tree` (of `module`) import: for `from A
    import b`, A.b where that is a module, else A itself. Relative imports are resolved."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(sub if alias.name != "*" and _module_file(root, sub) else base)
    return [m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")]


def _closure(root: Path, roots, definitions: list[ast.AST], module_of_definitions: str) -> list[str]:
    """The modules `roots` and `definitions` (nodes of `module_of_definitions`) import, directly
    or through each other, `roots` included; sorted."""
    seen: set[str] = set()
    pending = list(roots)
    for node in definitions:
        pending += _imported_modules(node, module_of_definitions, False, root)
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(root, module)
        if path is not None:
            tree = ast.parse(path.read_bytes(), str(path))
            pending += _imported_modules(tree, module, path.name == "__init__.py", root)
    return sorted(seen)


def _sources(root: Path) -> list[tuple[str, bytes]]:
    """(name, bytes) of every source the fingerprint covers, in a fixed order ("Integrity")."""
    definitions, texts = [], []
    build_path = _module_file(root, COMPILE_MODULE)
    build_name = COMPILE_MODULE.replace(".", "/") + ".py"
    if build_path is not None:
        text = build_path.read_text()
        nodes = {}
        for node in ast.parse(text, str(build_path)).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                nodes[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                nodes.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        for name in COMPILE_DEFINITIONS:
            node = nodes.get(name)
            if node is not None:
                definitions.append(node)
                texts.append((f"{build_name}:{name}", ast.get_source_segment(text, node).encode()))
            else:
                texts.append((f"{build_name}:{name} (missing)", b""))
    else:
        texts.append((f"{build_name} (missing)", b""))
    out = []
    for module in _closure(root, FINGERPRINT_ROOTS, definitions, COMPILE_MODULE):
        path = _module_file(root, module)
        if path is None:
            out.append((module.replace(".", "/") + ".py (missing)", b""))
        else:
            out.append((path.relative_to(root).as_posix(), path.read_bytes()))
    return out + texts


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def seal(manifest: dict, directory) -> dict:
    """Records the source fingerprint (with manifest["cutlass_dsl"]) and every cubin's sha256
    (kernels and publish) in `manifest`, whose cubins are in `directory`; returns it."""
    directory = Path(directory)
    for entry in list(manifest.get("kernels", ())) + ([manifest["publish"]] if manifest.get("publish") else []):
        entry["sha256"] = file_sha256(directory / entry["cubin"])
    manifest["fingerprint"] = source_fingerprint(str(manifest.get("cutlass_dsl", "unknown")))
    return manifest


def stale_reason(manifest: dict) -> str | None:
    """None if the manifest was built from the installed kernel sources, else why it is stale
    and the command that rebuilds it."""
    where = manifest.get("dir", "the cubin directory")
    recorded = manifest.get("fingerprint")
    if recorded is None:
        return (
            f"the cubin manifest in {where} records no source fingerprint (built by an older "
            f"oproj_jax.cute.build), so its cubins cannot be matched to the installed kernel; "
            f"rebuild them with `{REBUILD_COMMAND}`"
        )
    version = str(manifest.get("cutlass_dsl", "unknown"))
    if recorded != source_fingerprint(version):
        return (
            f"the cubins in {where} are stale: their manifest's source fingerprint differs from the "
            f"installed kernel sources ({', '.join(fingerprint_sources())} with CuTe DSL {version}); "
            f"rebuild them with `{REBUILD_COMMAND}`"
        )
    return None


_verified: set = set()  # (path, expected sha256, size, mtime_ns) of the cubins hashed and found intact
_verified_lock = threading.Lock()


def verified_cubin_path(manifest: dict, entry: dict, rebuild: str = REBUILD_COMMAND, otherwise: str = "") -> Path:
    """The path of `entry`'s cubin, once its bytes hash to the sha256 the manifest records; else a
    ValueError naming the file and `rebuild` (the command that rebuilds it), then `otherwise`
    (another fix, appended as written)."""
    path = cubin_path(manifest, entry)
    fix = f"rebuild it with `{rebuild}`{otherwise}"
    expected = entry.get("sha256")
    if not isinstance(expected, str):
        raise ValueError(
            f"cubin {path}: the manifest records no sha256 for it (built by an older oproj_jax.cute.build); {fix}"
        )
    try:
        stat = path.stat()
    except OSError as err:
        raise ValueError(f"cubin {path}: listed in the manifest but not readable ({err}); {fix}") from None
    stamp = (str(path), expected, stat.st_size, stat.st_mtime_ns)
    with _verified_lock:
        if stamp in _verified:
            return path
    actual = file_sha256(path)
    if actual != expected:
        raise ValueError(
            f"cubin {path}: its sha256 {actual} differs from the manifest's {expected} (the file "
            f"changed after the build); refusing to launch it: {fix}"
        )
    with _verified_lock:
        _verified.add(stamp)
    return path
