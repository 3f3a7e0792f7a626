"""The cubin manifest: where the prebuilt kernels live and which variant is which.

No CuTe DSL import here: the FFI side reads the manifest on machines without the DSL.

Directory: $OPROJ_JAX_CUBIN_DIR if set, else the package's `oproj_jax/cute/cubins/`.
`manifest.json` there (written by `oproj_jax.cute.build`):
  {"arch": "sm_90a", "cutlass_dsl": "4.8.1", "H": 7168,
   "kernels": [{"key": {...}, "cubin": "...", "entry": "...", "dynamic_smem_bytes": N,
                "block": [128*groups, 1, 1], "cluster": [7, 1, 1], "params": [".u64", ...]}]}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV_DIR = "OPROJ_JAX_CUBIN_DIR"
MANIFEST = "manifest.json"
KEY_FIELDS = ("R", "NB", "has_delta", "groups", "xmoe_replicas", "twoshot")
_BOOL_FIELDS = ("has_delta", "twoshot")


def default_dir() -> Path:
    """$OPROJ_JAX_CUBIN_DIR if set (and non-empty), else oproj_jax/cute/cubins/."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "cubins"


def make_key(R, NB, has_delta, groups, xmoe_replicas, twoshot) -> dict:
    """A normalized variant key; TypeError/ValueError naming the field on bad input."""
    return normalize_key(dict(R=R, NB=NB, has_delta=has_delta, groups=groups,
                              xmoe_replicas=xmoe_replicas, twoshot=twoshot))


def normalize_key(key) -> dict:
    if not isinstance(key, dict):
        raise TypeError(f"key: expected a dict with fields {KEY_FIELDS}, got {type(key).__name__}")
    missing = [f for f in KEY_FIELDS if f not in key]
    extra = [f for f in key if f not in KEY_FIELDS]
    if missing or extra:
        raise ValueError(f"key: expected exactly the fields {KEY_FIELDS}, missing {missing}, "
                         f"unexpected {extra}")
    out = {}
    for field in KEY_FIELDS:
        value = key[field]
        if field in _BOOL_FIELDS:
            if not isinstance(value, bool) and type(value).__name__ != "bool_":
                raise TypeError(f"key[{field!r}]: expected a bool, got {type(value).__name__} "
                                f"{value!r}")
            out[field] = bool(value)
        else:
            if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
                raise TypeError(f"key[{field!r}]: expected an int, got {type(value).__name__} "
                                f"{value!r}")
            out[field] = int(value)
    return out


def load_manifest(directory=None) -> dict:
    """Read manifest.json from `directory` (default: default_dir()). Adds "dir" (a str)."""
    directory = Path(directory) if directory is not None else default_dir()
    path = directory / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"no CuTe cubin manifest at {path}: build the kernels with "
            f"`python -m oproj_jax.cute.build --out {directory}` on a machine with "
            f"nvidia-cutlass-dsl (pip install oproj-jax[cute]), or point ${ENV_DIR} at a "
            f"directory that has them")
    manifest = json.loads(path.read_text())
    for field in ("arch", "H", "kernels"):
        if field not in manifest:
            raise ValueError(f"{path}: malformed manifest, field {field!r} missing")
    manifest["dir"] = str(directory)
    return manifest


# Every key is built twice, with these launch bounds (OprojConsumer.min_ctas): the unbounded
# build (64 registers at R16/G4, no spills: the lowest latency, 2 CTAs per SM) serves small T;
# the bound of 3 CTAs per SM (40 registers, a few spilled bytes) serves large T, where occupancy
# is the bandwidth. H200, R16 NB8 G4: T=1 3.2 vs 3.6 us, T=64 10.7 vs 11.1, T=4096 483 vs 422
# (benchmarks/results/2026-11-30-nvidia-h200-run4-sweep.json).
MIN_CTAS = (0, 3)
LARGE_T = 64  # T above this uses the min_ctas=3 build


def min_ctas_for(T: int) -> int:
    """The launch-bound build that serves a call with T tokens."""
    return MIN_CTAS[1] if T > LARGE_T else MIN_CTAS[0]


def find(manifest: dict, key, min_ctas: int = 0) -> dict | None:
    """The manifest entry for `key` (a dict of KEY_FIELDS) built with launch bound `min_ctas`,
    or None if that variant was not built."""
    wanted = normalize_key(key)
    for entry in manifest["kernels"]:
        if entry["key"] == wanted and entry.get("min_ctas", 0) == min_ctas:
            return entry
    return None


def cubin_path(manifest: dict, entry: dict) -> Path:
    return Path(manifest["dir"]) / entry["cubin"]


def describe(key) -> str:
    k = normalize_key(key)
    return (f"R={k['R']} NB={k['NB']} has_delta={k['has_delta']} groups={k['groups']} "
            f"xmoe_replicas={k['xmoe_replicas']} twoshot={k['twoshot']}")
