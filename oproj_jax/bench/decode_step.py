"""A decode step of L layers on one GPU: what the consumer costs inside a real jitted loop.

One rank of a TP16 model, T tokens. Each layer:

  partial  = attn [T, H/R] @ w_o [H/R, H]                this rank's o-projection, bf16 [T, H]
  mailbox  = this rank's slot <- partial                 [R, T, H], the R-1 other slots as the
                                                         peers delivered them (see MAILBOXES)
  prefix, output = consumer(mailbox, prefix, blocks, norm, query, out_norm)
  moe      = silu(output @ w_up [H, F]) @ w_down [F, H]  a stand-in for the MoE (F = moe_width,
                                                         1024 by default)
  attn     = moe[:, :H/R]                                the next layer's attention output

The partial is materialized first (optimization_barrier), as a collective or a peer write
would. How the mailbox is formed (`mailbox`, MAILBOXES):
  "carried"  one [R, T, H] mailbox is part of the step's state (donated, a scan carry), and each
             layer writes its partial into slot 0 in place: the consumer side of mode="peer",
             whose mailbox is one buffer the peers write into directly and every layer reuses
             (here the peers' slots keep their values; the weights streamed per layer, ~36 MB
             at F = 1024, keep the mailbox from staying in the 50 MB L2 between layers; F = 64
             streams ~7 MB, so that what L2 holds between layers can be told apart);
  "partial"  the carried mailbox holding the peers' slots, and the partial passed as
             consumer(..., partial=partial, rank=0): read where the o-proj left it, slot 0 not
             written (no copy; kernels that do not read it in place copy the mailbox instead);
  "concat"   [partial, others[l]]: a new [R, T, H] array per layer from stacked per-layer slots
             (what an all-gather's output costs to assemble again, on top of the gather);
  "update"   others[l] (stacked [R, T, H] per layer) with slot 0 overwritten: XLA copies the
             layer's slice, then writes the slot.

With `captures` containing True the consumer is also timed with stream_capture=True
(oproj_jax.consumer: the kernel traced into XLA's graph instead of a kernel node), its records
marked stream_capture and labelled "<backend>+capture".

The layer loop is written two ways: `lax.scan` over stacked per-layer weights, and a Python
loop (unrolled). Each is timed with the consumer and without it (the rank's own partial passed
on as the output, the prefix untouched) in the same process, interleaved; the consumer's share
per layer is (t_with - t_without) / L, mailbox forming included. A step is one jitted call
(prefix and mailbox donated); `reps` steps, each on the previous step's outputs, are dispatched
back to back and waited for once, as a decode loop that keeps its state on the device runs
them: the time per step is the steady state of host dispatch overlapping device work. That is
the figure bench/timing.py's `us` stands for (what a caller dispatching back to back pays: the
larger of the device's time and the host's dispatch time), measured directly: no prelude sits
between the steps, so the host has no slack here that a decode loop lacks. A consumer's share
per layer below zero (the step with the consumer no slower than without, within the noise) is
kept as measured in the record and shown as "-" (bench/report.py). Off a GPU (figures=False)
the steps run once, and the records say which ran, without times.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from oproj_jax import api, configs
from oproj_jax.bench import report, timing

R, H, NB, F = configs.TP, configs.HIDDEN, 8, 1024
MAILBOXES = ("carried", "partial", "concat", "update")
LOOPS = ("scan", "unrolled")
K = H // R  # this rank's slice of heads * head_dim
EPS = 1e-6
bf16, f32 = jnp.bfloat16, jnp.float32


def make_weights(layers: int, T: int, mailbox: str = "carried", seed: int = 0, moe_width: int = F) -> dict:
    """Stacked per-layer weights and peer slots on the default device (random, scaled so the
    activations stay O(1)); the MoE stand-in is `moe_width` wide."""
    if isinstance(moe_width, bool) or not isinstance(moe_width, int) or moe_width < 1:
        raise ValueError(
            f"moe_width: expected a positive int (the MoE stand-in's width, default {F}), got {moe_width!r}"
        )

    @jax.jit
    def init(key):
        k = jax.random.split(key, 7)
        normal = lambda key, shape, scale: (jax.random.normal(key, shape, f32) * scale).astype(bf16)
        weights = dict(
            w_o=normal(k[0], (layers, K, H), K**-0.5),
            w_up=normal(k[2], (layers, H, moe_width), H**-0.5),
            w_down=normal(k[3], (layers, moe_width, H), moe_width**-0.5),
            norm=(1 + normal(k[4], (layers, H), 0.1)).astype(bf16),
            query=normal(k[5], (layers, H), 1.0),
            out_norm=(1 + normal(k[6], (layers, H), 0.1)).astype(bf16),
        )
        if mailbox != "carried":  # the peers' slots of every layer, stacked
            weights["others"] = normal(k[1], (layers, R - 1 if mailbox == "concat" else R, T, H), 1.0)
        return weights

    return init(jax.random.PRNGKey(seed))


def make_state(T: int, seed: int = 1) -> tuple[jax.Array, ...]:
    """(attn [T, H/R], prefix [T, H], mailbox [R, T, H], blocks [T, NB, H]) on the default device."""
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    attn = jax.random.normal(k[0], (T, K), f32).astype(bf16)
    prefix = jax.random.normal(k[1], (T, H), f32).astype(bf16)
    mailbox = jax.random.normal(k[2], (R, T, H), f32).astype(bf16)
    blocks = jax.random.normal(k[3], (T, NB, H), f32).astype(bf16)
    return attn, prefix, mailbox, blocks


def layer(backend: str | None, form: str, attn, prefix, mailbox, blocks, w, stream_capture: bool = False):
    """One layer (see the module docstring); backend None leaves the consumer out. Returns
    (attn, prefix, mailbox)."""
    partial = jnp.dot(attn, w["w_o"], preferred_element_type=f32).astype(bf16)  # [T, H]
    # In a TP step the partial leaves through a collective (or peer writes) before any slot is
    # read, so it is materialized by its own GEMM. Without the barrier XLA fuses this GEMM into
    # the stand-in mailbox's concatenation and runs it as a reduction inside that fusion: ~27
    # (scan) to ~90 (unrolled) us per layer at T=1 on the H200, charged to the consumer.
    partial = lax.optimization_barrier(partial)
    if backend is None:
        output = partial
    else:
        own = partial if form == "partial" else None
        if form == "carried":
            mailbox = slots = lax.dynamic_update_index_in_dim(mailbox, partial, 0, 0)  # in place: a donated carry
        elif form == "partial":
            slots = mailbox  # slot 0 is never read
        elif form == "concat":
            slots = jnp.concatenate([partial[None], w["others"]])
        else:
            slots = lax.dynamic_update_index_in_dim(w["others"], partial, 0, 0)
        res = api.consumer(
            slots,
            prefix,
            blocks,
            w["norm"],
            w["query"],
            w["out_norm"],
            partial=own,
            rank=0,
            eps=EPS,
            out_eps=EPS,
            has_delta=True,
            groups=4,
            xmoe_replicas=0,
            backend=backend,
            stream_capture=stream_capture,
        )
        prefix, output = res.prefix, res.output
    up = jnp.dot(output, w["w_up"], preferred_element_type=f32)
    moe = jnp.dot(jax.nn.silu(up).astype(bf16), w["w_down"], preferred_element_type=f32).astype(bf16)
    return moe[:, :K], prefix, mailbox


def step_fn(backend: str | None, loop: str, layers: int, mailbox: str = "carried", stream_capture: bool = False):
    """jit(step)(attn, prefix, mailbox, blocks, weights) -> (attn, prefix, mailbox), prefix and
    mailbox donated."""
    if mailbox not in MAILBOXES:
        raise ValueError(f"mailbox: expected one of {MAILBOXES}, got {mailbox!r}")
    if loop not in LOOPS:
        raise ValueError(f"loop: expected one of {LOOPS}, got {loop!r}")

    def step(attn, prefix, slots, blocks, weights):
        if loop == "scan":

            def body(carry, w):
                return layer(backend, mailbox, *carry, blocks, w, stream_capture), None

            (attn, prefix, slots), _ = lax.scan(body, (attn, prefix, slots), weights)
        else:
            for i in range(layers):
                w = jax.tree.map(lambda a: a[i], weights)
                attn, prefix, slots = layer(backend, mailbox, attn, prefix, slots, blocks, w, stream_capture)
        return attn, prefix, slots

    step.__name__ = step.__qualname__ = f"decode_{loop}_{backend or 'none'}_{mailbox}" + "_capture" * stream_capture
    return jax.jit(step, donate_argnums=(1, 2))


def first_step(fn, state, weights):
    """One step on copies of the state's donated arrays (compiles and warms `fn`), waited for:
    the carry the timed or traced steps continue from."""
    attn, prefix, slots, blocks = state
    return jax.block_until_ready(fn(attn, jnp.copy(prefix), jnp.copy(slots), blocks, weights))


def more_steps(fn, carry, blocks, weights, n: int):
    """`n` dependent steps from `carry`, dispatched back to back (not waited for)."""
    for _ in range(n):
        carry = fn(carry[0], carry[1], carry[2], blocks, weights)
    return carry


def time_steps(fn, state, weights, reps: int) -> float:
    """Mean wall time in us per step of `reps` dependent steps dispatched back to back."""
    carry = first_step(fn, state, weights)
    start = time.perf_counter()
    jax.block_until_ready(more_steps(fn, carry, state[3], weights, reps))
    return (time.perf_counter() - start) * 1e6 / reps


def per_layer(events, steps: int, layers: int) -> tuple[dict[str, float], float]:
    """From device events (start_ns, end_ns, name) of `steps` steps: each name's summed duration
    per layer in us, largest first, and the device's busy time per layer (timing.busy_us)."""
    times = {}
    for start, end, name in events:
        times[name] = times.get(name, 0.0) + (end - start) / 1e3 / (steps * layers)
    busy = timing.busy_us([(start, end) for start, end, _ in events]) / (steps * layers)
    return dict(sorted(times.items(), key=lambda item: -item[1])), busy


