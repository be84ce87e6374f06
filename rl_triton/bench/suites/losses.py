"""`--suite losses`: semantics §9's losses (PPO's surrogate, the value loss, the KL penalty, SAC's
targets and CRR's weights), forward plus backward where differentiable, against their formula
in eager PyTorch (`LOSS_FORMULAS`) and under `torch.compile`, and the same-bytes copy."""
from __future__ import annotations

import functools

import torch

import rl_triton

from .. import registry, report, timing
from ..calls import as_tuple, call_of, fwd_bwd_fn, grad_inputs, output_grads
from ..checks import check_result, rel_err
from ..registry import CRR_SAMPLES, LOSS_T, N_ACTIONS, SAC_CRITICS
from ..report import LossRow


def loss_kwargs(case, tokens, dtype, device, seed=0, row=LOSS_T):
    """Keyword arguments of `rl_triton.<loss>` and of its formula (`LOSS_FORMULAS`) for one of
    LOSS_CASES on `tokens` positions: [tokens / row, row] rows with a ~70% mask (PPO, value,
    KL: no mask) or `tokens` samples (SAC, CRR); floating inputs of `dtype`."""
    loss, variant, options, _ = case
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device)

    def rand(*shape):
        return torch.rand(shape, generator=g, device=device)

    shape = (tokens // row, row)
    N = tokens
    if loss == "ppo_policy_loss":
        old = -rand(*shape)  # log-probabilities of sampled tokens
        # ratios exp(N(0, 0.5)): about a third past each clip, 1.4% past the dual clip
        kw = dict(log_probs=old + 0.5 * randn(*shape), old_log_probs=old,
                  advantages=randn(*shape), mask=rand(*shape) < 0.7)
    elif loss == "value_loss":
        values = randn(*shape)
        kw = dict(values=values, returns=randn(*shape), old_values=values + 0.3 * randn(*shape),
                  mask=rand(*shape) < 0.7)
    elif loss == "kl_penalty":
        ref = -rand(*shape)
        # d ~ N(0, 1): the clamp binds where d < -2.61, at 0.5% of the tokens
        kw = dict(log_probs=ref + randn(*shape), ref_log_probs=ref)
    elif loss == "sac_targets":
        kw = dict(rewards=randn(N), terminated=rand(N) < 0.05)
        if variant.startswith("discrete"):
            logits = randn(N, N_ACTIONS)
            kw.update(next_q_values=randn(N, N_ACTIONS, SAC_CRITICS),
                      next_log_probs=logits.log_softmax(-1), next_probs=logits.softmax(-1))
        else:
            kw.update(next_q_values=randn(N, SAC_CRITICS), next_log_probs=randn(N))
    else:
        kw = dict(q_values=randn(N), sampled_q_values=randn(N, CRR_SAMPLES))
    kw = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kw.items()}
    return dict(kw, **options)


# semantics §9's formulas as a user writes them in PyTorch (float32 arithmetic, as rl_triton's),
# with the options LOSS_CASES uses and the functions' defaults: the eager and torch.compile
# baselines

def _ppo_formula(log_probs, old_log_probs, advantages, mask, clip_low=0.2, clip_high=0.2,
                 dual_clip=None, log_ratio_clamp=20.0):
    a = advantages.float()
    d = (log_probs.float() - old_log_probs.float()).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = d.exp()
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high)
    l = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        l = torch.where(a < 0, torch.minimum(l, -a * dual_clip), l)
    n = mask.sum().clamp_min(1)
    return (torch.where(mask, l, 0.0).sum() / n,
            torch.where(mask, (clipped > unclipped).float(), 0.0).sum() / n,
            torch.where(mask, ratio - 1 - d, 0.0).sum() / n)


def _value_formula(values, returns, old_values, mask, clip):
    v, r, old = values.float(), returns.float(), old_values.float()
    l = torch.maximum(0.5 * (v - r) ** 2, 0.5 * (old + (v - old).clamp(-clip, clip) - r) ** 2)
    return torch.where(mask, l, 0.0).sum() / mask.sum().clamp_min(1)


def _kl_formula(log_probs, ref_log_probs, clamp):
    d = log_probs.float() - ref_log_probs.float()
    return (torch.exp(-d) + d - 1).clamp(-clamp, clamp)


def _sac_formula(rewards, terminated, next_q_values, next_log_probs, gamma=0.99, alpha=0.2,
                 next_probs=None):
    # min with indices: at a tie the gradient goes to the first critic, as rl_triton's (amin
    # splits it, and bfloat16 critics tie often)
    v = next_q_values.float().min(-1).values - alpha * next_log_probs.float()
    if next_probs is not None:
        v = (next_probs.float() * v).sum(-1)
    return rewards.float() + gamma * (1 - terminated.float()) * v


