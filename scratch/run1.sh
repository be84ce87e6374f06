set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 scratch/graph_diag.py 2>&1 | tail -8
timeout 420 python3 -m rl_triton.bench --out $OUT --baselines torch,compile,loop --estimators gae,vtrace,retrace,lambda_returns,discounted_returns,eligibility_traces,episodic_cumsum --truncation yes 2>&1 | tee $OUT/bench.log | grep -v "^\[" | tail -60
