"""Random inputs for every estimator, in time-major form, and the layouts they are tested in."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

import rl_triton
from rl_triton import reference
from rl_triton.testing import NAMES as ESTIMATORS  # noqa: F401
from rl_triton.testing import make_inputs, public_name

# the scan ops that take flags, masks and packed rows (all but linear_scan)
FLAGGED = [n for n in ESTIMATORS if not n.startswith("linear_scan")]
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


@dataclass(frozen=True)
class PerOp:
    argnames: str
    rows: list
    ids: Optional[list]
    op: Callable  # a row's op, as the test modules' OPS name it


def per_op(argnames, rows, ids=None, op=None):
    """`pytest.mark.parametrize(argnames, rows, ids=ids)` for a check shared by several ops
    (tests/ops/op_checks), keeping the rows of the ops of the module it is installed in (its
    `OPS`; tests/conftest.py's `pytest_generate_tests`). `op(row)` names a row's op: by default
    the row itself, or its first value."""
    rows = list(rows)
    if op is None:
        op = (lambda row: row[0]) if "," in argnames else (lambda row: row)

    def mark(fn):
        assert not hasattr(fn, "per_op"), fn.__name__
        fn.per_op = PerOp(argnames, rows, None if ids is None else list(ids), op)
        return fn
    return mark
