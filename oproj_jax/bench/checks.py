"""Correctness of a backend on fresh random data, with poisoned outputs.

"Poisoning the output" of a functional JAX call means two things here:
  * the prefix is donated (`donate_argnums`): the updated prefix may be written into the very
    buffer that holds the old prefix, as in a decode loop, so a backend that reads a prefix
    element after overwriting it shows up;
  * the output buffers are stale garbage: a first call on all-NaN inputs (bit pattern 0xFFFF,
    never the 0x80000000 mailbox sentinel) fills same-sized buffers with NaNs, they are freed,
    and so are a few NaN-filled buffers of the same sizes (best-fit allocators hand such memory
    to the next same-sized request), then the real call runs; any output element the backend
    fails to write stays NaN (`out_nonfinite`). `poison_reused` says how many of the real
    call's output buffers sit where poisoned memory was (the allocator's choice, reported,
    not assumed).

Prefix: bitwise mismatches against the reference backend on the same device and against the
numpy model of the spec's order (docs/spec.md) (testing.model_prefix). Output: rel L2 against testing.output_f64
from the backend's own prefix. xmoe: bitwise against the output with -0.0 made +0.0.
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from oproj_jax import api, testing
from oproj_jax.bench.inputs import WEIGHTS, HostCase
from oproj_jax.bench.timing import EPS, consumer_options

POISON_BITS = 0xFFFF  # a NaN; as a 32-bit word 0xFFFFFFFF, never the mailbox sentinel
ARGS = ("mailbox", "prefix", "blocks", *WEIGHTS)


def _poisoned(x: np.ndarray):
    return jnp.asarray(np.full(x.shape, POISON_BITS, np.uint16).view(x.dtype))


def _pointers(result) -> list[int]:
    arrays = [result.output] + ([result.xmoe] if result.xmoe is not None else [])
    return [a.unsafe_buffer_pointer() for a in arrays]


class Checker:
    """Runs checks and caches what several backends share (the f64 output model per prefix)."""

    def __init__(self):
        self._f64 = {}

    def _output_f64(self, case: HostCase, prefix: np.ndarray) -> np.ndarray:
        key = (
            case.config,
            case.seed,
            hashlib.blake2b(np.ascontiguousarray(prefix).view(np.uint16).tobytes(), digest_size=16).digest(),
        )
        if key not in self._f64:
            self._f64.clear()  # one case at a time: these are large at T = 4096
            x = case.inputs
            self._f64[key] = testing.output_f64(
                prefix, x["blocks"], x["norm"], x["query"], x["out_norm"], eps=EPS, out_eps=EPS
            )
        return self._f64[key]

    def check(self, backend: str, case: HostCase, reference_prefix: np.ndarray | None) -> tuple[dict, np.ndarray]:
        """One backend on one case: (record, the backend's prefix as numpy bf16)."""
        config = case.config
        fn = jax.jit(functools.partial(api.consumer, backend=backend, **consumer_options(config)), donate_argnums=(1,))
        real = {name: jnp.asarray(case.inputs[name]) for name in ARGS}
        poison = {name: _poisoned(case.inputs[name]) for name in ARGS}
        with _quiet_donation():
            stale = fn(*(poison[name] for name in ARGS))
            jax.block_until_ready(stale)
            stale_pointers = set(_pointers(stale))
            shapes = [(a.shape, a.dtype) for a in (stale.output, stale.xmoe) if a is not None]
            del stale, poison
            # More NaN memory where same-sized buffers go next (best-fit allocators reuse it).
            fillers = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in shapes for _ in range(3)]
            jax.block_until_ready(fillers)
            stale_pointers |= {f.unsafe_buffer_pointer() for f in fillers}
            del fillers
            result = fn(*(real[name] for name in ARGS))
            jax.block_until_ready(result)
        reused = sum(p in stale_pointers for p in _pointers(result))
        prefix = np.asarray(result.prefix)
        output = np.asarray(result.output)
        record = dict(
            kind="check",
            backend=backend,
            config=config.name,
            T=config.T,
            seed=case.seed,
            prefix_mismatch_model=int(np.count_nonzero(testing.bits(prefix) != testing.bits(case.expected_prefix))),
            out_rel_l2=testing.rel_l2(output, self._output_f64(case, prefix)),
            out_nonfinite=int(np.count_nonzero(~np.isfinite(output.astype(np.float32)))),
            poison_reused=f"{reused}/{len(_pointers(result))}",
        )
        if reference_prefix is not None:
            record["prefix_mismatch"] = int(np.count_nonzero(testing.bits(prefix) != testing.bits(reference_prefix)))
        else:  # the reference itself: held to the numpy model of the spec's order (docs/spec.md)
            record["prefix_mismatch"] = record["prefix_mismatch_model"]
        if config.xmoe_replicas:
            got = testing.bits(np.asarray(result.xmoe))
            record["xmoe_mismatch"] = int(np.count_nonzero(got != testing.published_bits(output)[None]))
        record["ok"] = bool(
            record["prefix_mismatch"] == 0
            and record["prefix_mismatch_model"] == 0
            and record["out_rel_l2"] < testing.OUTPUT_REL_L2_TOL
            and record["out_nonfinite"] == 0
            and record.get("xmoe_mismatch", 0) == 0
        )
        del result, real
        return record, prefix


class _quiet_donation:
    """Backends that cannot alias the donated prefix make JAX warn; the check is still valid."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
