python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
TEST_TIMEOUT=170 bash tools/gpu_check.sh tests/test_estimators.py tests/test_semantics.py tests/test_errors.py tests/test_properties.py tests/test_gpu.py 2>&1 | tail -6
R=/tmp/runs
run() { timeout 60 python3 "$@" --env-backend gymnasium --log-dir $R > /tmp/last.log 2>&1; echo "rc=$? $*"; tail -2 /tmp/last.log; }
for b in loop triton compile; do
  run trainers/ppo.py --num-envs 4096 --num-steps 128 --total-timesteps 3145728 --credit-backend $b --exp-name ppo_4096x128
  run trainers/ppo.py --num-envs 8 --num-steps 128 --total-timesteps 61440 --credit-backend $b --exp-name ppo_8x128
done
for b in loop triton; do
  run trainers/impala.py --num-envs 4096 --num-steps 128 --total-timesteps 3145728 --credit-backend $b --exp-name impala_4096x128
done
python3 examples/compare_backends.py $R --out $OUT/amdahl_h200.png > $OUT/compare.txt 2>&1; cat $OUT/compare.txt
tar czf $OUT/runs.tgz -C /tmp runs
