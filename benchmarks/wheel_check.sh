#!/bin/bash
# The package as a user installs it, on a GPU machine without the CuTe DSL: the wheel in .whl/
# (pip wheel . --no-deps -w .whl) installed with pip into a fresh directory, then its GPU tests
# run against that install: every prebuilt cubin of the production family on fresh random data
# (tests/test_cute_family_gpu.py), the backend contract, autodiff and the backend choice.
# Usage (repository root): bash benchmarks/wheel_check.sh
# The wheel goes in without its dependencies (--no-deps --no-index: the GPU machine has no network); those the machine
# lacks (platformdirs, filelock, jax-triton where absent) come from $OPROJ_WHEEL_DEPS, a directory put on the path
# after the install (gpu_stages.sh passes .dev/site).
set -eu
site=${OPROJ_WHEEL_SITE:-/tmp/oproj_site}
rm -rf "$site"
python3 -m pip install --no-deps --no-index --target "$site" .whl/*.whl
# run from an empty directory: `import oproj_jax` must find the installed wheel, not this
# checkout (python puts the working directory first on sys.path, also in pytest's workers)
repo=$PWD
path=$site${OPROJ_WHEEL_DEPS:+:$OPROJ_WHEEL_DEPS}
run=$(mktemp -d)
cd "$run"
PYTHONPATH=$path python3 -c "
import sys, oproj_jax
print('oproj_jax from', oproj_jax.__file__)
sys.exit(0 if oproj_jax.__file__.startswith('$site') else 1)"
PYTHONPATH=$path python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short -n 4 --dist load --rootdir "$repo" \
  "$repo"/tests/test_cute_family_gpu.py "$repo"/tests/test_contract.py "$repo"/tests/test_autodiff.py \
  "$repo"/tests/test_backend_choice.py
