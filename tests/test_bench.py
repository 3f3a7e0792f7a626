"""CPU smoke tests of the benchmark harness (oproj_jax.bench): the CLI off a GPU (it times
nothing by default; --cpu-anyway is a plumbing pass on the reference at T=1 with no time
printed), the records, the table and the plot on made-up figures, backend selection messages,
and the harness's own pieces (prefix model, check flags, derived figures, slopes on a fake
clock, the record's max rule)."""

import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import benchmark_script, worker_env

from oproj_jax import api, configs, contract, reference, testing
from oproj_jax.bench import __main__ as cli
from oproj_jax.bench import backends as bench_backends
from oproj_jax.bench import checks, inputs, report, runner, timing
from oproj_jax.pallas import consumer as pallas_consumer

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


OFF_GPU = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CLI off a GPU (here is one)")
NEGATIVE = re.compile(r"(?<![\w.])-\d")  # a minus sign that starts a number (not "1.8e-03", "R2-T1", a date)
PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%")


def run_cli(argv) -> dict:
    """cli.main(argv) with its stdout and stderr captured, and how long it took."""
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return dict(rc=rc, stdout=out.getvalue(), stderr=err.getvalue(), seconds=time.perf_counter() - start)


def assert_physical(text: str) -> None:
    """No negative number and no percentage above 100 in what the CLI printed."""
    assert not NEGATIVE.search(text), NEGATIVE.search(text)
    assert all(float(p) <= 100.0 for p in PERCENT.findall(text)), PERCENT.findall(text)


@OFF_GPU
def test_cli_by_default_off_the_gpu_times_nothing_and_says_why(monkeypatch):
    """Default arguments on a CPU: no timing at all (nothing a CPU measures is a performance
    figure), a plain message saying so and what a GPU run would time, exit 0, in seconds; the
    Pallas interpreter is never started."""
    timed = []
    monkeypatch.setattr(timing, "time_backend", lambda *a, **k: timed.append(a[0]))
    monkeypatch.setattr(timing, "copy_bandwidth", lambda *a, **k: timed.append("copy"))
    monkeypatch.setattr(pallas_consumer, "consumer_with", lambda *a, **k: timed.append("pallas"))
    got = run_cli([])
    assert got["rc"] == 0 and got["seconds"] < 60
    assert "not performance figures" in got["stdout"] and "nothing is timed" in got["stdout"]
    assert "On a CUDA GPU this command times every backend that can run there at T = 1,8,64,512,4096" in got["stdout"]
    assert "--cpu-anyway" in got["stdout"]
    assert_physical(got["stdout"] + got["stderr"])
    assert "us/call" not in got["stdout"] and "GB/s" not in got["stdout"]
    assert timed == []  # no chain, no copy roofline, no Pallas interpreter


@pytest.fixture(scope="module")
def plumbing_run(tmp_path_factory):
    """--cpu-anyway with the default backends on a small shape: the plumbing pass off the GPU."""
    if jax.default_backend() == "gpu":
        pytest.skip("the plumbing pass is the CLI off a GPU (here is one)")
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = out / "r.json", out / "r.png"
    argv = ["--cpu-anyway", "--tokens", "1", "--ranks", "2", "--nb", "1", "--seed", "5"]
    got = run_cli([*argv, "--json", str(json_path), "--plot", str(plot_path)])
    return dict(got, json=json_path, plot=plot_path)


def test_cli_cpu_anyway_checks_and_runs_the_chains_without_times(plumbing_run):
    got = plumbing_run
    assert got["rc"] == 0, got["stdout"] + got["stderr"]
    assert got["seconds"] < 120, "the T=1 plumbing pass should take seconds on a CPU"
    assert "not performance figures" in got["stdout"]
    for figure in ("us/call", "us(host)", "GB/s", "% copy", "x ref", "roofline"):
        assert figure not in got["stdout"], figure
    rows = [line.split() for line in got["stdout"].splitlines()]
    assert ["reference", "pipelined", "1", "R2-T1-NB1-G4", "ok", "ran"] in rows
    assert_physical(got["stdout"] + got["stderr"])
    # 'all' leaves the interpreted Pallas kernel out unless it is named
    assert "not running pallas: off a GPU it runs in Mosaic GPU's interpreter" in got["stderr"]
    assert not any(row and row[0] == "pallas" for row in rows)


