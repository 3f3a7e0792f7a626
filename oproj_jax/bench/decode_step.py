"""A decode step of L layers on one GPU: what the consumer costs inside a real jitted loop.

One rank of a TP16 model, T tokens. Each layer:

  partial  = attn [T, H/R] @ w_o [H/R, H]                this rank's o-projection, bf16 [T, H]
  mailbox  = [partial, others]                           [R, T, H]: its slot plus the R-1 slots
                                                         the peers delivered (stacked per-layer inputs;
                                                         the partial materialized first, as a
                                                         collective would: optimization_barrier)
  prefix, output = consumer(mailbox, prefix, blocks, norm, query, out_norm)
  moe      = silu(output @ w_up [H, F]) @ w_down [F, H]  a stand-in for the MoE (F = 1024)
  attn     = moe[:, :H/R]                                the next layer's attention output

The layer loop is written two ways: `lax.scan` over stacked per-layer weights, and a Python
loop (unrolled). Each is timed with the consumer and without it (the rank's own partial passed
on as the output, the prefix untouched) in the same process, interleaved; the consumer's share
per layer is (t_with - t_without) / L. A step is one jitted call (prefix donated); `reps` steps,
each on the previous step's outputs, are dispatched back to back and waited for once, as a
decode loop that keeps its state on the device runs them: the time per step is the steady
state of host dispatch overlapping device work.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from oproj_jax import api, configs

R, H, NB, F = configs.TP, configs.HIDDEN, 8, 1024
# How the stand-in mailbox gets this rank's slot: "concat" = [partial, others] (a new [R, T, H]
# array each layer), "update" = the peers' slots come as a whole [R, T, H] per layer and slot 0
# is overwritten (dynamic_update_slice: XLA copies the layer's slice, then writes the slot).
MAILBOX = "concat"
K = H // R  # this rank's slice of heads * head_dim
EPS = 1e-6
bf16, f32 = jnp.bfloat16, jnp.float32


def make_weights(layers: int, T: int, seed: int = 0) -> dict:
    """Stacked per-layer weights and peer slots on the default device (random, scaled so the
    activations stay O(1))."""

    @jax.jit
    def init(key):
        k = jax.random.split(key, 7)
        normal = lambda key, shape, scale: (jax.random.normal(key, shape, f32) * scale).astype(bf16)
        return dict(
            w_o=normal(k[0], (layers, K, H), K**-0.5),
            others=normal(k[1], (layers, R - 1 if MAILBOX == "concat" else R, T, H), 1.0),
            w_up=normal(k[2], (layers, H, F), H**-0.5),
            w_down=normal(k[3], (layers, F, H), F**-0.5),
            norm=(1 + normal(k[4], (layers, H), 0.1)).astype(bf16),
            query=normal(k[5], (layers, H), 1.0),
            out_norm=(1 + normal(k[6], (layers, H), 0.1)).astype(bf16),
        )

    return init(jax.random.PRNGKey(seed))


def make_state(T: int, seed: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(attn [T, H/R], prefix [T, H], blocks [T, NB, H]) on the default device."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    attn = jax.random.normal(k[0], (T, K), f32).astype(bf16)
    prefix = jax.random.normal(k[1], (T, H), f32).astype(bf16)
    blocks = jax.random.normal(k[2], (T, NB, H), f32).astype(bf16)
    return attn, prefix, blocks


def layer(backend: str | None, attn, prefix, blocks, w):
    """One layer (see the module docstring); backend None leaves the consumer out."""
    partial = jnp.dot(attn, w["w_o"], preferred_element_type=f32).astype(bf16)  # [T, H]
    # In a TP step the partial leaves through a collective (or peer writes) before any slot is
    # read, so it is materialized by its own GEMM. Without the barrier XLA fuses this GEMM into
    # the stand-in mailbox's concatenation and runs it as a reduction inside that fusion: ~27
    # (scan) to ~90 (unrolled) us per layer at T=1 on the H200, charged to the consumer.
    partial = lax.optimization_barrier(partial)
    if backend is None:
        output = partial
    else:
        if MAILBOX == "concat":
            mailbox = jnp.concatenate([partial[None], w["others"]])  # [R, T, H]
        else:
            mailbox = lax.dynamic_update_index_in_dim(w["others"], partial, 0, 0)  # [R, T, H]
        res = api.consumer(
            mailbox,
            prefix,
            blocks,
            w["norm"],
            w["query"],
            w["out_norm"],
            eps=EPS,
            out_eps=EPS,
            has_delta=True,
            groups=4,
            xmoe_replicas=0,
            backend=backend,
        )
        prefix, output = res.prefix, res.output
    up = jnp.dot(output, w["w_up"], preferred_element_type=f32)
    moe = jnp.dot(jax.nn.silu(up).astype(bf16), w["w_down"], preferred_element_type=f32).astype(bf16)
    return moe[:, :K], prefix


def step_fn(backend: str | None, loop: str, layers: int):
    """jit(step)(attn, prefix, blocks, weights) -> (attn, prefix), prefix donated."""

    def step(attn, prefix, blocks, weights):
        if loop == "scan":

            def body(carry, w):
                return layer(backend, *carry, blocks, w), None

            (attn, prefix), _ = lax.scan(body, (attn, prefix), weights)
        else:
            for i in range(layers):
                attn, prefix = layer(backend, attn, prefix, blocks, jax.tree.map(lambda a: a[i], weights))
        return attn, prefix

    step.__name__ = step.__qualname__ = f"decode_{loop}_{backend or 'none'}"
    return jax.jit(step, donate_argnums=(1,))


def time_steps(fn, state, weights, reps: int) -> float:
    """Mean wall time in us per step of `reps` dependent steps dispatched back to back."""
    attn, prefix, blocks = state
    attn, prefix = jax.block_until_ready(fn(attn, jnp.copy(prefix), blocks, weights))  # compile, warm
    start = time.perf_counter()
    for _ in range(reps):
        attn, prefix = fn(attn, prefix, blocks, weights)
    jax.block_until_ready((attn, prefix))
    return (time.perf_counter() - start) * 1e6 / reps


def run(backends, tokens, layers: int = 16, reps: int = 30, repeats: int = 5, log=print) -> list[dict]:
    """Records (kind "decode_step") per backend, T and loop form: the step time with and without
    the consumer (medians of `repeats` interleaved measurements of `reps` steps each) and the
    consumer's share per layer."""
    device = getattr(jax.devices()[0], "device_kind", jax.devices()[0].platform)
    records = []
    for T in tokens:
        weights, state = make_weights(layers, T), make_state(T)
        for loop in ("scan", "unrolled"):
            without = step_fn(None, loop, layers)
            for backend in backends:
                with_consumer = step_fn(backend, loop, layers)
                pairs = [
                    (time_steps(with_consumer, state, weights, reps), time_steps(without, state, weights, reps))
                    for _ in range(repeats)
                ]  # interleaved, so drifts hit both alike
                t_with = statistics.median(p[0] for p in pairs)
                t_without = statistics.median(p[1] for p in pairs)
                record = dict(
                    kind="decode_step",
                    backend=backend,
                    loop=loop,
                    T=T,
                    R=R,
                    NB=NB,
                    layers=layers,
                    us_step=t_with,
                    us_step_without_consumer=t_without,
                    us_consumer_per_layer=(t_with - t_without) / layers,
                    us_step_runs=[p[0] for p in pairs],
                    us_without_runs=[p[1] for p in pairs],
                    device=device,
                    method=f"{reps} dependent steps dispatched back to back (prefix "
                    f"donated), mean per step; median of {repeats} interleaved repeats",
                )
                records.append(record)
                log(
                    f"decode step T={T:4d} {loop:8s} {backend:9s} {t_with:8.1f} us/step, without consumer "
                    f"{t_without:8.1f} -> consumer {record['us_consumer_per_layer']:6.2f} us/layer"
                )
        del weights, state
    return records
