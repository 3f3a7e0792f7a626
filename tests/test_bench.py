"""CPU smoke tests of the benchmark harness (oproj_jax.bench): the CLI end to end on the
reference at T=1, the JSON fields, the table, the plot, backend selection messages, and the
harness's own pieces (prefix model, check flags, derived figures, slope)."""

import importlib.util
import json
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import benchmark_script, worker_env

from oproj_jax import api, configs, reference, testing
from oproj_jax.bench import __main__ as cli
from oproj_jax.bench import backends as bench_backends
from oproj_jax.bench import checks, inputs, report, runner, timing

TIMING_FIELDS = {
    "backend",
    "T",
    "R",
    "NB",
    "groups",
    "us",
    "device",
    "date",
    "gbps",
    "pct_roofline",
    "speedup_vs_reference",
    "method",
}
CHECK_FIELDS = {"backend", "config", "prefix_mismatch", "out_rel_l2"}
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One small CLI run (reference, T=1, R=2, NB=1, with --check), shared by the tests below."""
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = out / "r.json", out / "r.png"
    argv = [
        "--backends",
        "reference",
        "--tokens",
        "1",
        "--ranks",
        "2",
        "--nb",
        "1",
        "--reps",
        "2",
        "--check",
        "--seed",
        "5",
        "--json",
        str(json_path),
        "--plot",
        str(plot_path),
    ]
    capture = pytest.MonkeyPatch()
    stdout = []
    capture.setattr(sys, "stdout", types.SimpleNamespace(write=stdout.append, flush=lambda: None))
    try:
        start = time.perf_counter()
        rc = cli.main(argv)
        seconds = time.perf_counter() - start
    finally:
        capture.undo()
    return dict(rc=rc, stdout="".join(stdout), json=json_path, plot=plot_path, seconds=seconds)


def test_cli_runs_reference_quickly(cli_run):
    assert cli_run["rc"] == 0
    assert cli_run["seconds"] < 120, "the T=1 smoke run should take seconds on a CPU"


def test_cli_json_has_required_fields(cli_run):
    records = json.loads(cli_run["json"].read_text())
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "header" and kinds.count("header") == 1
    header = records[0]
    assert {"jax", "jaxlib", "torch", "triton", "python", "driver"} <= set(header["versions"])
    assert header["versions"]["jax"] == jax.__version__
    assert header["device"] and header["date"]
    (copy,) = [r for r in records if r["kind"] == "copy"]
    assert copy["gbps"] > 0
    (t,) = [r for r in records if r["kind"] == "timing"]
    assert TIMING_FIELDS <= set(t)
    assert (t["backend"], t["T"], t["R"], t["NB"], t["groups"]) == ("reference", 1, 2, 1, 4)
    assert t["buffers"] == "pipelined"  # the CLI's default form, a decode loop's
    assert t["us_host"] is not None  # the host's dispatch time per call, beside the slope
    assert np.isfinite(t["us"]) and t["noise_us"] >= 0  # a loaded 2-core CPU can even give us <= 0
    assert t["bytes"] == configs.min_bytes(configs.Config(2, 1, 1))
    if t["us"] > 0:
        assert t["speedup_vs_reference"] == pytest.approx(1.0)
    (c,) = [r for r in records if r["kind"] == "check"]
    assert CHECK_FIELDS <= set(c)
    assert c["prefix_mismatch"] == 0 and c["out_rel_l2"] < testing.OUTPUT_REL_L2_TOL and c["ok"] is True


def test_cli_prints_the_table(cli_run):
    out = cli_run["stdout"]
    assert "us/call" in out and "% copy" in out and "x ref" in out
    assert any(line.startswith("reference") and line.split()[1:3] == ["pipelined", "1"] for line in out.splitlines())
    assert "copy bandwidth (roofline)" in out


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (the bench extra)")
def test_cli_writes_the_plot(cli_run):
    assert cli_run["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_says_why_a_backend_is_unavailable(capsys):
    status = bench_backends.backend_status(jax.default_backend())
    missing = [name for name, reason in status.items() if reason is not None]
    if not missing:
        pytest.skip("every backend runs here")
    assert cli.main(["--backends", missing[0], "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert f"not timing {missing[0]}: {status[missing[0]]}" in err
    assert "none of the requested backends can run here" in err


def test_cli_rejects_unknown_backend_and_bad_sizes(capsys):
    assert cli.main(["--backends", "nope"]) == 2
    assert "unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--nb", "9"])
    assert "--nb: expected 0..8, got 9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--tokens", "1,x"])


def test_prefix_model_matches_reference_bits():
    config = configs.Config(16, 3, 2, groups=3)
    case = inputs.host_case(config, seed=11)
    x = case.inputs
    got = reference.consumer(*(jnp.asarray(x[k]) for k in checks.ARGS), eps=1e-6, out_eps=1e-6, **config.options())
    assert np.count_nonzero(testing.bits(np.asarray(got.prefix)) != testing.bits(case.expected_prefix)) == 0


def test_device_pool_copies_are_distinct_buffers():
    case = inputs.host_case(configs.Config(2, 1, 1), seed=3)
    pool = inputs.DevicePool(case, 3, l2_bytes=1 << 20)
    assert pool.n_lists >= 2 and pool.n_sets == 3 * pool.n_lists
    assert pool.distinct_buffers()
    mailboxes, blocks, prefix, *weights = pool.args(1)
    assert len(mailboxes) == len(blocks) == 3 and len(weights) == 3


def _broken_consumer(mailbox, prefix, blocks, norm, query, out_norm, **options):
    """The reference with one prefix bit flipped and one output element left as NaN."""
    good = reference.consumer(mailbox, prefix, blocks, norm, query, out_norm, **options)
    bits = jax.lax.bitcast_convert_type(good.prefix, jnp.uint16)
    bad_prefix = jax.lax.bitcast_convert_type(bits.at[0, 0].set(bits[0, 0] ^ 1), jnp.bfloat16)
    return api.ConsumerResult(bad_prefix, good.output.at[0, 5].set(jnp.nan), good.xmoe)


@pytest.fixture
def broken_backend(monkeypatch):
    module = types.ModuleType("oproj_jax_test_broken_backend")
    module.consumer = _broken_consumer
    module.unavailable_reason = lambda platform: None
    module.unsupported_reason = lambda dims, **options: None
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(api._BACKENDS, "broken", module.__name__)
    return "broken"


def test_checks_flag_a_broken_backend_registered_later(broken_backend):
    assert bench_backends.backend_status("cpu")[broken_backend] is None  # found through the registry
    case = inputs.host_case(configs.Config(2, 3, 1, groups=1), seed=4)
    checker = checks.Checker()
    ref_record, ref_prefix = checker.check("reference", case, None)
    assert ref_record["ok"] and ref_record["prefix_mismatch"] == 0
    record, _ = checker.check(broken_backend, case, ref_prefix)
    assert record["prefix_mismatch"] == 1 and record["prefix_mismatch_model"] == 1
    assert record["out_nonfinite"] == 1
    assert record["ok"] is False


def test_derive_fills_bandwidth_roofline_and_speedup():
    records = [
        dict(kind="copy", gbps=4000.0),
        dict(kind="timing", backend="reference", T=8, R=16, NB=8, groups=4, us=4.0, bytes=2_000_000),
        dict(kind="timing", backend="fast", T=8, R=16, NB=8, groups=4, us=1.0, bytes=2_000_000),
    ]
    report.derive(records)
    ref, fast = records[1], records[2]
    assert ref["gbps"] == pytest.approx(500.0)  # 2e6 B / 4 us
    assert fast["gbps"] == pytest.approx(2000.0) and fast["pct_roofline"] == pytest.approx(50.0)
    assert fast["speedup_vs_reference"] == pytest.approx(4.0) and ref["speedup_vs_reference"] == pytest.approx(1.0)
    table = report.timing_table(records)
    assert "fast" in table and "4.00" in table


def test_derive_takes_the_fastest_copy_variant_as_roofline():
    records = [
        dict(kind="copy", us=500.0, gbps=4000.0, method="xla"),
        dict(kind="timing", backend="k", T=1, R=1, NB=0, groups=1, us=1.0, bytes=2_500_000),
        dict(kind="copy_variant", variant="torch", us=400.0, gbps=5000.0, noise_us=1.0, method="torch copy_"),
    ]
    report.derive(records)
    assert [r["kind"] for r in records] == ["copy", "timing"]
    assert records[0]["gbps"] == 5000.0 and records[0]["variants"][-1]["kind"] == "torch"
    assert records[1]["pct_roofline"] == pytest.approx(50.0)  # 2.5e6 B / 1 us = 2500 GB/s of 5000


def test_slope_removes_constant_overhead(monkeypatch):
    """Fake executions on a fake clock: 3 ms of overhead + 1 ms per call, with jitter on the
    fourth run only; the slope is exactly 1000 us per call."""
    clock = [0.0]
    runs = [0]

    def fake(k):
        def run(*args):
            runs[0] += 1
            clock[0] += (3 + k) * 1e-3 + (0.5e-3 if runs[0] == 4 else 0.0)

        return run

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    per_call, t1, t2, noise = timing.slope(fake(1), fake(5), lambda i: (), 1, 5, reps=5, warmup=1)
    assert per_call == pytest.approx(1000.0)
    assert (t1, t2) == (pytest.approx(4000.0), pytest.approx(8000.0))
    assert noise == pytest.approx(0.0, abs=1e-6)  # one outlier does not move the medians or the MADs


def test_donated_chain_keeps_its_buffers_and_computes_the_calls():
    """The decode-loop form of the chain: its state stays in the same buffers from one execution
    to the next (no graph updates on a GPU), and call i computes what the consumer computes on
    set i with the previous call's prefix."""
    config = configs.Config(2, 1, 1)
    pool = inputs.DevicePool(inputs.host_case(config, 3), 3, l2_bytes=2**16)
    step = timing.consumer_step("reference", config)
    loop = timing.donated_loop(timing.donated_chain(step, 2, "chain"), step, pool, 3, "cpu")
    mailboxes, blocks, prefix = pool.lists[0]
    want = [prefix]
    for i in range(2):
        result = api.consumer(
            mailboxes[i], want[-1], blocks[i], *pool.weights, backend="reference", **timing.consumer_options(config)
        )
        want.append(result.prefix)
    # (a numpy view of a CPU buffer is a reference that stops its donation: values are read last)
    pointers = lambda: [x.unsafe_buffer_pointer() for x in (loop.state[0], *loop.state[1], loop.state[3])]  # noqa: E731
    jax.block_until_ready(loop())
    before = pointers()
    for _ in range(3):
        jax.block_until_ready(loop())
        assert pointers() == before
    fresh = timing.donated_loop(timing.donated_chain(step, 2, "chain"), step, pool, 3, "cpu")
    prefix_out, outputs, _, prelude = fresh()
    np.testing.assert_array_equal(np.asarray(prefix_out), np.asarray(want[2]))
    assert prelude.nbytes == timing.prelude_bytes("cpu") and np.asarray(prelude).max() == 1
    assert not np.asarray(outputs[2]).any()  # call 3 is the K2 chain's only


