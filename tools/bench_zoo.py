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
from rl_triton.integrations import openrlhf as orl
from rl_triton.integrations import verl as ours
from rl_triton.testing import import_frameworks

FW = import_frameworks()
helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
B, T, N = 512, 4096, 8  # responses, tokens, responses per prompt


def rollout(device="cuda", seed=0):
    """Right-padded responses of T/2..T tokens, two masked observation spans each, an outcome
    reward on the last token; log-probs of the trainer and of the engine."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    for b in range(B):
        for _ in range(2):
            s = int(torch.randint(1, int(lengths[b]) - 40, (1,), generator=g))
            mask[b, s:s + 30] = False
    r = torch.zeros(B, T)
    r[torch.arange(B), lengths - 1] = (torch.rand(B, generator=g) < 0.5).float()
    v = torch.randn(B, T, generator=g)
    old = -3 * torch.rand(B, T, generator=g)
    roll = old + 0.1 * torch.randn(B, T, generator=g)
    spi = 0.5 * torch.rand(B, T, generator=g)
    return [x.to(device) for x in (r, v, mask.float(), old, roll, spi)]


def timeit(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def main():
    r, v, m, old, roll, spi = rollout()
    index = np.array([f"uid-{i // N}" for i in range(B)], dtype=object)
    cfg = types.SimpleNamespace(gamma=0.99)

    class Config(dict):
        pass

    estimators = {  # name -> (function name, arguments after the module)
        "gae": ("compute_gae_advantage_return", (r, v, m, 1.0, 0.95), {}),
        "grpo": ("compute_grpo_outcome_advantage", (r, m, index), {}),
        "grpo_vectorized": ("compute_grpo_vectorized_outcome_advantage", (r, m, index), {}),
        "grpo_passk": ("compute_grpo_passk_outcome_advantage", (r, m, index),
                       {"config": Config(norm_adv_by_std_in_grpo=True)}),
        "rloo": ("compute_rloo_outcome_advantage", (r, m, index), {}),
        "rloo_vectorized": ("compute_rloo_vectorized_outcome_advantage", (r, m, index), {}),
        "reinforce_plus_plus": ("compute_reinforce_plus_plus_outcome_advantage", (r, m),
                                {"config": cfg}),
        "reinforce_plus_plus_baseline": (
            "compute_reinforce_plus_plus_baseline_outcome_advantage", (r, m, index), {}),
        "remax": ("compute_remax_outcome_advantage", (r, 0.5 * r.sum(-1), m), {}),
        "opo": ("compute_opo_outcome_advantage", (r, m, index), {}),
        "gpg": ("compute_gpg_outcome_advantage", (r, m, index), {}),
        "optimal_token_baseline": ("compute_optimal_token_baseline_advantage",
                                   (r, m, index, old, spi), {}),
        "tir_optimal_token_baseline": ("compute_multi_turn_optimal_token_baseline_advantage",
                                       (r, m, index, old, spi), {}),
        "gdpo": ("compute_gdpo_outcome_advantage", (r, m, index), {}),
    }
    out = {}
    for key, (name, args, kw) in estimators.items():
        def call(module):
            return lambda: getattr(module, name)(*args, **kw)
        slow = key in ("gae", "reinforce_plus_plus", "tir_optimal_token_baseline")
        theirs = timeit(call(FW.verl), 3 if slow else 10, 1)
        mine = timeit(call(ours), 20)
        a, b = call(ours)(), call(FW.verl)()
        err = max(((x - y).abs().max() / y.abs().max().clamp(min=1)).item() for x, y in zip(a, b))
        out[key] = dict(framework_ms=theirs, ours_ms=mine, speedup=theirs / mine, rel_err=err)
        print(key, out[key], flush=True)

    def fwd_bwd(f):
        def run():
            lp = old.clone().requires_grad_()
            k = f(lp)
            k.backward(torch.ones_like(k))
        return run

    for name in ("k3", "k3+", "k1"):
        theirs = timeit(fwd_bwd(lambda lp: FW.verl.kl_penalty(lp, roll, name)), 20)
        mine = timeit(fwd_bwd(lambda lp: ours.kl_penalty(lp, roll, name)), 20)
        compiled = torch.compile(lambda lp: FW.verl.kl_penalty(lp, roll, name))
        out["kl_penalty " + name] = dict(framework_ms=theirs, ours_ms=mine,
                                         compiled_ms=timeit(fwd_bwd(compiled), 20, 3))
        print(name, out["kl_penalty " + name], flush=True)
    for unbiased in (False, True):
        theirs = timeit(fwd_bwd(lambda lp: FW.openrlhf_utils.compute_approx_kl(
            lp, roll, old, "k3", unbiased)), 20)
        mine = timeit(fwd_bwd(lambda lp: orl.compute_approx_kl(lp, roll, old, "k3", unbiased)),
                      20)
        out[f"compute_approx_kl k3 unbiased={unbiased}"] = dict(framework_ms=theirs,
                                                                 ours_ms=mine)
    lr, mb = old - roll, m.bool()
    for level in ("token", "sequence"):
        bare = timeit(lambda: rl_triton.rollout_correction(old, roll, mb, level=level), 50)
        theirs = timeit(lambda: helper.compute_rollout_correction_weights(lr, m, level), 10)
        mine = timeit(lambda: ours.compute_rollout_correction_weights(lr, m, level), 10)
        w1 = ours.compute_rollout_correction_weights(lr, m, level)[0]
        w2 = helper.compute_rollout_correction_weights(lr, m, level)[0]
        out[f"rollout_correction {level}"] = dict(
            rl_triton_ms=bare, framework_ms=theirs, ours_ms=mine,
            rel_err=((w1 - w2).abs().max() / w2.abs().max()).item())
        print(level, out[f"rollout_correction {level}"], flush=True)
    out["rollout_rs seq_mean_k3"] = dict(
        framework_ms=timeit(lambda: helper.compute_rollout_rejection_mask(
            lr, m, "seq_mean_k3", 0.01), 10),
        ours_ms=timeit(lambda: ours.compute_rollout_rejection_mask(lr, m, "seq_mean_k3", 0.01),
                       10))
    print(torch.cuda.get_device_name(), torch.__version__)
    folder = os.environ.get("OUT", ".")
    with open(os.path.join(folder, "bench_zoo.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