def test_cli_cpu_anyway_records_no_time(plumbing_run):
    records = json.loads(plumbing_run["json"].read_text())
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "header" and kinds.count("header") == 1
    header = records[0]
    assert header["performance_figures"] is False and header["platform"] == jax.default_backend()
    assert {"jax", "jaxlib", "torch", "triton", "python", "driver"} <= set(header["versions"])
    assert "timing" not in kinds and "copy" not in kinds  # nothing a CPU timed
    (plumbing,) = [r for r in records if r["kind"] == "plumbing"]
    assert (plumbing["backend"], plumbing["buffers"], plumbing["T"], plumbing["R"]) == ("reference", "pipelined", 1, 2)
    assert not any(key.startswith("us") or key.startswith("t_k") for key in plumbing)
    (check,) = [r for r in records if r["kind"] == "check"]
    assert CHECK_FIELDS <= set(check) and check["ok"] is True
    assert not plumbing_run["plot"].exists()
    assert "not plotting: no performance figures off the GPU" in plumbing_run["stderr"]


def _timing(us, pipelined=None, host=None, donated=None, buffers="pipelined", noise=0.5) -> timing.Timing:
    t = timing.Timing(us, 8, 32, 30, 32, 1490.0, 1713.0, noise, buffers=buffers)
    t.us_pipelined, t.us_host, t.us_donated = pipelined, host, donated
    return t


def test_timing_record_carries_what_a_caller_pays_and_its_parts():
    config = configs.Config(16, 8, 8)
    t = _timing(5.5, pipelined=5.1, host=5.5, donated=6.3)
    record = runner._timing_record("pallas", config, t)
    assert TIMING_FIELDS - {"gbps", "pct_roofline", "speedup_vs_reference"} <= set(record)
    assert (record["us"], record["us_pipelined"], record["us_host"], record["us_donated"]) == (5.5, 5.1, 5.5, 6.3)
    assert record["buffers"] == "pipelined" and record["bytes"] == configs.min_bytes(config)
    report.derive([dict(kind="copy", gbps=4000.0), record])
    assert TIMING_FIELDS <= set(record) and record["gbps"] == pytest.approx(record["bytes"] / 5.5 / 1e3)


def test_timing_table_shows_every_form_and_only_physical_figures():
    config = configs.Config(16, 1, 8)
    ok = runner._timing_record("reference", config, _timing(40.0, pipelined=40.0, host=3.0, donated=44.0))
    fast = runner._timing_record("cute", config, _timing(3.1, pipelined=3.1, host=None, donated=3.3))
    noisy = runner._timing_record("pallas", config, _timing(-0.4, pipelined=-0.4, host=None, donated=-1.2))
    records = [dict(kind="copy", gbps=40.0), ok, fast, noisy]  # cute's bytes at 3.1 us: above this copy
    report.derive(records)
    assert fast["pct_roofline"] > 100 and noisy["gbps"] is None and noisy["speedup_vs_reference"] is None
    table = report.timing_table(records)
    assert "copy bandwidth (roofline): 40 GB/s" in table
    assert "us/call" in table and "us(pipe)" in table and "us(host)" in table and "us(wait)" in table
    assert "% copy" in table and "x ref" in table
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] in (["cute"], ["pallas"])}
    assert rows["cute"][1:7] == ["pipelined", "1", "3.1", "3.1", "-", "3.3"]
    assert rows["cute"][-2:] == [">100*", "12.90"]  # 40 / 3.1
    assert rows["pallas"][3:7] == ["-", "-", "-", "-"]  # slopes below zero: within the noise, not shown
    assert '">100*": more bytes per second than the copy measured in the same run moves' in table
    assert_physical(table)