def test_pipelined_slope_dispatches_back_to_back_and_waits_once(monkeypatch):
    """The pipelined form's sample is the mean of PIPELINE executions dispatched back to back,
    waited for once, on the last one's results (a donated loop's earlier results are consumed by
    the next execution); a fake clock makes an execution of k calls take 1000 * k us."""
    clock = [0.0]
    waited = []

    def fake(k):
        def run():
            clock[0] += 1e-3 * k
            return ("result", k, clock[0])

        return run

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(timing.jax, "block_until_ready", lambda x: waited.append(x) or x)
    per_call, t1, t2, _ = timing.slope(fake(1), fake(5), lambda i: (), 1, 5, reps=3, warmup=0, pipelined=4)
    assert per_call == pytest.approx(1000.0)
    assert (t1, t2) == (pytest.approx(1000.0), pytest.approx(5000.0))
    assert len(waited) == 6 and all(w[0] == "result" for w in waited)  # one wait per sample


def test_pipelined_form_times_the_donated_chain():
    config = configs.Config(2, 1, 1)
    pool = inputs.DevicePool(inputs.host_case(config, 5), 3, l2_bytes=2**16)
    t = timing.time_backend("reference", pool, config, 1, 3, reps=1, profile=False, buffers="pipelined")
    assert t.buffers == "pipelined" and t.n_sets == 3
    assert f"{timing.PIPELINE} executions dispatched back to back" in t.method
    # the waited-for form of the same backend and T reuses the pipelined form's executables
    hits = timing.donated_chain.cache_info().hits
    timing.time_backend("reference", pool, config, 1, 3, reps=1, profile=False, buffers="donated")
    assert timing.donated_chain.cache_info().hits == hits + 2
    with pytest.raises(ValueError, match="buffers: expected one of"):
        timing.time_backend("reference", pool, config, 1, 3, reps=1, profile=False, buffers="piped")
    assert timing.parse_buffers("donated,pipelined") == ("donated", "pipelined")