def _crr_formula(q_values, sampled_q_values, beta=1.0, max_weight=20.0):
    adv = q_values.float() - sampled_q_values.float().mean(-1)
    return torch.exp(adv / beta).clamp(max=max_weight)


LOSS_FORMULAS = {"ppo_policy_loss": _ppo_formula, "value_loss": _value_formula,
                 "kl_penalty": _kl_formula, "sac_targets": _sac_formula,
                 "crr_weights": _crr_formula}


def compiled_formula(formula):
    """torch.compile of a formula, mode default, static shapes: compiled per size and dtype, the
    best kernels at each (dynamic shapes would size the reductions' splits from the first size
    compiled). After a reset, so that each compiled formula holds one size's cache entries: no
    guards of other sizes walked per call, no recompile limit hit."""
    torch._dynamo.reset()
    return torch.compile(formula, dynamic=False)


def loss_bytes(kw, outs, grads, leaves) -> int:
    """Minimal bytes of a call: every input tensor read once (flags and masks included), the
    outputs written; forward plus backward also the output gradients read and one gradient per
    leaf written (a leaf's size)."""
    return sum(t.numel() * t.element_size() for t in (
        *(v for v in kw.values() if isinstance(v, torch.Tensor)), *outs, *grads, *leaves))


def loss_cells(case, tokens, dtype, device, seed=0):
    """The rows of one case at one size and input dtype: for each of its modes rl_triton, the
    eager formula and its torch.compile on the same inputs, each baseline's outputs (and
    gradients) checked against rl_triton's before it is timed; the compile happens in that
    check."""
    loss, variant, _, modes = case
    kw = loss_kwargs(case, tokens, registry.DTYPES[dtype], device, seed)
    formula = LOSS_FORMULAS[loss]
    impls = {"rl_triton": functools.partial(getattr(rl_triton, loss), backend="triton"),
             "eager": formula, "compile": compiled_formula(formula)}
    for mode in modes:
        args, leaves = (kw, []) if mode == "fwd" else grad_inputs(kw)
        ref = as_tuple(impls["rl_triton"](**args))
        grads = output_grads(ref, seed) if leaves else []
        nbytes = loss_bytes(args, ref, grads, leaves)
        ref_grads = None
        for impl, f in impls.items():
            call = call_of(f, args)
            timed = fwd_bwd_fn(call, leaves, grads) if leaves else call
            err, grad_err = 0.0, (0.0 if leaves else float("nan"))
            what = f"{impl} {loss} {variant} {mode} {tokens} tokens {dtype}"
            if impl == "rl_triton":
                ref_grads = timed() if leaves else None
            else:
                err = rel_err(as_tuple(call()), ref, 0)
                check_result(err, registry.LOSS_OUTPUT_TOL, what)
                if leaves:
                    grad_err = rel_err(timed(), ref_grads, 0)
                    check_result(grad_err, registry.LOSS_GRAD_TOL, what + " gradients")
            # the eager formulas launch 10-40 kernels: more host time than the forward hold
            dev, full, host = timing.device_full_host_us(timed,
                                                         hold_cycles=timing._HOLD_CYCLES_GRAD)
            yield LossRow(loss, variant, mode, tokens, dtype, impl, nbytes, dev, full,
                          timing.same_bytes_copy_us(nbytes, device), err, grad_err, host)


def run_losses(tokens, dtypes, env, device, out, max_seconds):
    """`--suite losses`: every case of LOSS_CASES at every size (`tokens`) and input dtype,
    `loss_cells`; bench.json (suite "losses") after each, then bench.md and losses.png."""
    rows: list[LossRow] = []
    report.save_json(out, env, rows, "losses")
    configs = [(n, dt, case) for n in tokens for dt in dtypes for case in registry.LOSS_CASES]
    for i, (n, dt, case), tag in timing.within_seconds(configs, max_seconds):
        for r in loss_cells(case, n, dt, device, seed=i):
            rows.append(r)
            print(f"{tag} {r.loss:15s} {r.variant:18s} {r.mode:7s} {report.tokens_label(n):>5s} "
                  f"{dt:8s} {r.impl:9s} {r.device_us:9.1f} us dev {r.full_us:9.1f} us full "
                  f"{r.host_us:9.1f} us host  {r.copy_us / r.device_us:4.2f} of a same-bytes "
                  "copy", flush=True)
        # after every configuration, so that a run cut short keeps what it measured
        report.save_json(out, env, rows, "losses")
    report.write_saved_reports(out)