def test_cli_says_why_a_backend_is_unavailable(capsys):
    status = bench_backends.backend_status(jax.default_backend())
    missing = [name for name, reason in status.items() if reason is not None]
    if not missing:
        pytest.skip("every backend runs here")
    off_gpu = [] if jax.default_backend() == "gpu" else ["--cpu-anyway"]
    assert cli.main([*off_gpu, "--backends", missing[0], "--tokens", "1"]) == 2
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
    with pytest.raises(SystemExit):
        cli.main(["--decode-step", "--moe-width", "0"])
    assert "--moe-width: expected 1..inf, got 0" in capsys.readouterr().err


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
    return contract.ConsumerResult(bad_prefix, good.output.at[0, 5].set(jnp.nan), good.xmoe)


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


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (the bench extra)")
def test_write_plot_draws_the_times(tmp_path):
    config = configs.Config(16, 1, 8)
    records = [
        dict(kind="header", device="NVIDIA H200"),
        dict(kind="copy", gbps=4000.0),
        *(runner._timing_record("cute", configs.Config(16, t, 8), _timing(us, us)) for t, us in ((1, 3.1), (8, 4.2))),
        runner._timing_record("pallas", config, _timing(-0.5, -0.5)),  # below zero: left off the log axis
    ]
    report.derive(records)
    assert report.write_plot(records, str(tmp_path / "p.png")) is None
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


class FakeGPU:
    """A host and a device on one fake clock (us). An execution of a k-call chain takes the host
    `host0 + k * host` to dispatch (the call returns then) and the device `prelude + k * device`,
    starting once it is dispatched and the device is free; waiting on a result moves the clock
    to its end."""

    def __init__(self, host: float, device: float, host0: float = 20.0, prelude: float = 1000.0):
        self.host, self.device, self.host0, self.prelude = host, device, host0, prelude
        self.now = self.free = 0.0

    def clock(self) -> float:  # perf_counter, in seconds
        return self.now / 1e6

    def chain(self, k: int):
        def run(*args):
            self.now += self.host0 + k * self.host
            self.free = max(self.now, self.free) + self.prelude + k * self.device
            return ("done", self.free)

        return run

    def wait(self, out):
        self.now = max(self.now, out[1])
        return out


def _fake_figures(monkeypatch, gpu: FakeGPU, k1=1, k2=5, n=4):
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=gpu.clock))
    monkeypatch.setattr(timing.jax, "block_until_ready", gpu.wait)
    fn1, fn2 = gpu.chain(k1), gpu.chain(k2)
    pipelined = timing.slope(fn1, fn2, lambda i: (), k1, k2, reps=3, warmup=1, pipelined=n)[0]
    waited = timing.slope(fn1, fn2, lambda i: (), k1, k2, reps=3, warmup=0)[0]
    host = timing.host_dispatch_us(fn1, fn2, k1, k2, reps=3)
    return pipelined, host, waited, timing.caller_pays(pipelined, host)


def test_a_host_slower_than_the_device_sets_what_a_caller_pays(monkeypatch):
    """The prelude (1 ms per execution) lets the host catch up between executions, so the
    pipelined slope stays near the device's 3 us per call although the host needs 7: a decode
    loop, with no such pass between its steps, pays the 7. `us` takes the larger."""
    pipelined, host, waited, us = _fake_figures(monkeypatch, FakeGPU(host=7.0, device=3.0), n=4)
    assert pipelined == pytest.approx(3.0 + 7.0 / 4)  # device-bound, plus a quarter of the first dispatch
    assert host == pytest.approx(7.0)
    assert waited == pytest.approx(10.0)  # waited for: host and device one after the other
    assert us == host and us > pipelined


def test_a_device_slower_than_the_host_sets_what_a_caller_pays(monkeypatch):
    pipelined, host, waited, us = _fake_figures(monkeypatch, FakeGPU(host=1.0, device=5.0), n=8)
    assert pipelined == pytest.approx(5.0 + 1.0 / 8) and host == pytest.approx(1.0)
    assert waited == pytest.approx(6.0) and us == pipelined