def test_rotated_chain_computes_the_calls_on_each_set():
    config = configs.Config(2, 1, 1)
    pool = inputs.DevicePool(inputs.host_case(config, 4), 2, l2_bytes=2**16)
    step = timing.consumer_step("reference", config)
    loop = timing.rotated_loop(timing.consumer_chain(step, 2, "chain"), "cpu")
    for i in range(3):  # the lists in turn; the prelude buffer carried from one to the next
        mailboxes, blocks, prefix, *weights = pool.args(i)
        want = prefix
        for k in range(2):
            want = api.consumer(
                mailboxes[k], want, blocks[k], *weights, backend="reference", **timing.consumer_options(config)
            ).prefix
        got, outputs, _, _ = loop(*pool.args(i))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert len(outputs) == 2


def test_record_recovers_the_timings_a_stopped_process_logged(capsys):
    """A process stopped by its timeout writes no JSON; record.py takes the timings from the
    lines bench/runner.py logged (the same writer makes the lines here) and merges them beside
    the complete runs, marked."""
    record = benchmark_script("record")
    config = configs.Config(16, 64, 8)
    profiled = timing.Timing(9.5, 8, 32, 30, 32, 1494.0, 1722.0, 2.2, 16.3, "note", 16.34, 9.42, buffers="donated")
    rotated = timing.Timing(13.2, 8, 32, 30, 64, 1486.0, 1803.0, 7.5, buffers="rotated")
    pipelined = timing.Timing(9.3, 8, 32, 30, 32, 1490.0, 1713.0, 1.0, buffers="pipelined")
    for t in (profiled, rotated, pipelined):
        runner._log_timing("cute", config, t)
    recovered = record.records_from_log("timed out after 100 s: " + capsys.readouterr().err)
    assert [(r["backend"], r["T"], r["buffers"], r["us"], r["us_kernels"]) for r in recovered] == [
        ("cute", 64, "donated", 9.5, 9.42),
        ("cute", 64, "rotated", 13.2, None),
        ("cute", 64, "pipelined", 9.3, None),
    ]
    complete = [dict(recovered[0], us=10.1, us_kernels=None, recovered_from_log=False, device="gpu")]
    later = [dict(complete[0], us=9.2), dict(recovered[2], us=9.9)]
    (merged,) = record.merge([recovered, complete, later])
    assert merged["us_runs"] == [9.5, 10.1, 9.2] and merged["us"] == 9.5
    assert merged["us_runs_from_log"] == [0] and merged["us_kernels"] == 9.42 and merged["device"] == "gpu"
    assert merged["us_rotated"] == 13.2 and merged["us_rotated_runs"] == [13.2]
    assert merged["us_pipelined_runs"] == [9.3, 9.9] and merged["us_pipelined"] == pytest.approx(9.6)
    # the record's form named: the pipelined slopes are `us`, the host's dispatch time beside them
    runs = [[dict(r, us_host=1.5) if r["buffers"] == "pipelined" else r for r in run] for run in (recovered, later)]
    (merged,) = record.merge(runs, primary="pipelined")
    assert merged["us_runs"] == [9.3, 9.9] and merged["buffers"] == "pipelined"
    assert merged["us_host"] == 1.5 and merged["us_donated_runs"] == [9.5, 9.2] and merged["us_rotated"] == 13.2
    # a TP record carries both of its slopes itself
    tp_runs = [[dict(recovered[0], mode="peer", gpus=2, us=u, us_pipelined=p)] for u, p in ((8.0, 6.0), (9.0, 5.0))]
    (merged,) = record.merge(tp_runs)
    assert merged["us"] == 8.5 and merged["us_pipelined_runs"] == [6.0, 5.0] and merged["us_pipelined"] == 5.5


