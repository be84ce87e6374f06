"""Backend choice, the launch-plan cache and the custom ops: what every op's public function
calls once its arguments are described.

An op (`rl_triton/ops/*.py`) declares an `Op`: its input NamedTuple (one order for the public
function, the custom op and the kernel's slots), its scalars, its argument check, its Triton plan
builder and its torch and loop implementations. `Op.__call__` checks every argument (every call),
picks the backend and runs it:
- Triton, eager: the launch plan cached under the call's signature (shapes, strides, dtypes,
  alignment and options, collected by the check), else a new one;
- Triton inside `torch.compile`: the op's custom op (`torch.ops.rl_triton.<name>`), whose
  implementation is the eager path above and whose fake gives the outputs' shapes;
- torch and loop: the implementation on time-major views, copied into outputs in the caller's
  layout.
Nothing under `rl_triton.scan` imports this module.
"""
from __future__ import annotations

import inspect
import os
import typing
from typing import Callable, Optional

import torch

from ._args import Call, check_backend, check_out_dtype
from .scan.jit import HAS_TRITON

Tensor = torch.Tensor
_PLANS: dict = {}
OPS: dict = {}  # every Op, by name
_MAX_PLANS = 4096
_DTYPE = torch.float32  # the torch and loop backends compute in float32


def clear_plans() -> None:
    """Forget every cached launch plan (tests and tuning: tile rules read at plan time)."""
    _PLANS.clear()


def backend_for(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' needs Triton, which is not installed here; use "
                               "backend='torch'")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' on CPU tensors runs Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before triton is imported, or use "
                             "backend='torch'")
    return backend


class Op:
    """One op's declaration (see the module docstring).

    check(x, time_dim, extra) -> (x, call): the checked inputs (the caller's tensors, or their
        values for lazily negated views) and the `Call` that checked them;
    plan(x, call, out_dtype, extra) -> `scan.launch.Launch`, or None where the plan cannot read
        `x` in place (then `copy(x)` gives tensors it can, and the call is not cached);
    torch(x, s, extra, dtype) and loop(x, s, extra, dtype): the outputs, time-major, from
        time-major views `x` (fields named `last_*` or `initial` are bootstraps: no time axis);
    n_out(extra): outputs of a call (the custom op returns `outputs`, the unused ones empty).
    Every output has the shape of input 0.
    """

    def __init__(self, name: str, inputs: type, scalars: type, *, check: Callable,
                 plan: Callable, torch: Callable, loop: Callable, outputs: int = 1,
                 extras: Optional[type] = None, n_out: Optional[Callable] = None,
                 copy: Optional[Callable] = None, runtime_check: Optional[Callable] = None,
                 kernel_scalars: Callable = tuple):
        self.name, self.inputs, self.scalars, self.extras = name, inputs, scalars, extras
        self.check, self.plan, self.torch, self.loop = check, plan, torch, loop
        self.outputs = outputs
        self.n_out = n_out or (lambda extra: outputs)
        self.copy = copy or (lambda x: type(x)(*(None if t is None else t.contiguous()
                                                  for t in x)))
        # data-dependent checks (Retrace's actions): eagerly before the launch, and inside the
        # custom op under torch.compile (where tracing cannot read data)
        self.runtime_check = runtime_check
        self.kernel_scalars = kernel_scalars  # the kernel's float arguments from the scalars
        self._steps = tuple(not f.startswith(("last_", "initial")) for f in inputs._fields)
        self.custom_op = _register(self)
        OPS[name] = self

    def __call__(self, x: tuple, s: tuple, time_dim, backend, out_dtype, extra: tuple = ()):
        backend = check_backend(backend)
        out_dtype = check_out_dtype(out_dtype)
        x, call = self.check(x, time_dim, extra)
        n = self.n_out(extra)
        if call.empty():
            return _result([torch.empty(x[0].shape, dtype=out_dtype, device=call.device)
                            for _ in range(n)])
        backend = backend_for(backend, call.device)
        if backend == "triton" and call.key is None:  # compiling: the custom op checks data
            outs = self.custom_op(*x, *s, call.time_dim, out_dtype, *extra)
            return _result(list(outs[:n]) if self.outputs > 1 else [outs])
        if self.runtime_check is not None:
            self.runtime_check(x, extra)
        if backend == "triton":
            return _result(self._launch(x, s, call, out_dtype, extra)[:n])
        tx = self.inputs(*(call.tm(t) if step else t for t, step in zip(x, self._steps)))
        res = (self.torch if backend == "torch" else self.loop)(tx, s, extra, _DTYPE)
        res = res if isinstance(res, tuple) else (res,)
        outs = []
        for r in res[:n]:
            out = torch.empty(x[0].shape, dtype=out_dtype, device=call.device)
            out.movedim(call.time_dim, 0).copy_(r)
            outs.append(out)
        return _result(outs)

    def _launch(self, x, s, call: Call, out_dtype, extra) -> list:
        """The eager Triton path: the cached plan of this signature, or a new one."""
        key = (self.name, out_dtype, extra, *call.key)
        plan = _PLANS.get(key)
        if plan is None:
            plan = self.plan(x, call, out_dtype, extra)
            if plan is None:  # batch axes no two strides describe: contiguous copies
                y = self.copy(x)
                return self.plan(y, call, out_dtype, extra).run(y, self.kernel_scalars(s))
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
        return plan.run(x, self.kernel_scalars(s))


