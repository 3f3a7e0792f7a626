"""The generic FFI launcher against the launcher it replaced: the host's time per call at small T.

Two checkouts, each with its FFI library built: --new (default: this one) and --old (the
replaced launcher, prepared on a CPU machine with --prepare-old REV: `git archive REV` of the
package and ffi/ into .dev/old, its library built there). Both read the same cubins
(OPROJ_JAX_CUBIN_DIR, default this checkout's) where the kernel sources did not change; where
they did, --old-cubins names a set the old checkout's manifest accepts (its plain variant's SASS
is the new one's). Per round (--rounds), each arm runs one process per XLA configuration, the
arms' order alternating from round to round so that drifts of the machine fall on both:
  graph   XLA's default flags: the consumer calls are kernel nodes of XLA's command buffers;
          `steady` feeds each execution the same buffers (the graph replays, nothing is
          recorded), `rotated` alternates two mailboxes, so that every execution moves a buffer
          and XLA updates every call's node: the record stage's update, once per call;
  nocb    command buffers off (--xla_gpu_enable_command_buffer=): the execute stage per call
          (plan the call, cuLaunchKernelEx).
Each form times two jitted chains of K1 and K2 dependent ready-mode calls (oproj_jax.consumer,
backend="cute", the production shape R=16, NB=8 at each --tokens T, the prefix donated from call
to call): the host's dispatch time per call is (median dispatch(K2) - median dispatch(K1)) /
(K2 - K1), where dispatch is how long the jitted function takes to return (bench/timing.py's
us_host); `wall` is the same slope of the executions waited for. Prints per form and T the
medians over the rounds, old and new and new - old, and writes every process's figures as JSON.

    python benchmarks/launch_ab.py --prepare-old 4971b2f            # a CPU machine: .dev/old
    python benchmarks/launch_ab.py --old .dev/old --out OUTDIR        # the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
CONFIGS = {"graph": "", "nocb": "--xla_gpu_enable_command_buffer="}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prepare-old", metavar="REV", help="CPU machine: check REV out into --old and build its library"
    )
    parser.add_argument("--old", default=os.path.join(REPO, ".dev", "old"))
    parser.add_argument("--new", default=REPO)
    parser.add_argument("--old-cubins", default=None, help="the old arm's OPROJ_JAX_CUBIN_DIR (default: the new one's)")
    parser.add_argument("--out", default=None, help="directory of the JSON (default: print only)")
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=300, help="timed executions per chain")
    parser.add_argument("--chain", default="1,9", help="K1,K2")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds; no new round starts past it")
    parser.add_argument(
        "--backend", default="cute", help="the consumer's backend (another: a smoke test of the script)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.chain = tuple(int(k) for k in args.chain.split(","))
    return args


# ---- one process: one checkout (on PYTHONPATH), one XLA configuration --------------------------


def _median_dispatch(fn, feed, reps: int) -> tuple[float, float]:
    """(median seconds for fn(*args) to return, median seconds until its results are ready)."""
    import jax

    dispatch, wall = [], []
    for i in range(reps + 20):  # the first executions record and warm up: not timed
        args = feed(i)
        t0 = time.perf_counter()
        out = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        feed.keep(out)
        if i >= 20:
            dispatch.append(t1 - t0)
            wall.append(t2 - t0)
    return statistics.median(dispatch), statistics.median(wall)


class _Feed:
    """The arguments of execution i: the prefix the last execution returned (donated), and the
    same mailbox every time (steady) or one of two (rotated)."""

    def __init__(self, sets, rotated: bool):
        self.sets, self.rotated = sets, rotated
        self.prefix = None

    def __call__(self, i):
        import jax.numpy as jnp

        x = self.sets[i % 2 if self.rotated else 0]
        prefix = jnp.array(x[1]) if self.prefix is None else self.prefix
        return (x[0], prefix, *x[2:])

    def keep(self, out):
        self.prefix = out


def worker(tokens, chain, reps, backend) -> dict:
    import jax

    import oproj_jax
    from oproj_jax import configs

    out = {"path": oproj_jax.__file__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    k1, k2 = chain
    for T in tokens:
        config = configs.Config(configs.TP, T, 8)
        sets = [[jax.device_put(configs.make_inputs(config, seed)[k]) for k in NAMES] for seed in (0, 1)]

        def chained(K):
            def fn(mailbox, prefix, blocks, norm, query, out_norm):
                for _ in range(K):
                    result = oproj_jax.consumer(
                        mailbox, prefix, blocks, norm, query, out_norm, backend=backend, **config.options()
                    )
                    prefix = result.prefix
                return prefix

            return jax.jit(fn, donate_argnums=(1,))

        fns = {K: chained(K) for K in (k1, k2)}
        for form, rotated in (("steady", False), ("rotated", True)):
            d, w = {}, {}
            for K, fn in fns.items():
                d[K], w[K] = _median_dispatch(fn, _Feed(sets, rotated), reps)
            out[f"T{T}/{form}/host_us"] = (d[k2] - d[k1]) / (k2 - k1) * 1e6
            out[f"T{T}/{form}/wall_us"] = (w[k2] - w[k1]) / (k2 - k1) * 1e6
            out[f"T{T}/{form}/dispatch_k1_us"] = d[k1] * 1e6
    return out


# ---- the driver ---------------------------------------------------------------------------------


def prepare_old(rev: str, where: str) -> None:
    """`git archive REV` of what the launch needs into `where`, then its FFI library built there."""
    os.makedirs(where, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", rev, "oproj_jax", "ffi", "setup.py", "pyproject.toml"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    env = dict(os.environ, PYTHONPATH=where)
    subprocess.run([sys.executable, "-m", "oproj_jax.build", "--ffi-only"], cwd=where, env=env, check=True)
    with open(os.path.join(where, "REVISION"), "w") as f:
        f.write(subprocess.run(["git", "-C", REPO, "rev-parse", rev], capture_output=True, text=True).stdout)


def run_arm(tree: str, flags: str, args) -> dict:
    tree = os.path.abspath(tree)  # the worker runs in it: a relative path would not lead back
    site = os.path.join(REPO, ".dev", "site")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, site]), XLA_FLAGS=flags)
    env.setdefault("OPROJ_JAX_CUBIN_DIR", os.path.join(REPO, "oproj_jax", "cute", "cubins"))
    if args.old_cubins and tree == os.path.abspath(args.old):
        env["OPROJ_JAX_CUBIN_DIR"] = os.path.abspath(args.old_cubins)
    env.pop("OPROJ_JAX_FFI_LIBRARY", None)  # each checkout's own library
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--tokens", ",".join(map(str, args.tokens))]
    command += ["--reps", str(args.reps), "--chain", ",".join(map(str, args.chain)), "--backend", args.backend]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": f"rc={done.returncode}: {done.stderr[-3000:]}"}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.tokens, args.chain, args.reps, args.backend)), flush=True)
        return 0
    if args.prepare_old:
        prepare_old(args.prepare_old, args.old)
        print(f"old launcher: {args.old} ({args.prepare_old})")
        return 0
    if not os.path.isfile(os.path.join(args.old, "oproj_jax", "_lib", "liboproj_ffi.so")):
        print(
            f"launch_ab.py: no built old checkout in {args.old} (run --prepare-old REV on a CPU machine)",
            file=sys.stderr,
        )
        return 2
    start, runs = time.time(), []
    arms = {"old": args.old, "new": args.new}
    for r in range(args.rounds):
        if time.time() - start > args.budget:
            print(f"round {r}: out of time (--budget {args.budget} s)", flush=True)
            break
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            for config, flags in CONFIGS.items():
                figures = run_arm(arms[name], flags, args)
                runs.append(dict(round=r, arm=name, config=config, **figures))
                print(f"round {r} {name:3s} {config:5s} " + json.dumps(figures)[:400], flush=True)
        report(runs, args, argv)  # after every round: a stopped run keeps what it measured
    return 0


def report(runs: list[dict], args, argv) -> None:
    """Prints the medians over the rounds per form, old, new and new - old; writes the JSON."""
    summary = {}
    keys = sorted({k for run in runs for k in run if k.endswith("_us")})
    print(f"\n{'form':32s} {'old':>8s} {'new':>8s} {'new-old':>8s}   (medians over rounds, us per call)")
    for config in CONFIGS:
        for key in keys:
            if config == "nocb" and "/rotated/" in key:
                continue  # no command buffer to update: the same as steady
            med = {}
            for arm in ("old", "new"):
                values = [run[key] for run in runs if run["arm"] == arm and run["config"] == config and key in run]
                med[arm] = statistics.median(values) if values else float("nan")
            summary[f"{config}/{key}"] = dict(med, delta=med["new"] - med["old"])
            print(f"{config + '/' + key:32s} {med['old']:8.2f} {med['new']:8.2f} {med['new'] - med['old']:+8.2f}")
    print(flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "launch-ab.json")
        with open(path, "w") as f:
            json.dump(dict(script="benchmarks/launch_ab.py", argv=argv or sys.argv[1:], runs=runs, summary=summary), f)


if __name__ == "__main__":
    sys.exit(main())