def test_record_takes_the_median_decode_step_over_processes():
    record = benchmark_script("record")
    step = lambda us, without, backend="cute": dict(  # noqa: E731
        kind="decode_step", backend=backend, loop="scan", mailbox="carried", T=1, us_step=us,
        us_step_without_consumer=without, us_consumer_per_layer=(us - without) / 16, us_step_runs=[us],
        method="m",
    )  # fmt: skip
    runs = [[step(200.0, 120.0), step(300.0, 100.0, "pallas")], [step(216.0, 120.0)], [step(184.0, 104.0)]]
    cute, pallas = record.merge_decode(runs)
    assert cute["us_step"] == 200.0 and cute["us_step_processes"] == [200.0, 216.0, 184.0]
    assert cute["us_consumer_per_layer"] == 5.0 and cute["us_consumer_per_layer_processes"] == [5.0, 6.0, 5.0]
    assert cute["record"] is True and "us_step_runs" not in cute and "median over 3 processes" in cute["method"]
    assert pallas["us_step"] == 300.0 and pallas["us_step_processes"] == [300.0]


def test_busy_time_counts_overlapping_kernels_once():
    # [0, 3000) and [2000, 5000) ns overlap by 1 us (a PDL launch waiting on its predecessor);
    # a gap [5000, 6000) is idle; [6000, 7000) and the nested [6200, 6500) add 1 us
    intervals = [(6200, 6500), (0, 3000), (2000, 5000), (6000, 7000)]
    assert timing.busy_us(intervals) == pytest.approx(6.0)
    assert timing.busy_us([]) == 0.0
    assert timing.busy_us([(10, 20), (20, 30)]) == pytest.approx(0.02)


