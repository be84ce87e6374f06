export PYTHONPATH=. PYTHONUNBUFFERED=1
TEST_TIMEOUT=240 bash tools/gpu_check.sh 2>&1 | tail -25
timeout 200 python3 -m rl_triton.bench --out $OUT/bench --truncation yes --baselines none > /tmp/b1.log 2>&1; echo "bench rc $?"; grep "^#" /tmp/b1.log; tail -c 4500 /tmp/b1.log
