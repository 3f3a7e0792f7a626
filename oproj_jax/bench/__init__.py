"""Benchmark harness for the consumer: `python -m oproj_jax.bench` (CLI) and benchmarks/record.py.

backends.py      which registry backends (and the torch baseline) can run here
inputs.py        host cases (make_inputs + numpy prefix model), L2-cold device input pools
timing.py        per-call device time: slope of unrolled dependent chains; profiler cross-check;
                 copy bandwidth (the roofline)
torch_timing.py  the PyTorch baseline (torch_ref on CUDA, CUDA graphs), imported lazily
checks.py        correctness on fresh data with poisoned outputs
report.py        derived figures, table, JSON, plot
runner.py        the sweeps both entry points share
"""
