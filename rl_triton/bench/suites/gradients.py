"""The grid's gradients (`--modes bwd,fwd+bwd`, semantics §6): every floating input requiring
grad, `bwd` the backward pass alone against the same-bytes copy of its own bytes, `fwd+bwd`
forward plus backward against autograd through the torch backend and through TorchRL's
estimators (where TorchRL has one and is installed)."""
from __future__ import annotations

import torch

import rl_triton

from .. import registry, timing
from ..calls import backward_fn, fwd_bwd_fn, grad_inputs
from ..checks import check_gradients
from ..report import Row


def time_gradients(name, shape, layout, dt, tr, kw, modes, baselines, bw, device, tag):
    """The gradient rows of one configuration (`--modes bwd` and `fwd+bwd`), after a check of
    rl_triton's gradients against those of the torch backend in float64."""
    fn = getattr(rl_triton, name)
    kw_g, leaves = grad_inputs(kw)
    check_gradients(fn, kw_g, leaves, name, shape)
    rows = []
    timed = []
    if "bwd" in modes:
        nbytes = registry.bwd_bytes(name, kw_g, leaves)
        timed.append(("bwd", "rl_triton", backward_fn(fn(**kw_g), leaves), nbytes))
    if "fwd+bwd" in modes:
        timed.append(("fwd+bwd", "rl_triton", fwd_bwd_fn(lambda: fn(**kw_g), leaves), 0))
        if baselines:
            timed.append(("fwd+bwd", "torch",
                          fwd_bwd_fn(lambda: fn(**kw_g, backend="torch"), leaves), 0))
            if layout == "time-major":
                f = torchrl_fwd_bwd(name, kw_g)
                if f is not None:
                    timed.append(("fwd+bwd", "torchrl", f, 0))
    for mode, impl, f, nbytes in timed:
        dev, full, host = timing.device_full_host_us(f, hold_cycles=timing._HOLD_CYCLES_GRAD)
        copy = timing.same_bytes_copy_us(nbytes, device) if nbytes else float("nan")
        frac = nbytes / (dev * 1e-6) / bw if nbytes else float("nan")
        rows.append(Row(name, shape, layout, dt, tr, impl, nbytes, dev, full, frac, 0.0, copy,
                        mode, host))
        ratio = f"{copy / dev:4.2f} of a same-bytes copy" if nbytes else ""
        print(f"{tag} {name:18s} {shape:>10s} {layout:11s} {dt:8s} trunc={int(tr)} {mode:7s} "
              f"{impl:9s} {dev:9.1f} us dev {full:9.1f} us full {host:9.1f} us host  {ratio}",
              flush=True)
    return rows


def torchrl_fwd_bwd(name, kw):
    """TorchRL's estimator of `name` (its vectorized one, time axis -2 of [N, T, 1] tensors,
    from time-major inputs), forward and backward through autograd; None where TorchRL has
    none or is not installed. Built outside the timed call: only the estimator is timed."""
    try:
        from torchrl.objectives.value import functional as F
    except Exception:  # noqa: BLE001 - not installed, or not importable with this torch
        return None
    if name not in ("gae", "lambda_returns", "vtrace", "discounted_returns"):
        return None

    def bm(x):  # [T, N] -> [N, T, 1]
        return x.movedim(0, 1).unsqueeze(-1).contiguous()

    term = bm(kw["terminated"])
    done = term | bm(kw["truncated"]) if kw.get("truncated") is not None else term
    leaves = {k: bm(kw[k]).detach().requires_grad_() for k in (
        "rewards", "values", "target_log_probs", "behavior_log_probs") if k in kw}
    last = kw.get("last_value")
    last = None if last is None else last.detach().reshape(-1, 1, 1).requires_grad_()
    r = leaves["rewards"]
    ps = list(leaves.values()) + ([last] if last is not None else [])
    gamma = kw.get("gamma", 0.99)

    def next_values():
        return torch.cat([leaves["values"][:, 1:], last], 1)

    if name == "gae":
        def forward():
            return F.vec_generalized_advantage_estimate(
                gamma, kw["lam"], leaves["values"], next_values(), r, done, term)
    elif name == "lambda_returns":
        def forward():
            return F.vec_td_lambda_return_estimate(gamma, kw["lam"], next_values(), r, done,
                                                   term)
    elif name == "vtrace":
        def forward():
            return F.vtrace_advantage_estimate(
                gamma, leaves["target_log_probs"], leaves["behavior_log_probs"],
                leaves["values"], next_values(), r, done, term, kw["rho_clip"], kw["c_clip"])
    else:
        ps = [r]

        def forward():
            return F.reward2go(r, done, gamma)
    return fwd_bwd_fn(forward, ps)
