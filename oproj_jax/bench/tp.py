"""python -m oproj_jax.bench.tp: the sharded layer's modes timed on a mesh of local GPUs.

  python -m oproj_jax.bench.tp --tp 2 --tokens 1,8,64 --json out.json

For each mode (oneshot, twoshot, psum, peer) and backend (reference, pallas, cute; peer with
cute only) at R = the number of GPUs, NB=8, has_delta, groups=4: the time per decode step, as
the slope of unrolled jitted chains of K dependent steps (timing.slope: (t(K2)-t(K1))/(K2-K1),
median wall times), in the record form of bench/timing.py: `us` = max(`us_pipelined`, `us_host`)
(the slope with executions dispatched back to back, the host's dispatch time per step), what a
caller dispatching back to back pays, and `us_donated` the slope with every execution waited
for; every step on its own input set (partial [R, T, H] sharded over the ranks,
blocks), the prefix threaded through the chain, every output kept live. `us_kernels`: the
profiler's kernel time per step and device (all GPUs' kernel time / steps / R); for peer it
includes the time a consumer spends polling for its peers and a publish kernel waiting for a
peer's re-arm. The peer calls enter XLA's command buffers (CUDA graphs) through their record
stage like the other cute targets, so a chain pays kernel time, not per-call host dispatch.
A failed combination becomes an "error" record and the run goes on; the JSON is rewritten
after every record.

`--processes N` runs the same as N jax.distributed processes on this host, one GPU each (the
mesh spans them; mode="peer" maps the mailboxes through CUDA IPC): every process times its own
view of each step, and the records carry `processes` and `process_index`.

`run(n_ranks, tokens, reps, json_path)` is what `python -m oproj_jax.bench --tp N` calls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oproj_jax import configs, processes
from oproj_jax.bench import timing
from oproj_jax.bench.report import time_cell
from oproj_jax.cute import peer
from oproj_jax.sharded import tp_consumer

# most important first: a stage cut short by its time limit still has the comparison of record
COMBOS = (
    ("peer", "cute"),
    ("psum", "reference"),
    ("oneshot", "cute"),
    ("oneshot", "reference"),
    ("twoshot", "cute"),
    ("psum", "cute"),
    ("oneshot", "pallas"),
    ("twoshot", "pallas"),
    ("psum", "pallas"),
    ("twoshot", "reference"),
)
DEFAULT_TOKENS = (1, 8, 64)
NB, GROUPS = 8, 4
CHAIN = (4, 20)  # default chain lengths K1, K2 (--chain): 16 steps between them (~100 us at T=1)
N_LISTS = 2  # input lists alternated between executions


def log(message: str) -> None:
    print(f"[bench.tp {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _chain(mesh, mode: str, backend: str, k: int, config: configs.Config):
    """jit of k dependent steps: step i reads partials[i] and blocks[i]; returns the final
    prefix, every output and every status (zeros for modes without one)."""
    options = dict(has_delta=config.has_delta, groups=config.groups, xmoe_replicas=0)

    def chain(partials, blocks, prefix, norm, query, out_norm):
        outputs, statuses = [], []
        for i in range(k):
            res = tp_consumer(
                partials[i], prefix, blocks[i], norm, query, out_norm, mesh=mesh, mode=mode, backend=backend, **options
            )
            prefix = res.prefix
            outputs.append(res.output)
            statuses.append(res.status if mode == "peer" else jnp.zeros((config.R,), jnp.int32))
        return prefix, outputs, jnp.stack(statuses)

    chain.__name__ = chain.__qualname__ = f"tp_{mode}_{backend}_T{config.T}_K{k}"
    return jax.jit(chain, keep_unused=True)


def _global(value: np.ndarray, sharding):
    """A global array from a value every process holds (seeded): works across processes too."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _inputs(mesh, config: configs.Config, seed: int, k2: int):
    """N_LISTS argument tuples, each with k2 distinct partials and blocks (device copies of
    random data, shifted per copy so no two buffers are equal)."""
    x = configs.make_inputs(config, seed)
    shard = NamedSharding(mesh, P("tp"))
    replicated = NamedSharding(mesh, P())
    put = jax.jit(lambda a, s: (a.astype(jnp.float32) * (1 + s / 64)).astype(jnp.bfloat16))  # keeps a's sharding
    partial = _global(x["mailbox"], shard)
    blocks = _global(x["blocks"], replicated)
    lists = []
    for j in range(N_LISTS):
        partials = [put(partial, jnp.float32(j * k2 + i)) for i in range(k2)]
        block_sets = [put(blocks, jnp.float32(j * k2 + i)) for i in range(k2)]
        lists.append(
            (partials, block_sets, *(_global(x[k], replicated) for k in ("prefix", "norm", "query", "out_norm")))
        )
    jax.block_until_ready(lists)
    return lambda i: lists[i % N_LISTS]