def test_a_negative_host_difference_is_not_measured(monkeypatch):
    """The host's dispatch time per call is a difference of two medians: where jitter makes it
    negative it is reported as None (not measured), and `us` is the pipelined slope."""
    gpu = FakeGPU(host=1.0, device=5.0)
    gpu.chain = lambda k: FakeGPU.chain(gpu, k) if k == 1 else _quicker(gpu, k)
    pipelined, host, _, us = _fake_figures(monkeypatch, gpu)
    assert host is None and us == pipelined
    assert timing.dispatch_slope(gpu.chain(1), gpu.chain(5), 1, 5, reps=3) < 0  # the difference as measured
    assert timing.caller_pays(None, 2.0) == 2.0 and timing.caller_pays(None, None) is None


def _quicker(gpu: FakeGPU, k: int):
    """The k-call chain's dispatch returning 10 us sooner than the 1-call chain's."""
    run = FakeGPU.chain(gpu, k)

    def quick(*args):
        before = gpu.now
        out = run(*args)
        gpu.now = before + gpu.host0 - 10.0
        return out

    return quick


def test_time_backend_records_the_max_and_its_parts(monkeypatch):
    """The pipelined form's Timing: us = max(us_pipelined, us_host), the waited slope of the same
    executables beside them, on a real (CPU) chain with the host's figure stood in."""
    config = configs.Config(2, 1, 1)
    pool = inputs.DevicePool(inputs.host_case(config, 6), 3, l2_bytes=2**16)
    monkeypatch.setattr(timing, "host_dispatch_us", lambda *a, **k: 1e6)
    t = timing.time_backend("reference", pool, config, 1, 3, reps=1, profile=False, buffers="pipelined")
    assert t.us == 1e6 and t.us_host == 1e6 and t.us_pipelined < 1e6 and t.us_donated is not None
    assert "us = max(that slope, the host's dispatch time per call us_host)" in t.method
    monkeypatch.setattr(timing, "host_dispatch_us", lambda *a, **k: None)
    t = timing.time_backend("reference", pool, config, 1, 3, reps=1, profile=False, buffers="pipelined")
    assert t.us == t.us_pipelined and t.us_host is None
    t = timing.time_backend("reference", pool, config, 1, 3, reps=1, profile=False, buffers="donated")
    assert t.us == t.us_donated and t.us_pipelined is None and t.us_host is None


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
    pipelined_log = recovered[2]
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
    # pipelined records carry their parts: us (the max rule per process), the slope, the host, the waited slope
    parts = [(9.6, 9.3, 9.6, 10.4), (9.9, 9.9, None, 10.8), (9.4, 9.4, 1.2, 10.0)]
    runs = [[dict(pipelined_log, us=u, us_pipelined=p, us_host=h, us_donated=d)] for u, p, h, d in parts]
    (merged,) = record.merge(runs)
    assert merged["us"] == 9.6 and merged["us_runs"] == [9.6, 9.9, 9.4]
    assert merged["us_pipelined"] == 9.4 and merged["us_host_runs"] == [9.6, 1.2] and merged["us_donated"] == 10.4


def test_record_recovers_the_pipelined_parts_and_decode_steps_from_a_log(capsys):
    """The honest form's parts (slope, host, waited) and the decode step's line come back from a
    stopped process's log, each at the precision it was logged; "-" (not measured) comes back as
    absent, never as a number."""
    record = benchmark_script("record")
    config = configs.Config(16, 1, 8)
    t = timing.Timing(4.8, 8, 32, 12, 32, 1117.0, 1219.0, 0.7, buffers="pipelined")
    t.us_pipelined, t.us_host, t.us_donated = 4.27, 4.76, 3.18
    quiet = timing.Timing(2.4, 8, 32, 12, 32, 1122.0, 1181.0, 1.4, buffers="pipelined")
    quiet.us_pipelined, quiet.us_donated = 2.43, 1.89
    runner._log_timing("pallas", config, t)
    runner._log_timing("cute", config, quiet)
    log = capsys.readouterr().err
    log += "decode step T=   1 carried scan     cute         563.9 us/step, without consumer    480.5 -> consumer   5.21 us/layer\n"
    timings, step = record.records_from_log(log)[:2], record.records_from_log(log)[2]
    assert [(r["backend"], r["us"], r["us_pipelined"], r.get("us_host"), r["us_donated"]) for r in timings] == [
        ("pallas", 4.8, 4.27, 4.76, 3.18),
        ("cute", 2.4, 2.43, None, 1.89),
    ]
    assert (step["kind"], step["mailbox"], step["loop"], step["T"], step["us_consumer_per_layer"]) == (
        "decode_step",
        "carried",
        "scan",
        1,
        5.21,
    )
    assert step["us_step"] == 563.9 and step["us_step_without_consumer"] == 480.5 and step["recovered_from_log"]


