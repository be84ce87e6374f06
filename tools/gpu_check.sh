#!/usr/bin/env bash
# On the GPU machine, in one command: versions, the test suite with compiled kernels, then
# (BENCH=1) the benchmark, cut at BENCH_SECONDS. Logs and reports go to $OUT when set (the device
# tool), else to ./gpu_out. Arguments: the test paths (default: tests).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -q -n "${WORKERS:-8}" -p no:cacheprovider "${@:-tests}" \
  2>&1 | tee "$out/pytest.log" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}"
if [ "${BENCH:-0}" = 1 ]; then
  python3 -m rl_triton.bench --out "$out/bench" --max-seconds "${BENCH_SECONDS:-300}" ${BENCH_ARGS:-} \
    > "$out/bench.log" 2>&1
  echo "bench exit: $?"; grep -v '^\[' "$out/bench.log" | tail -60
fi
