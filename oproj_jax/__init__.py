"""oproj_jax: the TP output-projection all-reduce consumer with Block AttnRes, for JAX.

Entry points: `consumer` (one rank's call on a complete mailbox), `tp_consumer` and
`tp_oproj_consumer` (the tensor-parallel layouts, inside a shard_map), `explain` and
`available_backends` (which backend a call gets, and why). The op and its numerics are defined
in docs/spec.md of the source distribution; `help(oproj_jax.consumer)` has the arguments.
"""

from importlib import metadata as _metadata
from pathlib import Path as _Path

from oproj_jax.api import ConsumerResult, available_backends, consumer, explain
from oproj_jax.options import Options
from oproj_jax.sharded import tp_consumer, tp_oproj_consumer

_DISTRIBUTION = "oproj-jax"  # the name pip installs it under (pyproject.toml)


def _source_version(pyproject: _Path) -> str | None:
    """The `[project] version` of a source checkout's pyproject.toml, or None without one."""
    import tomllib

    try:
        with pyproject.open("rb") as f:
            return tomllib.load(f)["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None


def _version() -> str:
    """The installed distribution's version; for a checkout on sys.path that is not installed,
    the version its pyproject.toml declares ("0+unknown" if neither is found)."""
    try:
        return _metadata.version(_DISTRIBUTION)
    except _metadata.PackageNotFoundError:
        return _source_version(_Path(__file__).resolve().parent.parent / "pyproject.toml") or "0+unknown"


__version__ = _version()

__all__ = [
    "ConsumerResult",
    "Options",
    "available_backends",
    "consumer",
    "explain",
    "tp_consumer",
    "tp_oproj_consumer",
]