def test_record_keeps_the_finished_processes_logs_when_stopped_from_outside(tmp_path, capsys, monkeypatch):
    """record.py writes the logs of the processes done so far after each one: a run stopped
    from outside (here during its third process) leaves them, --relog makes the record from
    them, and a run that finishes removes them (its record holds them)."""
    record = benchmark_script("record")
    runner._log_timing(
        "cute", configs.Config(16, 64, 8), timing.Timing(9.3, 8, 32, 30, 32, 1490.0, 1713.0, 1.0, buffers="pipelined")
    )
    log = capsys.readouterr().err
    calls = []

    def bench(args, timeout, module="oproj_jax.bench"):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt  # stopped while the third process runs
        return [], f"{log}process {len(calls)}\n"

    monkeypatch.setattr(record, "bench", bench)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    with pytest.raises(KeyboardInterrupt):
        record.main(["--out-dir", str(stopped), "--backends", "cute", "--tokens", "64", "--decode-tokens", ""])
    kept = stopped / "record-logs.json"
    assert sorted(json.loads(kept.read_text())["logs"]) == ["process 0", "process 1"]
    assert [p.name for p in stopped.iterdir()] == ["record-logs.json"]
    again = tmp_path / "again"
    again.mkdir()
    record.main(["--out-dir", str(again), "--relog", str(kept), "--device", "NVIDIA H200"])
    (written,) = again.iterdir()
    (timing_record,) = [r for r in json.loads(written.read_text())["records"] if r.get("kind") == "timing"]
    assert timing_record["us_runs"] == [9.3, 9.3] and timing_record["us_runs_from_log"] == [0, 1]
    monkeypatch.setattr(record, "bench", lambda args, timeout, module="": ([], log))
    done = tmp_path / "done"
    done.mkdir()
    record.main(["--out-dir", str(done), "--backends", "cute", "--tokens", "64", "--decode-tokens", ""])
    assert len(list(done.glob("*-record.json"))) == 1 and not (done / "record-logs.json").exists()


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
    untouched; passing the partial instead (mailbox "partial") gives the same step and writes no
    slot. On the CPU: a GPU's GEMMs may round differently in the two loop forms."""
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
    # the partial passed in place of slot 0: the same step, and the mailbox not written
    with jax.default_device(jax.devices("cpu")[0]):
        own = D.step_fn("reference", "scan", 2, "partial")(attn, jnp.copy(prefix), jnp.copy(slots), blocks, weights)
    for a, b in zip(own[:2], got["scan"][:2]):
        np.testing.assert_array_equal(testing.bits(a), testing.bits(b))
    np.testing.assert_array_equal(testing.bits(own[2]), testing.bits(slots))
    records = D.run(["reference"], [1], layers=2, reps=1, repeats=1, log=lambda m: None, mailboxes=D.MAILBOXES)
    assert [(r["mailbox"], r["loop"]) for r in records] == [
        (m, loop) for m in D.MAILBOXES for loop in ("scan", "unrolled")
    ]
    assert all(r["us_step"] > 0 and r["us_step_without_consumer"] > 0 for r in records)


