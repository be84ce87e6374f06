"""What the value-based estimators share: their common arguments' checks, and the plan that
hands an op's inputs to the scan kernel in the op's own slot order."""
from __future__ import annotations

from typing import Optional

import torch

from .._args import FLAG, VALUE, Call, require_bootstrap
from .._core.plans import cached_plan
from ..scan.launch import Kernel, Launch, over_time, tm

Tensor = torch.Tensor


def value_args(x, time_dim, *, values_optional: bool = False, bootstrap: bool = True,
               segments: Optional[int] = None):
    """Check the fields that GAE, lambda-returns, discounted returns and V-trace share (and any
    `*_log_probs`): the per-step values, the flags, `next_values` and `last_value` (with
    `segments`, packed rows: one per segment). Returns the checked inputs (same NamedTuple) and
    the `Call`."""
    call = Call("rewards", x.rewards, time_dim, segments=segments)
    step, optional = call.step, _OPTIONAL[values_optional]
    checked = type(x)(*[
        call.bootstrap(name, t) if name == "last_value" else
        step(name, t, _KIND.get(name, VALUE), optional=name in optional)
        for name, t in zip(x._fields, x)])
    if bootstrap:
        require_bootstrap(x.next_values, x.last_value)
    elif x.next_values is not None and x.last_value is not None:
        require_bootstrap(x.next_values, x.last_value)  # raises: not both
    return checked, call


_KIND = {"terminated": FLAG, "truncated": FLAG, "mask": FLAG}
_OPTIONAL = {False: frozenset(("truncated", "next_values", "mask")),
             True: frozenset(("truncated", "next_values", "values", "mask"))}


def scan_plan(kernel: Kernel, x, call: Call, n_out: int, out_dtype: torch.dtype, *,
              variant: int = 0, carried: Optional[str] = None,
              expand_flags: Optional[str] = None, n_boot: int = 0) -> Optional[Launch]:
    """The launch plan of op inputs `x` (a NamedTuple in kernel slot order): per-step tensors
    time-major, bootstraps (`last_*`) over time with stride 0; `carried` names the bootstrap that
    enters as the scan's initial carry instead of a slot (`initial`, or `last_value` for
    discounted returns); `expand_flags` names a flag tensor broadcast over input 0's trailing
    feature axes (and so is the mask, where there is one); `n_boot` outputs without time axis
    follow the `n_out` per-step ones. None when the strides cannot describe the batch axes.
    Packed rows (`call.segments`, semantics §7): the bootstraps `[S, ...]` are read at each step's
    segment (`Launch`'s `segments`)."""
    fields = x._fields
    T = call.T
    ins = []
    boots = {}
    for i, (name, t) in enumerate(zip(fields, x)):
        if t is None or name == carried:
            ins.append(None)
        elif name.startswith("last_") or name == "initial":
            if call.segments is None:
                ins.append(over_time(t, T))
            else:  # the first segment's over time, the others a segment stride away
                ins.append(over_time(t[0], T))
                boots[i] = (t.stride(0), sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
        else:
            ins.append(tm(t, call.time_dim))
    # a mask broadcasts over the feature axes as the flags do
    for name in () if expand_flags is None else (expand_flags, "mask"):
        i = fields.index(name) if name in fields else None
        if i is not None and ins[i] is not None:
            d, x0 = ins[i], ins[0]
            ins[i] = d[(...,) + (None,) * (x0.ndim - d.ndim)].expand(x0.shape)
    init = None if carried is None else getattr(x, carried)
    p = Launch(kernel, T, tuple(ins[0].shape[1:]), ins, tuple(x[0].shape), call.time_dim,
               n_out, out_dtype, init=init,
               init_src=None if init is None else fields.index(carried),
               has_trunc=getattr(x, "truncated", None) is not None,
               has_next=getattr(x, "next_values", None) is not None,
               has_last=carried != "last_value" and getattr(x, "last_value", None) is not None,
               variant=variant, n_boot=n_boot,
               segments=None if call.segments is None else (call.segments, boots))
    return p if p.ok else None


def run_backward(name: str, kernel: Kernel, x, call: Call, n_out: int, n_boot: int,
                 variant: int, scalars: tuple, rows: Optional[Tensor], row_params: int, *,
                 expand_flags: Optional[str] = None, copy=None) -> list:
    """An op's backward kernel on `x` (its NamedTuple of slots: inputs, saved outputs and the
    outputs' gradients; slot 0 a per-step tensor of the full shape in the caller's layout):
    `n_out` per-step float32 gradients (those `variant` says are written), then `n_boot`
    without time axis. Plans are cached under the slots' signature, as the forward's."""
    k = row_params if rows is not None else 0
    sig = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)
                for t in x)
    key = (name + "_backward", variant, k, call.time_dim, call.device, *sig)

    def build(y):
        return scan_plan(kernel, y, call, n_out, torch.float32, variant=variant,
                         expand_flags=expand_flags, n_boot=n_boot)

    def contiguous(y):
        return type(y)(*(None if t is None else t.contiguous() for t in y))

    plan, x = cached_plan(key, build, x, copy or contiguous, k)
    return plan.run(x, scalars, rows)


def like(g: Optional[Tensor], x: Optional[Tensor]) -> Optional[Tensor]:
    """A float32 gradient in its input's dtype (None stays None)."""
    return g if g is None or g.dtype == x.dtype else g.to(x.dtype)


def bits(*flags) -> int:
    """flags[i] as bit i of a VARIANT."""
    return sum(1 << i for i, f in enumerate(flags) if f)
