#!/usr/bin/env bash
# On the GPU machine: versions, the whole test suite with compiled kernels, then (optionally) the
# benchmark. Logs go to $OUT when set (the device tool), else to ./gpu_out.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
workers=${WORKERS:-8}
timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -q -n "$workers" -p no:cacheprovider "${@:-tests}" \
  2>&1 | tee "$out/pytest.log" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}"