def test_decode_step_moe_width_sets_the_stand_ins_weights_and_is_recorded():
    """moe_width is the MoE stand-in's F: w_up [L, H, F], w_down [L, F, H]; records carry it, and
    a width that is not a positive int is refused naming the argument."""
    from oproj_jax.bench import decode_step as D

    with jax.default_device(jax.devices("cpu")[0]):
        weights = D.make_weights(2, 1, moe_width=64)
        records = D.run(
            ["reference"],
            [1],
            layers=2,
            reps=1,
            repeats=1,
            log=lambda m: None,
            mailboxes=("carried",),
            loops=("scan",),
            moe_width=64,
            figures=False,
        )
    assert weights["w_up"].shape == (2, D.H, 64) and weights["w_down"].shape == (2, 64, D.H)
    assert [r["moe_width"] for r in records] == [64]
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="moe_width: expected a positive int"):
            D.make_weights(2, 1, moe_width=bad)


def test_decode_step_profile_sums_each_kernel_per_layer_and_the_busy_time():
    """The kernel-by-kernel fields of a profiled decode step: each name's durations summed over
    the traced steps and divided by steps x layers, largest first; the busy time counts
    overlapping kernels once. An unknown loop form is refused by name."""
    from oproj_jax.bench import decode_step as D

    events = [(0, 1000, "gemm"), (500, 1500, "consumer"), (2000, 3000, "gemm"), (2500, 2600, "copy")]
    times, busy = D.per_layer(events, steps=2, layers=2)
    assert list(times) == ["gemm", "consumer", "copy"]
    assert times == {"gemm": 0.5, "consumer": 0.25, "copy": 0.025}
    assert busy == 0.625  # [0, 1500] and [2000, 3000] ns over 4 layers
    with pytest.raises(ValueError, match="loop: expected one of"):
        D.step_fn("reference", "fori", 2)


def test_tp_step_timing_runs_on_cpu_devices():
    """bench.tp's timing path (chains of dependent TP steps, their inputs, the record) on 2 CPU
    devices with XLA's all-reduce and the reference consumer: the plumbing, not a timing."""
    from jax.sharding import Mesh

    from oproj_jax.bench import tp

    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    record = tp.time_combo(mesh, "psum", "reference", configs.Config(2, 1, 8, groups=4), 1, False, chain=(1, 3))
    assert (record["kind"], record["k1"], record["k2"], record["gpus"], record["processes"]) == ("timing", 1, 3, 2, 1)
    assert np.isfinite(record["us"]) and record["us_kernels"] is None
    assert np.isfinite(record["us_pipelined"]) and np.isfinite(record["us_donated"])
    assert record["us_host"] is None or record["us_host"] >= 0  # a negative difference is not measured
    assert record["us"] == timing.caller_pays(record["us_pipelined"], record["us_host"])
    assert "dispatched back to back" in record["method"] and "us = max(us_pipelined, us_host)" in record["method"]
    slow_psum = dict(record, us=24.0, us_donated=30.0)
    peer = dict(record, mode="peer", backend="cute", us=6.0, us_donated=10.0)
    noisy = dict(record, mode="oneshot", backend="cute", us=-0.5)
    summary = tp.summary([slow_psum, peer, noisy])
    assert "peer/cute T=1: 4.0x faster than psum/reference (waited for: 3.0x)" in summary
    assert_physical(summary)


def test_decode_step_table_names_the_device_and_shows_no_negative_share():
    step = lambda backend, us, without: dict(  # noqa: E731
        kind="decode_step", backend=backend, loop="scan", mailbox="carried", T=1, layers=16, us_step=us,
        us_step_without_consumer=without, us_consumer_per_layer=(us - without) / 16, device="NVIDIA H200",
    )  # fmt: skip
    table = report.decode_step_table([step("cute", 560.0, 480.0), step("reference", 478.0, 480.0)])
    assert table.splitlines()[0].endswith("on one NVIDIA H200")
    rows = {line.split()[0]: line.split() for line in table.splitlines()[3:5]}
    assert rows["cute"][-1] == "5.00" and rows["reference"][-1] == "-"
    assert "did not take longer than without it (within the noise)" in table
    assert_physical(table)
    cpu = dict(step("reference", 0, 0), device="cpu")
    plain = report.decode_step_table([cpu], figures=False)
    assert plain.splitlines()[0].endswith("on one cpu") and "one GPU" not in plain and "us/step" not in plain


