"""The benchmark's correctness checks: every result is checked before it is timed (against a
float64 computation of the same inputs, or against rl_triton's own checked result), and a wrong
one is refused."""
from __future__ import annotations

import torch

from rl_triton import testing

from . import registry


def float64_result(name, kw):
    """The same inputs through the vectorized torch implementation in float64, time-major: a
    tuple of the call's outputs."""
    td = kw["time_dim"]
    args = {k: (v.movedim(td, 0) if isinstance(v, torch.Tensor) and not registry.is_bootstrap(k)
                else v) for k, v in kw.items() if k != "time_dim"}
    return testing.vectorized(name, **args)[:registry.n_out(name, kw)]


def rel_err(outs, refs, td):
    """The largest relative error (norm of the difference over the reference's) of `outs`, time
    axis `td`, against time-major `refs`, output by output."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    worst = 0.0
    for o, r in zip(outs, refs):
        o = o.movedim(td, 0).double()
        worst = max(worst, ((o - r).norm() / r.norm().clamp_min(1e-30)).item())
    return worst


def check_result(err, tol, what):
    """Refuses to time a wrong result."""
    if not err < tol:
        raise SystemExit(f"{what}: relative error {err:.3g} >= {tol}; not timing a wrong result")


def check_gradients(fn, kw_g, leaves, name, shape):
    """rl_triton's gradients against autograd through the torch backend in float64 (the same
    inputs); refuses to time wrong ones."""
    outs = fn(**kw_g)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device=outs[0].device).manual_seed(1)
    ws = [torch.randn(o.shape, generator=g, device=o.device) for o in outs]
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, ws)), leaves,
                              allow_unused=True)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    swap = dict(zip(map(id, leaves), leaves64))
    kw64 = {k: swap.get(id(v), v) for k, v in kw_g.items()}
    ref = fn(**kw64, backend="torch", out_dtype=torch.float64)
    ref = ref if isinstance(ref, tuple) else (ref,)
    want = torch.autograd.grad(sum((o * w.double()).sum() for o, w in zip(ref, ws)), leaves64,
                               allow_unused=True)
    # V-trace and Retrace clip ratios: where a float32 ratio and its float64 twin fall on two
    # sides of a clip, that step's gradient jumps, so their tolerance is looser; the gradient
    # of a bfloat16 input is rounded to bfloat16 (8 bits: a relative error of about 2e-3)
    half = any(t.dtype in (torch.bfloat16, torch.float16) for t in leaves)
    tol = 1e-2 if half else 1e-3 if name in ("vtrace", "retrace") else 1e-4
    for i, (a, b) in enumerate(zip(got, want)):
        a = torch.zeros_like(b) if a is None else a.double()
        b = torch.zeros_like(a) if b is None else b
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        if not err < tol:
            raise SystemExit(f"{name} {shape}: gradient {i} relative error {err:.3g} >= {tol}; "
                             "not timing a wrong gradient")
