"""The zoo's policy losses (docs/llm.md) at 512 x 4096 tokens, forward + backward on CUDA: verl
0.9.1's eager function, torch.compile of it and rl_triton's drop-in; OpenRLHF 0.11.2's PolicyLoss
and ours. CUDA-event medians of 20 calls after 3 warm-up calls.

    python tools/bench_policy_loss.py [verl loss names]

The frameworks come from .ci/frameworks (or $RL_TRITON_FRAMEWORKS), as in the tests; with $OUT
set, the rows are also written to $OUT/bench_policy.json.
"""
import json
import os
import statistics
import sys

import torch

from rl_triton.integrations import openrlhf as our_orl
from rl_triton.integrations import verl as our_verl
from rl_triton.testing import import_frameworks

FW = import_frameworks()
import verl.workers.config.actor as A  # noqa: E402  (importable once import_frameworks ran)

dev = "cuda"
B, T = 512, 4096
g = torch.Generator(device=dev).manual_seed(0)
lp0 = torch.rand(B, T, device=dev, generator=g).mul(0.96).add(0.02).log()
old = (lp0 + 0.3 * torch.randn(B, T, device=dev, generator=g)).clamp(max=-0.02)
adv = torch.randn(B, T, device=dev, generator=g)
lengths = torch.randint(T // 2, T + 1, (B,), device=dev, generator=g)
mask = (torch.arange(T, device=dev)[None] < lengths[:, None]).float()
cfg = A.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                    clip_ratio_high=0.28,
                    policy_loss=A.PolicyLossConfig(dro_beta=0.1))


def timeit(fn, n=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000)
    return statistics.median(ts)


def step(f, agg):
    lp = lp0.clone().requires_grad_(True)
    def run():
        loss, m = f(old, lp, adv, mask, agg, cfg, None)
        loss.backward()
    return run


rows = []
names = sys.argv[1:] or ["vanilla", "gspo", "sapo", "gpg", "cispo", "dppo_tv", "dppo_kl", "dro",
                         "clip_cov", "kl_cov", "geo_mean"]
for name in names:
    theirs = FW.verl.POLICY_LOSS_REGISTRY[name]
    ours = our_verl.POLICY_LOSSES[name]
    agg = "token-mean"
    r = {"loss": name}
    r["verl_eager_us"] = timeit(step(theirs, agg))
    try:
        torch._dynamo.reset()
        comp = torch.compile(theirs)
        r["verl_compile_us"] = timeit(step(comp, agg))
    except Exception as e:  # noqa: BLE001 - a compile failure is a result
        r["verl_compile_us"] = f"failed: {type(e).__name__}"
    r["rl_triton_us"] = timeit(step(ours, agg))
    if isinstance(r["verl_compile_us"], float):
        r["vs_compile"] = r["verl_compile_us"] / r["rl_triton_us"]
    r["vs_eager"] = r["verl_eager_us"] / r["rl_triton_us"]
    print(json.dumps(r), flush=True)
    rows.append(r)

for typ in ("ppo", "gspo"):
    res = {"loss": "openrlhf_" + typ}
    for label, cls in (("eager", FW.openrlhf_loss.PolicyLoss), ("ours", our_orl.PolicyLoss)):
        mod = cls(0.2, 0.28, dual_clip=3.0 if typ == "ppo" else None, policy_loss_type=typ)
        def run(mod=mod):
            lp = lp0.clone().requires_grad_(True)
            out = mod(lp, old, adv, mask)
            out[0].backward()
            float(out[1])
            float(out[2])
        res[label + "_us"] = timeit(run)
    res["vs_eager"] = res["eager_us"] / res["ours_us"]
    print(json.dumps(res), flush=True)
    rows.append(res)
out = os.environ.get("OUT")
if out:
    json.dump(rows, open(os.path.join(out, "bench_policy.json"), "w"), indent=1)