def time_combo(
    mesh, mode: str, backend: str, config: configs.Config, reps: int, profile: bool, chain: tuple[int, int] = CHAIN
) -> dict:
    K1, K2 = chain
    fn1, fn2 = (_chain(mesh, mode, backend, k, config) for k in chain)
    args_of = _inputs(mesh, config, seed=config.T, k2=K2)
    if mode == "peer":  # fail fast (a few timeouts, not a whole timing) when a rank cannot take part
        peer.check_status(fn1(*args_of(0))[2])
    us_donated, t1, t2, noise = timing.slope(fn1, fn2, args_of, K1, K2, reps)
    # the same chains dispatched back to back, as a decode loop that keeps its state on the
    # device runs its steps: the host's work per execution overlaps the devices'
    us_pipelined = timing.slope(fn1, fn2, args_of, K1, K2, reps, pipelined=timing.PIPELINE)[0]
    us_host = timing.host_dispatch_us(fn1, fn2, K1, K2, reps, args_of)
    if mode == "peer":  # the timed steps must have been real ones
        peer.check_status(fn2(*args_of(0))[2])
    us_kernels = note = None
    if profile:
        _, note, kernels, _ = timing.profiled_us_per_call(fn2, args_of, K2)
        mine = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        us_kernels = None if kernels is None else kernels / mine  # this process's GPUs' kernels per step
    return dict(
        kind="timing",
        backend=backend,
        mode=mode,
        gpus=config.R,
        processes=jax.process_count(),
        process_index=jax.process_index(),
        **timing.shape_fields(config),
        us=timing.caller_pays(us_pipelined, us_host),
        us_pipelined=us_pipelined,
        us_host=us_host,
        us_donated=us_donated,
        us_kernels=us_kernels,
        noise_us=noise,
        t_k1_us=t1,
        t_k2_us=t2,
        k1=K1,
        k2=K2,
        reps=reps,
        device=jax.devices()[0].device_kind,
        record=True,
        profiler_note=note,
        date=datetime.date.today().isoformat(),
        method=f"slope of unrolled jitted chains of dependent TP steps, K1={K1}, K2={K2}, median of {reps} "
        f"executions each, {N_LISTS} input lists alternated: us_pipelined with {timing.PIPELINE} executions "
        f"dispatched back to back per sample, us_donated with every execution waited for; us_host: the host's "
        f"dispatch time per step; us = max(us_pipelined, us_host)",
    )


def _together(what: str, timeout_s: float = 600) -> None:
    """With several processes: every process starts the same combination at once (one that
    failed in one process must not leave the others timing something else)."""
    processes.barrier(f"oproj_jax/bench.tp/{what}", timeout_s)


def _write(records, json_path) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)


def run(
    n_ranks: int,
    tokens=DEFAULT_TOKENS,
    reps: int = 7,
    json_path: str | None = None,
    *,
    combos=COMBOS,
    profile: bool = True,
    chain: tuple[int, int] = CHAIN,
) -> list[dict]:
    """Times every (mode, backend) of `combos` at every T of `tokens` on the first `n_ranks`
    GPUs; returns the records (also written to `json_path` after each one)."""
    gpus = jax.devices()  # every process's: the mesh spans them all when there are several
    if gpus[0].platform != "gpu" or len(gpus) < n_ranks or (jax.process_count() > 1 and len(gpus) != n_ranks):
        raise RuntimeError(
            f"--tp {n_ranks}: needs {n_ranks} GPUs (all of them when several processes share the mesh), found "
            f"{len(gpus)} {gpus[0].platform} device(s) in {jax.process_count()} process(es)"
        )
    mesh = Mesh(np.array(gpus[:n_ranks]), ("tp",))
    records = []
    for mode, backend in combos:
        for T in tokens:
            config = configs.Config(n_ranks, T, NB, groups=GROUPS)
            what = f"{mode}/{backend} T={T}"
            _together(what)
            try:
                record = time_combo(mesh, mode, backend, config, reps, profile, chain)
                log(f"{what}: {time_cell(record['us'], '.2f')} us/step (kernels {record['us_kernels']})")
            except Exception as err:  # one failed combination must not end the run
                record = dict(
                    kind="error",
                    backend=backend,
                    mode=mode,
                    T=T,
                    gpus=n_ranks,
                    processes=jax.process_count(),
                    process_index=jax.process_index(),
                    record=True,
                    what=f"timing {what}",
                    error=f"{type(err).__name__}: {err}"[:2000],
                )
                log(f"{what}: {record['error'][:300]}")
            records.append(record)
            _write(records, json_path)
    print(summary(records))
    return records