def _result(outs: list):
    return outs[0] if len(outs) == 1 else tuple(outs)


# ---- custom ops --------------------------------------------------------------------------------

def _register(op: Op):
    """`torch.ops.rl_triton.<name>`: the op's inputs, scalars, time_dim, out_dtype and extras as
    its arguments, in that order (the input NamedTuple's order), and `outputs` tensors."""
    hints = [typing.get_type_hints(t) for t in (op.inputs, op.scalars)]
    hints.append({"time_dim": int, "out_dtype": torch.dtype})
    if op.extras is not None:
        hints.append(typing.get_type_hints(op.extras))
    params = [inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=v)
              for h in hints for k, v in h.items()]
    n_in, n_s = len(hints[0]), len(hints[1])
    returns = Tensor if op.outputs == 1 else tuple[(Tensor,) * op.outputs]

    def unpack(args):
        x = op.inputs(*args[:n_in])
        s = op.scalars(*args[n_in:n_in + n_s])
        time_dim, out_dtype = args[n_in + n_s:n_in + n_s + 2]
        extra = op.extras(*args[n_in + n_s + 2:]) if op.extras is not None else ()
        return x, s, time_dim, out_dtype, extra

    def pad(outs, ref, out_dtype):
        outs = list(outs) + [ref.new_empty(0, dtype=out_dtype)
                             for _ in range(op.outputs - len(outs))]
        return outs[0] if op.outputs == 1 else tuple(outs)

    def impl(*args):
        x, s, time_dim, out_dtype, extra = unpack(args)
        x, call = op.check(x, time_dim, extra)
        if op.runtime_check is not None:
            op.runtime_check(x, extra)
        if call.empty():
            outs = [torch.empty(x[0].shape, dtype=out_dtype, device=call.device)
                    for _ in range(op.n_out(extra))]
        else:
            outs = op._launch(x, s, call, out_dtype, extra)[:op.n_out(extra)]
        return pad(outs, x[0], out_dtype)

    def fake(*args):
        x, s, time_dim, out_dtype, extra = unpack(args)
        return pad([torch.empty(x[0].shape, dtype=out_dtype, device=x[0].device)
                    for _ in range(op.n_out(extra))], x[0], out_dtype)

    impl.__signature__ = inspect.Signature(params, return_annotation=returns)
    impl.__name__ = op.name
    custom = torch.library.custom_op(f"rl_triton::{op.name}", impl, mutates_args=())
    custom.register_fake(fake)
    return custom
