"""Random inputs for every estimator, in time-major form, and the layouts they are tested in."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

import rl_triton
from rl_triton import reference
from rl_triton.testing import NAMES as ESTIMATORS  # noqa: F401
from rl_triton.testing import make_inputs, public_name

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


def make_case(name, T, batch=(5,), **kw) -> Case:
    """A `Case` of `rl_triton.testing.make_inputs(name, T, batch, **kw)`."""
    steps, extra = make_inputs(name, T, batch, **kw)
    name = public_name(name)
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


def subprocess_env(**extra) -> dict:
    """This process's environment for a child Python, with this checkout importable ahead of
    the caller's own PYTHONPATH (which may hold packages the child needs too)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return env