def summary(records) -> str:
    """A table: one row per (mode, backend), us per step at each T; peer's speedup over psum/reference."""
    timings = [r for r in records if r.get("kind") == "timing"]
    tokens = sorted({r["T"] for r in records if "T" in r})
    rows = {}
    for r in records:
        if "mode" in r:
            rows.setdefault((r["mode"], r["backend"]), {})[r["T"]] = r
    cell = lambda r: "-" if r is None else ("error" if r["kind"] == "error" else time_cell(r["us"], ".2f"))
    lines = ["mode/backend        " + "".join(f"T={t:<10}" for t in tokens)]
    for (mode, backend), by_t in rows.items():
        lines.append(f"{mode + '/' + backend:<20}" + "".join(f"{cell(by_t.get(t)):<12}" for t in tokens))
    base = {r["T"]: r for r in timings if (r["mode"], r["backend"]) == ("psum", "reference")}
    for r in timings:
        if r["mode"] == "peer" and r["T"] in base and (r["us"] or 0) > 0 and (base[r["T"]]["us"] or 0) > 0:
            line = f"peer/cute T={r['T']}: {base[r['T']]['us'] / r['us']:.1f}x faster than psum/reference"
            if (r.get("us_donated") or 0) > 0 and (base[r["T"]].get("us_donated") or 0) > 0:
                line += f" (waited for: {base[r['T']]['us_donated'] / r['us_donated']:.1f}x)"
            lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oproj_jax.bench.tp", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="GPUs (ranks) in the mesh (default %(default)s)")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="token counts, comma-separated")
    parser.add_argument("--reps", type=int, default=7, help="timed executions per chain length (default %(default)s)")
    parser.add_argument("--modes", default=None, help="only these modes, comma-separated")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler's kernel times")
    parser.add_argument("--json", metavar="PATH", help="write the records as JSON")
    parser.add_argument(
        "--chain",
        default=",".join(map(str, CHAIN)),
        help="chain lengths K1,K2 of the slope (default %(default)s); more steps between them average "
        "out more of the host's jitter per execution",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run the mesh as this many jax.distributed processes on this host, one GPU each (--tp of them); "
        "every process times its own view and the records say which (default %(default)s)",
    )
    parser.add_argument(
        "--processes-timeout",
        type=float,
        default=3600,
        help="with --processes: seconds before the processes are stopped and their output reported",
    )
    parser.add_argument("--as-process", type=int, nargs=3, metavar=("ID", "COUNT", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes > 1 and args.as_process is None:
        return _launch(list(sys.argv[1:] if argv is None else argv), args.processes, args.json, args.processes_timeout)
    if args.as_process is not None:
        pid, count, port = args.as_process
        processes.initialize(pid, count, port, local_device_ids=[pid])
        args.json = f"{args.json or 'bench_tp.json'}.process{pid}"
    try:
        k1, k2 = (int(k) for k in args.chain.split(","))
    except ValueError:
        parser.error(f"--chain: expected K1,K2, got {args.chain!r}")
    if not 1 <= k1 < k2:
        parser.error(f"--chain: expected 1 <= K1 < K2, got {args.chain!r}")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if args.tp < 1 or args.reps < 1 or not tokens or min(tokens) < 1:
        parser.error("--tp, --reps and --tokens must be positive")
    modes = None if args.modes is None else set(args.modes.split(","))
    combos = tuple(c for c in COMBOS if modes is None or c[0] in modes)
    run(args.tp, tokens, args.reps, args.json, combos=combos, profile=not args.no_profile, chain=(k1, k2))
    return 0


def _launch(argv: list[str], count: int, json_path: str | None, timeout_s: float) -> int:
    """Runs this module in `count` processes of one jax.distributed cluster (one GPU each) and
    merges their records into `json_path`; prints each process's output."""
    target = json_path or "bench_tp.json"
    if json_path is None:
        argv = argv + ["--json", target]
    results = processes.run(["-m", "oproj_jax.bench.tp", *argv, "--as-process"], count, timeout_s=timeout_s)
    records = []
    for i, r in enumerate(results):
        print(f"--- process {i} (exit {r.code}) ---\n{r.log}", flush=True)
        try:
            with open(f"{target}.process{i}") as f:
                records.extend(json.load(f))
        except OSError as err:
            records.append(dict(kind="error", process_index=i, record=True, error=f"no records: {err}"))
    _write(records, target)
    return 0 if all(r.code == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