def test_record_joins_a_chains_run_and_a_decode_run_of_one_device(tmp_path, monkeypatch):
    """The chains and the decode step measured by separate runs (each fits a bounded call) make
    one record: the first run's header, both runs' records and logs; outputs of two devices are
    refused by name."""
    record = benchmark_script("record")
    header = dict(kind="header", device="NVIDIA H200", seed=1)
    chain = dict(kind="timing", backend="cute", T=1, R=16, NB=8, us=2.5, us_kernels=2.3, buffers="pipelined",
                 device="NVIDIA H200", method="m")  # fmt: skip
    step = dict(kind="decode_step", backend="cute", loop="scan", mailbox="carried", T=1, us_step=570.0,
                us_step_without_consumer=490.0, us_consumer_per_layer=5.0, device="NVIDIA H200", method="m")  # fmt: skip
    monkeypatch.setattr(record, "bench", lambda args, timeout, module="": ([header, chain], "chain log"))
    record.main(
        ["--out-dir", str(tmp_path), "--backends", "cute", "--tokens", "1", "--decode-tokens", "", "--name", "a"]
    )
    monkeypatch.setattr(record, "bench", lambda args, timeout, module="": ([dict(header, seed=2), step], "step log"))
    record.main(["--out-dir", str(tmp_path), "--processes", "0", "--decode-tokens", "1", "--name", "b"])
    (a,), (b,) = tmp_path.glob("*-a.json"), tmp_path.glob("*-b.json")
    record.main(["--out-dir", str(tmp_path), "--join", str(a), str(b), "--name", "record"])
    (joined,) = tmp_path.glob("*-nvidia-h200-record.json")
    records = json.loads(joined.read_text())["records"]
    assert records[0]["seed"] == 1 and records[0]["joined_from"] == [a.name, b.name]
    assert [(r["kind"], r.get("record")) for r in records[1:]] == [("timing", True), ("decode_step", True)]
    assert records[1]["us_runs"] == [2.5, 2.5, 2.5] and records[2]["us_consumer_per_layer_processes"] == [5.0] * 3
    logs = json.loads(joined.read_text())["logs"]
    assert logs[f"{a.name}: process 0"] == "chain log" and logs[f"{b.name}: decode step 2"] == "step log"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(records=[dict(header, device="NVIDIA H100")], logs={})))
    with pytest.raises(SystemExit, match="different devices"):
        record.main(["--out-dir", str(tmp_path), "--join", str(a), str(other)])


def test_decode_step_times_the_captured_consumer_beside_the_node():
    """captures=(False, True): each backend's step also with stream_capture=True, its records
    marked and labelled "+capture" in the log and the table; record.py reads the label back from
    a log and keeps the two apart when it takes the medians."""
    from oproj_jax.bench import decode_step as D
    from oproj_jax.bench import report

    lines = []
    with jax.default_device(jax.devices("cpu")[0]):
        records = D.run(
            ["reference"], [1], layers=2, reps=1, repeats=1, log=lines.append, mailboxes=("carried",), loops=("scan",),
            figures=False, captures=(False, True),
        )  # fmt: skip
    assert [r.get("stream_capture") for r in records] == [None, True]
    assert ["reference+capture" in line for line in lines] == [False, True]
    assert "reference+capture" in report.decode_step_table(records, figures=False)
    record = benchmark_script("record")
    log = (
        "decode step T=   1 carried scan     cute         563.9 us/step, without consumer    480.5 -> consumer   5.21 us/layer\n"
        "decode step T=   1 carried scan     cute+capture 557.5 us/step, without consumer    480.5 -> consumer   4.81 us/layer\n"
    )
    node, captured = record.records_from_log(log)
    assert (node["backend"], node.get("stream_capture")) == ("cute", None)
    assert (captured["backend"], captured["stream_capture"], captured["us_consumer_per_layer"]) == ("cute", True, 4.81)
    merged = record.merge_decode([[node, captured], [node, captured]])
    assert [(r.get("stream_capture"), r["us_consumer_per_layer"]) for r in merged] == [(None, 5.21), (True, 4.81)]