def test_tp_processes_launch_every_process_and_merge_their_records(tmp_path):
    """`--tp 2 --processes 2` starts two jax.distributed processes of this module and merges what
    they wrote. On CPUs each process refuses (no GPUs) with a message naming the process count,
    and the launcher reports the failure: the plumbing, not a timing (that needs 2 GPUs)."""
    env = worker_env(JAX_PLATFORMS="cpu")
    out = tmp_path / "tp.json"
    argv = ["-m", "oproj_jax.bench.tp", "--tp", "2", "--tokens", "1", "--processes", "2", "--json", str(out)]
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    for i in (0, 1):
        assert f"--- process {i} (exit 1) ---" in done.stdout, done.stdout
    assert done.stdout.count("needs 2 GPUs (all of them when several processes share the mesh)") == 2, done.stdout
    assert [r["process_index"] for r in json.loads(out.read_text())] == [0, 1]


def test_decode_step_forms_agree_and_the_carried_mailbox_holds_the_last_partial():
    """The decode step's loop forms compute the same thing (reference backend, 2 layers, T=1), and
    the carried mailbox leaves the step with the last layer's partial in slot 0, the peers' slots
    untouched. On the CPU: a GPU's GEMMs may round differently in the two loop forms."""
    from oproj_jax.bench import decode_step as D

    with jax.default_device(jax.devices("cpu")[0]):
        weights, (attn, prefix, slots, blocks) = D.make_weights(2, 1), D.make_state(1)
        got = {
            loop: D.step_fn("reference", loop, 2)(attn, jnp.copy(prefix), jnp.copy(slots), blocks, weights)
            for loop in ("scan", "unrolled")
        }
    for a, b in zip(got["scan"], got["unrolled"]):
        np.testing.assert_array_equal(testing.bits(a), testing.bits(b))
    np.testing.assert_array_equal(testing.bits(got["scan"][2][1:]), testing.bits(slots[1:]))
    assert not np.array_equal(testing.bits(got["scan"][2][0]), testing.bits(slots[0]))
    records = D.run(["reference"], [1], layers=2, reps=1, repeats=1, log=lambda m: None, mailboxes=D.MAILBOXES)
    assert [(r["mailbox"], r["loop"]) for r in records] == [
        (m, loop) for m in D.MAILBOXES for loop in ("scan", "unrolled")
    ]
    assert all(r["us_step"] > 0 and r["us_step_without_consumer"] > 0 for r in records)


def test_tp_step_timing_runs_on_cpu_devices():
    """bench.tp's timing path (chains of dependent TP steps, their inputs, the record) on 2 CPU
    devices with XLA's all-reduce and the reference consumer: the plumbing, not a timing."""
    from jax.sharding import Mesh

    from oproj_jax.bench import tp

    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    record = tp.time_combo(mesh, "psum", "reference", configs.Config(2, 1, 8, groups=4), 1, False, chain=(1, 3))
    assert (record["kind"], record["k1"], record["k2"], record["gpus"], record["processes"]) == ("timing", 1, 3, 2, 1)
    assert np.isfinite(record["us"]) and record["us_kernels"] is None
    assert np.isfinite(record["us_pipelined"]) and "dispatched back to back" in record["method"]
    slow_psum = dict(record, us=30.0, us_pipelined=24.0)
    peer = dict(record, mode="peer", backend="cute", us=10.0, us_pipelined=6.0)
    assert "peer/cute T=1: 3.0x faster than psum/reference (pipelined: 4.0x)" in tp.summary([slow_psum, peer])
