"""Random inputs for every estimator, in time-major form, and the layouts they are tested in."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import rl_triton
from rl_triton import reference

ESTIMATORS = ["gae", "lambda_returns", "discounted_returns", "vtrace", "retrace",
              "eligibility_traces", "episodic_cumsum", "linear_scan_reverse",
              "linear_scan_forward"]
FLAG_DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.float64]
BACKENDS = ["loop", "torch", "triton"]


@dataclass
class Case:
    name: str
    fn: object  # the public function
    ref: object  # its float64 reference
    steps: dict  # per-step tensors, time-major [T, *batch(, trailing)]
    extra: dict = field(default_factory=dict)  # bootstraps and scalars

    def call(self, layout: str = "time-major", **kw):
        """Call the public function in `layout`; return its outputs time-major, as a tuple."""
        steps = {k: to_layout(v, layout) for k, v in self.steps.items()}
        td = 0 if layout == "time-major" else 1
        out = self.fn(**steps, **self.extra, time_dim=td, **kw)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(o if layout == "time-major" else o.movedim(1, 0) for o in out)

    def reference(self):
        extra = {k: v for k, v in self.extra.items() if k != "return_advantages"}
        out = self.ref(**self.steps, **extra)
        return out if isinstance(out, tuple) else (out,)


def to_layout(x, layout):
    if x is None or layout == "time-major":
        return x
    if layout == "batch-major":
        return x.movedim(0, 1).contiguous()  # [N, T, ...] in memory
    if layout == "transposed-view":
        return x.movedim(0, 1)  # [N, T, ...] as a view of time-major memory
    raise ValueError(layout)


def flags(gen, shape, p, dtype, device):
    f = torch.rand(shape, generator=gen) < p
    return f.to(dtype).to(device)


def make_case(name, T, batch=(5,), *, dtype=torch.float32, flag_dtype=torch.bool, trunc=True,
              device="cpu", seed=0, n_act=5, features=(), p_term=0.08, p_trunc=0.08,
              bootstrap="last_value", params=None) -> Case:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(shape, generator=gen)).to(dtype).to(device)

    shape = (T, *batch)
    term = flags(gen, shape, p_term, flag_dtype, device)
    truncated = flags(gen, shape, p_trunc, flag_dtype, device) if trunc else None
    if name in ("gae", "lambda_returns", "discounted_returns", "vtrace"):
        r, v = rnd(*shape), rnd(*shape)
        steps = dict(rewards=r, values=v, terminated=term, truncated=truncated)
        extra = {}
        if bootstrap == "last_value":
            extra["last_value"] = rnd(*batch)
        elif bootstrap == "next_values":
            steps["next_values"] = rnd(*shape)
        p = dict(gamma=0.97, lam=0.9)
        if name == "discounted_returns":
            del steps["values"]
            p = dict(gamma=0.97)
        if name == "vtrace":
            blp = rnd(*shape, scale=0.5) - 1.0
            steps.update(target_log_probs=(blp.float() + 0.4 * torch.randn(
                shape, generator=gen).to(device)).to(dtype), behavior_log_probs=blp)
            p = dict(gamma=0.97, lam=0.9, rho_clip=1.2, c_clip=0.9, pg_rho_clip=1.1)
        extra.update(params or p)
    elif name == "retrace":
        q = rnd(*shape, n_act)
        pi = torch.softmax(torch.randn(*shape, n_act, generator=gen), -1).to(dtype).to(device)
        actions = torch.randint(0, n_act, shape, generator=gen).to(device)
        mu = (0.2 + 0.8 * torch.rand(shape, generator=gen)).to(dtype).to(device)
        steps = dict(rewards=rnd(*shape), q_values=q, actions=actions, target_probs=pi,
                     behavior_probs=mu, terminated=term, truncated=truncated)
        last_pi = torch.softmax(torch.randn(*batch, n_act, generator=gen), -1).to(dtype)
        extra = dict(last_q_values=rnd(*batch, n_act), last_target_probs=last_pi.to(device),
                     return_advantages=True, **(params or dict(gamma=0.97, lam=0.9, c_clip=1.0)))
    elif name in ("eligibility_traces", "episodic_cumsum"):
        x = rnd(*shape, *features)
        dones = flags(gen, shape, p_term + p_trunc, flag_dtype, device)
        steps = dict(x=x, dones=dones)
        extra = dict(initial=rnd(*batch, *features)) if bootstrap == "last_value" else {}
        if name == "eligibility_traces":
            extra.update(params or dict(gamma=0.97, lam=0.9))
    elif name.startswith("linear_scan"):
        steps = dict(alpha=rnd(*shape), beta=(torch.rand(shape, generator=gen) * 1.2 - 0.1).to(
            dtype).to(device))
        extra = dict(reverse=name.endswith("reverse"))
        if bootstrap == "last_value":
            extra["initial"] = rnd(*batch)
        name = "linear_scan"
    else:
        raise ValueError(name)
    return Case(name, getattr(rl_triton, name), getattr(reference, name), steps, extra)


def rel_err(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all()
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(outs, refs, tol=1e-5):
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        err = rel_err(o, r)
        assert err < tol, f"output {i}: relative error {err:.3g} >= {tol}"
