"""The LLM zoo (docs/llm.md) at 512 x 4096 tokens on CUDA: each drop-in against the framework's
own function on the same inputs, full-call time (host and device, synchronized; median of the
repeats) and the largest relative difference of their outputs. Run from the repository root with
the frameworks in .ci/frameworks (tools/install_extras.sh):

    python tools/bench_zoo.py          # prints a line per entry, writes $OUT/bench_zoo.json

Not part of `python -m rl_triton.bench`: a first measurement of PERFORMANCE's "LLM zoo" cells.
"""
import importlib
import json
import os
import time
import types

import numpy as np
import torch

import rl_triton
from rl_triton.testing import import_frameworks
FW = import_frameworks()
from rl_triton.integrations import verl as ov, openrlhf as oo
helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
dev = "cuda"
B, T, n = 512, 4096, 8
g = torch.Generator().manual_seed(0)
lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
mask = (torch.arange(T)[None] < lengths[:, None])
for b in range(B):  # two observation spans per response
    for k in range(2):
        s = int(torch.randint(1, int(lengths[b]) - 40, (1,), generator=g))
        mask[b, s:s + 30] = False
r = torch.zeros(B, T); r[torch.arange(B), lengths - 1] = (torch.rand(B, generator=g) < 0.5).float()
v = torch.randn(B, T, generator=g)
old = -3 * torch.rand(B, T, generator=g); roll = old + 0.1 * torch.randn(B, T, generator=g)
spi = 0.5 * torch.rand(B, T, generator=g)
r, v, m, old, roll, spi = (x.to(dev) for x in (r, v, mask.float(), old, roll, spi))
index = np.array([f"uid-{i // n}" for i in range(B)], dtype=object)
cfg = {"norm_adv_by_std_in_grpo": True}
class C(dict): pass
acfg = types.SimpleNamespace(gamma=0.99)

def timeit(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return float(np.median(ts))

cases = {
 "gae": lambda M: lambda: M.compute_gae_advantage_return(r, v, m, 1.0, 0.95),
 "grpo": lambda M: lambda: M.compute_grpo_outcome_advantage(r, m, index),
 "grpo_vectorized": lambda M: lambda: M.compute_grpo_vectorized_outcome_advantage(r, m, index),
 "grpo_passk": lambda M: lambda: M.compute_grpo_passk_outcome_advantage(r, m, index, config=C(cfg)),
 "rloo": lambda M: lambda: M.compute_rloo_outcome_advantage(r, m, index),
 "rloo_vectorized": lambda M: lambda: M.compute_rloo_vectorized_outcome_advantage(r, m, index),
 "reinforce_plus_plus": lambda M: lambda: M.compute_reinforce_plus_plus_outcome_advantage(r, m, config=acfg),
 "reinforce_plus_plus_baseline": lambda M: lambda: M.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, index),
 "remax": lambda M: lambda: M.compute_remax_outcome_advantage(r, r.sum(-1) * 0.5, m),
 "opo": lambda M: lambda: M.compute_opo_outcome_advantage(r, m, index),
 "gpg": lambda M: lambda: M.compute_gpg_outcome_advantage(r, m, index),
 "optimal_token_baseline": lambda M: lambda: M.compute_optimal_token_baseline_advantage(r, m, index, old, spi),
 "tir_optimal_token_baseline": lambda M: lambda: M.compute_multi_turn_optimal_token_baseline_advantage(r, m, index, old, spi),
 "gdpo": lambda M: lambda: M.compute_gdpo_outcome_advantage(r, m, index),
}
out = {}
for name, make in cases.items():
    slow = name in ("gae", "reinforce_plus_plus", "tir_optimal_token_baseline")
    theirs = timeit(make(FW.verl), 3 if slow else 10, 1)
    ours = timeit(make(ov), 20)
    # agreement on the GPU, the same inputs
    a, b = make(ov)(), make(FW.verl)()
    err = max(((x - y).abs().max() / y.abs().max().clamp(min=1)).item() for x, y in zip(a, b))
    out[name] = dict(verl_ms=theirs * 1e3, ours_ms=ours * 1e3, speedup=theirs / ours, rel_err=err)
    print(name, out[name], flush=True)

def fwd_bwd(f):
    def run():
        lp = old.clone().requires_grad_()
        k = f(lp)
        k.backward(torch.ones_like(k))
    return run
for name in ("k3", "k3+", "k1"):
    theirs = timeit(fwd_bwd(lambda lp: FW.verl.kl_penalty(lp, roll, name)), 20)
    ours = timeit(fwd_bwd(lambda lp: ov.kl_penalty(lp, roll, name)), 20)
    comp = torch.compile(lambda lp: FW.verl.kl_penalty(lp, roll, name))
    compiled = timeit(fwd_bwd(comp), 20, 3)
    out["kl_penalty " + name] = dict(verl_ms=theirs * 1e3, ours_ms=ours * 1e3, compiled_ms=compiled * 1e3, speedup=theirs / ours)
    print(name, out["kl_penalty " + name], flush=True)
for ub in (False, True):
    theirs = timeit(fwd_bwd(lambda lp: FW.openrlhf_utils.compute_approx_kl(lp, roll, old, "k3", ub)), 20)
    ours = timeit(fwd_bwd(lambda lp: oo.compute_approx_kl(lp, roll, old, "k3", ub)), 20)
    out[f"compute_approx_kl k3 unbiased={ub}"] = dict(openrlhf_ms=theirs * 1e3, ours_ms=ours * 1e3, speedup=theirs / ours)
    print(ub, out[f"compute_approx_kl k3 unbiased={ub}"], flush=True)
mb = m.bool()
for lvl in ("token", "sequence"):
    bare = timeit(lambda: rl_triton.rollout_correction(old, roll, mb, level=lvl, high=2.0), 50)
    theirs_w = timeit(lambda: helper.compute_rollout_correction_weights(old - roll, m, lvl, 2.0), 10)
    ours_w = timeit(lambda: ov.compute_rollout_correction_weights(old - roll, m, lvl, 2.0), 10)
    w1 = ov.compute_rollout_correction_weights(old - roll, m, lvl, 2.0)[0]
    w2 = helper.compute_rollout_correction_weights(old - roll, m, lvl, 2.0)[0]
    out[f"rollout_correction {lvl}"] = dict(bare_ms=bare * 1e3, verl_weights_ms=theirs_w * 1e3, ours_weights_ms=ours_w * 1e3, rel_err=((w1 - w2).abs().max() / w2.abs().max()).item())
    print(lvl, out[f"rollout_correction {lvl}"], flush=True)
    rs_t = timeit(lambda: helper.compute_rollout_rejection_mask(old - roll, m, "seq_mean_k3", 0.01), 10)
    rs_o = timeit(lambda: ov.compute_rollout_rejection_mask(old - roll, m, "seq_mean_k3", 0.01), 10)
    out["rollout_rs seq_mean_k3"] = dict(verl_ms=rs_t * 1e3, ours_ms=rs_o * 1e3)
print(torch.cuda.get_device_name(), torch.__version__)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "bench_zoo.json"), "w"), indent=1)
