#!/bin/bash
# One device call: environment, the kernel test suite, then a timing script. Logs land in $OUT.
# Usage (from the repo root, on the device machine): bash tools/gpu/run.sh [peers|sweep|none] [pytest args...]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
MODE=${1:-peers}; shift
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv 2>&1 | tee $OUT/env.log
python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name(0))" 2>&1 | tee -a $OUT/env.log
if [ "$1" != "skip" ]; then
  timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest tests/test_kernels.py -q -rfEs --junitxml=$OUT/junit.xml -o junit_family=legacy -p no:cacheprovider --durations=8 "$@" 2>&1 | tee $OUT/pytest.log | tail -40
fi
if [ "$MODE" != "none" ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 tools/gpu/bench.py $MODE --out $OUT $BENCH_ARGS 2>&1 | tee $OUT/$MODE.log
fi
