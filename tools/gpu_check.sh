#!/usr/bin/env bash
# On the GPU machine, in one command: versions, the test suite with compiled kernels, then
# (AB=1, or AB_WARM=1 then AB_TIME=1 in two calls) the A/B of every forward cell of at least 4 MB
# against the base revision prepared in .ab/ (tools/ab_base.py; AB_BWD=1: the backward cells'
# too, AB_ARGS: more arguments of its `time`, e.g. --rep-ms 15), (FULLCALL=1) GAE's full call at
# 4096x128 against the base and rl-triton 0.1.3 (.ab/paper/src), and (BENCH=1) the benchmark,
# cut at BENCH_SECONDS. Logs and reports go to $OUT when set (the device tool), else to
# ./gpu_out. Arguments: the test paths (default: tests, the whole suite; SKIP_TESTS=1 runs none).
# Wheels in .whl (tools/gpu_wheels.sh fetches them on a machine with an index) are installed
# first, into /tmp/rl_triton_site.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/rl_triton_site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/rl_triton_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
if [ "${AB:-0}" = 1 ] || [ "${AB_WARM:-0}" = 1 ]; then  # compile both sides' kernels in parallel first (Triton's disk cache)
  n=${WARM_PROCS:-16}
  for k in $(seq 0 $((n - 1))); do
    RL_TRITON_HOST=python python3 tools/ab_base.py warm --shard "$k/$n" > "$out/warm_$k.log" 2>&1 &
    if [ "${AB_BWD:-0}" = 1 ]; then
      RL_TRITON_HOST=python python3 tools/ab_base.py warm --bwd --shard "$k/$n" > "$out/warmb_$k.log" 2>&1 &
    fi
  done
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -n "${WORKERS:-$(nproc)}" --dist worksteal -p no:cacheprovider \
    -rfEs --durations=30 --junitxml="$out/junit.xml" "${@:-tests}" 2>&1 | tee "$out/pytest.log" | tail -80
  echo "pytest exit: ${PIPESTATUS[0]}"
fi
wait
if [ "${AB:-0}" = 1 ] || [ "${AB_TIME:-0}" = 1 ]; then
  tail -n 3 "$out"/warm*_*.log | grep -i -B2 error | head -20
  RL_TRITON_HOST=python timeout "${AB_TIMEOUT:-420}" python3 tools/ab_base.py time ${AB_ARGS:-} --out "$out/ab.json" > "$out/ab.log" 2>&1
  echo "ab exit: $?"; tail -n 2 "$out/ab.log"
  if [ "${AB_BWD:-0}" = 1 ]; then
    RL_TRITON_HOST=python timeout "${AB_TIMEOUT:-420}" python3 tools/ab_base.py time --bwd ${AB_ARGS:-} --out "$out/ab_bwd.json" > "$out/ab_bwd.log" 2>&1
    echo "ab bwd exit: $?"; tail -n 2 "$out/ab_bwd.log"
  fi
fi
if [ "${FULLCALL:-0}" = 1 ]; then
  for i in 1 2; do
    python3 tools/ab_base.py full-call --package rl_triton
    RL_TRITON_HOST=python python3 tools/ab_base.py full-call --package rl_triton_base
    python3 tools/ab_base.py full-call --package rl_triton_base
    PAPER_PATH=.ab/paper/src python3 tools/ab_base.py full-call --package paper
  done 2>&1 | grep -v Warning | tee "$out/full_call.log"
fi
if [ "${BENCH:-0}" = 1 ]; then
  python3 -m rl_triton.bench --out "$out/bench" --max-seconds "${BENCH_SECONDS:-300}" ${BENCH_ARGS:-} \
    > "$out/bench.log" 2>&1
  echo "bench exit: $?"; grep -v '^\[' "$out/bench.log" | tail -60
fi