def kernel_times(fn, state, weights, layers: int, steps: int = 4) -> tuple[dict[str, float], float]:
    """per_layer of a jax.profiler trace of `steps` dependent steps dispatched back to back."""
    carry = first_step(fn, state, weights)
    events, _ = timing.traced_events(lambda: more_steps(fn, carry, state[3], weights, steps))
    return per_layer(events, steps, layers)


def profile_fields(with_consumer, without, state, weights, layers: int, log) -> dict:
    """The record's kernel-by-kernel fields (one profiled run of each step, after the timing):
    device time per layer by kernel name with the consumer and without it, and busy times."""
    kernels, busy = kernel_times(with_consumer, state, weights, layers)
    kernels_without, busy_without = kernel_times(without, state, weights, layers)
    for name, us in list(kernels.items())[:10]:
        log(f"    {us:7.2f} us/layer (without: {kernels_without.get(name, 0.0):7.2f})  {name[:90]}")
    log(f"    busy {busy:7.2f} us/layer (without: {busy_without:7.2f})")
    return dict(
        kernels_us_per_layer=kernels,
        kernels_us_per_layer_without=kernels_without,
        us_busy_per_layer=busy,
        us_busy_per_layer_without=busy_without,
    )


def run(
    backends,
    tokens,
    layers: int = 16,
    reps: int = 30,
    repeats: int = 5,
    log=print,
    mailboxes=("carried", "concat"),
    figures: bool = True,
    profile: bool = False,
    loops=LOOPS,
    moe_width: int = F,
    captures=(False,),
) -> list[dict]:
    """Records (kind "decode_step") per mailbox form, backend, T and loop form: the step time
    with and without the consumer (medians of `repeats` interleaved measurements of `reps`
    steps each) and the consumer's share per layer; with `profile` (on a GPU), where each
    step's device time goes, kernel by kernel (profile_fields). `moe_width`: the MoE stand-in's
    width F. `captures`: the consumer's stream_capture values to time (module docstring).
    figures=False (off a GPU): the steps run, and the records carry no time."""
    device = getattr(jax.devices()[0], "device_kind", jax.devices()[0].platform)
    records = []
    for T, form in ((T, form) for T in tokens for form in mailboxes):
        weights, state = make_weights(layers, T, form, moe_width=moe_width), make_state(T)
        for loop in loops:
            without = step_fn(None, loop, layers, form)
            for backend, capture in ((b, c) for b in backends for c in captures):
                with_consumer = step_fn(backend, loop, layers, form, capture)
                pairs = [
                    (time_steps(with_consumer, state, weights, reps), time_steps(without, state, weights, reps))
                    for _ in range(repeats)
                ]  # interleaved, so drifts hit both alike
                shape = dict(
                    backend=backend, loop=loop, mailbox=form, T=T, R=R, NB=NB, layers=layers, moe_width=moe_width
                )
                if capture:
                    shape.update(stream_capture=True)
                label = report.decode_label(shape)
                if not figures:
                    records.append(
                        dict(kind="decode_step", **shape, device=device, note="the steps ran; no time off the GPU")
                    )
                    log(f"decode step T={T:4d} {form:7s} {loop:8s} {label:9s} ran (no time off the GPU)")
                    continue
                t_with = statistics.median(p[0] for p in pairs)
                t_without = statistics.median(p[1] for p in pairs)
                record = dict(
                    kind="decode_step",
                    **shape,
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
                share = report.time_cell(record["us_consumer_per_layer"], "6.2f")
                log(
                    f"decode step T={T:4d} {form:7s} {loop:8s} {label:9s} {t_with:8.1f} us/step, without consumer "
                    f"{t_without:8.1f} -> consumer {share:>6s} us/layer"
                )
                if profile:
                    record.update(profile_fields(with_consumer, without, state, weights, layers, log))
        del weights, state
    return records
