"""A toy multi-layer decode loop on a TP16 mesh: tp_oproj_consumer under jax.jit + lax.scan.

Each decode step runs `--layers` layers on T tokens. A layer's attention is a stand-in
(column-parallel projection of the hidden state and a tanh: no KV cache); its output
[T, heads*head_dim] is sharded by heads over the 16 ranks, and tp_oproj_consumer multiplies
each rank's heads by its rows of W_o, reduces the partials and runs the AttnRes consumer.
AttnRes blocks: every `--layers-per-block` layers a block starts (has_delta=False: the prefix
is replaced, not added to) and, when it ends, its prefix joins the list of the last NB
completed blocks (a rolling window, so shapes stay static). The hidden state, the prefix and
the block list are carried through lax.scan over the steps; the carry is donated to the jit.

Run from the repository root (CPU-simulated 16 devices unless 16 GPUs are present):
    PYTHONPATH=. python examples/decode_loop.py                 # H = 7168
    PYTHONPATH=. python examples/decode_loop.py --hidden 1024   # faster on CPU
"""

import argparse
import sys
import time

import jax

RANKS = 16
jax.config.update("jax_num_cpu_devices", RANKS)  # before any backend starts: a simulated TP16 on CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from oproj_jax import tp_oproj_consumer  # noqa: E402

bf16, f32 = jnp.bfloat16, jnp.float32


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=7168, help="H, a multiple of 16 (default 7168)")
    p.add_argument("--tokens", type=int, default=4, help="T, tokens decoded per step")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--layers-per-block", type=int, default=2)
    p.add_argument("--blocks", type=int, default=2, help="NB, completed blocks kept (0..8)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="decode steps per jitted call (two calls)")
    p.add_argument("--mode", default="oneshot", choices=("oneshot", "twoshot", "psum"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--devices", default="auto", choices=("auto", "cpu"), help="auto: 16 GPUs if present")
    return p.parse_args()


def pick_devices(kind: str):
    gpus = []
    if kind == "auto":
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            pass
    return gpus[:RANKS] if len(gpus) >= RANKS else jax.devices("cpu")[:RANKS]


def make_params(args, mesh, seed=0):
    """Per-layer weights: w_in [L, H, K] and w_o [L, K, H] sharded on K (the heads), the
    AttnRes / RMSNorm weights [L, H] replicated; K = heads * head_dim."""
    rng = np.random.default_rng(seed)
    L, H, K = args.layers, args.hidden, args.heads * args.head_dim
    put = lambda a, spec: jax.device_put(jnp.asarray(a, bf16), NamedSharding(mesh, spec))
    return dict(
        w_in=put(rng.standard_normal((L, H, K), np.float32) / np.sqrt(H), P(None, None, "tp")),
        w_o=put(rng.standard_normal((L, K, H), np.float32) / np.sqrt(K), P(None, "tp", None)),
        norm=put(1 + 0.1 * rng.standard_normal((L, H)), P()),
        query=put(0.05 * rng.standard_normal((L, H)), P()),
        out_norm=put(1 + 0.1 * rng.standard_normal((L, H)), P()),
    )


def make_state(args, mesh, seed=1):
    """The carry: hidden state x [T, H], prefix [T, H], blocks [T, NB, H], all replicated."""
    rng = np.random.default_rng(seed)
    T, H, NB = args.tokens, args.hidden, args.blocks
    put = lambda a: jax.device_put(jnp.asarray(a, bf16), NamedSharding(mesh, P()))
    return (put(rng.standard_normal((T, H))), put(rng.standard_normal((T, H))), put(rng.standard_normal((T, NB, H))))


def build_decode(args, mesh):
    lpb = args.layers_per_block
    attn_sharding = NamedSharding(mesh, P(None, "tp"))

    def layer(l, params, x, prefix, blocks):
        attn = jnp.tanh(jnp.dot(x, params["w_in"][l], preferred_element_type=f32)).astype(bf16)  # [T, K]
        attn = jax.lax.with_sharding_constraint(attn, attn_sharding)  # each rank: its heads
        result = tp_oproj_consumer(
            attn,
            params["w_o"][l],
            prefix,
            blocks,
            params["norm"][l],
            params["query"][l],
            params["out_norm"][l],
            mesh=mesh,
            mode=args.mode,
            backend=args.backend,
            has_delta=l % lpb != 0,
            groups=4 if args.mode == "oneshot" else 1,
            # the consumer sits between XLA's kernels (the gather, the next GEMM): a kernel's call
            # traced into XLA's graph lets them run at their own speed (oproj_jax.consumer's docstring)
            stream_capture=True,
        )
        prefix, x = result.prefix, result.output
        if l % lpb == lpb - 1 and blocks.shape[1]:  # the block is complete: it joins the list
            blocks = jnp.concatenate([blocks[:, 1:], prefix[:, None]], axis=1)
        return x, prefix, blocks

    def step(params, carry, _):
        x, prefix, blocks = carry
        for l in range(args.layers):  # unrolled: each layer has its own static has_delta
            x, prefix, blocks = layer(l, params, x, prefix, blocks)
        sums = (jnp.sum(x.astype(f32)), jnp.sum(prefix.astype(f32)))
        return (x, prefix, blocks), sums

    def decode(carry, params):  # carry donated: the prefix (and the rest) is updated in place
        return jax.lax.scan(lambda c, s: step(params, c, s), carry, None, length=args.steps)

    return jax.jit(decode, donate_argnums=0)


def main() -> int:
    args = parse_args()
    devices = pick_devices(args.devices)
    mesh = Mesh(np.array(devices), ("tp",))
    K = args.heads * args.head_dim
    print(
        f"mesh: {RANKS} x {devices[0].platform} devices; T={args.tokens} H={args.hidden} "
        f"heads*head_dim={K} layers={args.layers} NB={args.blocks} mode={args.mode} backend={args.backend}"
    )
    params, carry = make_params(args, mesh), make_state(args, mesh)
    decode = build_decode(args, mesh)

    finite = True
    for call in range(2):  # the first call compiles; the second continues from its carry
        start = time.perf_counter()
        carry, (out_sums, prefix_sums) = decode(carry, params)
        out_sums, prefix_sums = np.asarray(out_sums), np.asarray(prefix_sums)  # waits for the result
        elapsed = time.perf_counter() - start
        for s in range(args.steps):
            step = call * args.steps + s
            print(f"step {step}: output checksum {out_sums[s]:+.6f}  prefix checksum {prefix_sums[s]:+.4f}")
        if call == 0:
            print(f"call 0 (compile + {args.steps} steps): {elapsed:.2f} s")
        else:
            print(f"call 1 ({args.steps} steps): {elapsed * 1e3:.1f} ms, {elapsed * 1e3 / args.steps:.2f} ms/step")
        finite &= bool(np.isfinite(out_sums).all() and np.isfinite(prefix_sums).all())
    print(f"done: {2 * args.steps} steps, checksums finite: {finite}")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
