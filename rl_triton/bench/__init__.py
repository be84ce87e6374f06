"""`python -m rl_triton.bench`: the benchmark harness (one for the whole project).

For every estimator, shape (N envs x T steps), layout, input dtype and truncation setting it
1. checks rl_triton's result against a float64 computation of the same inputs,
2. times the call: device time (`triton.testing.do_bench`'s protocol: median, L2 flushed
   before every call; plus a GPU hold after the flush, see `timing.device_time_us`), full-call
   time (synchronize, host timer, call, synchronize; median of >= 200 calls) and host time (the
   same calls' host timer where the call returns, before the synchronize),
3. reports the achieved bandwidth (minimal bytes / device time) as a fraction of the copy
   bandwidth measured in the same run (a 1 GiB copy), the device time of a copy that moves the
   same bytes (the faster of torch's `copy_` and a plain Triton copy: the floor at this size,
   since fixed launch and ramp costs weigh on small copies too), and the speedup over the
   baselines: the sequential loop (`backend="loop"`, CleanRL-style), the torch backend eager,
   and the torch backend under `torch.compile`.
With `--modes fwd,bwd,fwd+bwd` it also times gradients (semantics §6), every floating input
requiring grad: `bwd` the backward pass alone (`torch.autograd.grad` of the outputs against fixed
random output gradients, the forward done once; its minimal bytes: the output gradients, the flags
and the inputs its formula reads, the input gradients written) against the same-bytes copy of its
own bytes, and `fwd+bwd` forward plus backward, against autograd through the torch backend and
through TorchRL's estimators (where TorchRL has one and is installed).
It writes `bench.json`, `bench.md` and `bench.png` into `--out`.
`--suite tokens` times LLM token rows instead (`suites.tokens`): GAE and discounted returns on
dense, padded, multi-turn and packed rows (with and without their mask) against the unmasked
call and the same-bytes copy, verl's and OpenRLHF's own token loops beside rl_triton's drop-ins,
masked_whiten and group_advantages; its plot is `tokens.png`.
`--suite losses` times semantics §9's losses (`suites.losses`): PPO's surrogate, the value loss,
the KL penalty, SAC's targets and CRR's weights, forward plus backward where differentiable,
against their formula in eager PyTorch and under `torch.compile` and the same-bytes copy; its
plot is `losses.png`.
`--suite host` times the host path (`suites.host`): host and full-call time of the estimators'
calls at four shapes, both layouts, bool and float flags, beside the bound (the same compiled
kernel launched bare from Python) and rl-triton 0.1.3 (`--anchor-path`), then Retrace, group
advantages, whitening and the losses against GAE; its plot is `host.png`.
`--suite llm` times the LLM zoo (`suites.llm`): verl's advantage estimators, KL penalties, rollout
correction and policy losses and OpenRLHF's token loops, KL and PolicyLoss, rl_triton's drop-ins
against the frameworks' own functions and `torch.compile` of them (KL, losses), each checked
against the framework's result first; its plot is `llm.png`.

The package: `cli` (the options), `registry` (what is timed: the estimators from the op
registry, shapes, inputs, output counts, bytes), `timing`, `checks` (results before timing),
`calls` (the timed callables), `suites/` (one module per suite), `anchor` (rl-triton 0.1.3
beside rl_triton) and `report` (bench.json's rows, bench.md's tables, the plots).
"""
