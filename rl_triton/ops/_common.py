"""What the value-based estimators share: their common arguments' checks, and the plan that
hands an op's inputs to the scan kernel in the op's own slot order."""
from __future__ import annotations

from typing import Optional

import torch

from .._args import FLAG, VALUE, Call, require_bootstrap
from ..scan.launch import Kernel, Launch, over_time, tm

Tensor = torch.Tensor


def value_args(x, time_dim, *, values_optional: bool = False, bootstrap: bool = True):
    """Check the fields that GAE, lambda-returns, discounted returns and V-trace share (and any
    `*_log_probs`): the per-step values, the flags, `next_values` and `last_value`. Returns the
    checked inputs (same NamedTuple) and the `Call`."""
    call = Call("rewards", x.rewards, time_dim)
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


_KIND = {"terminated": FLAG, "truncated": FLAG}
_OPTIONAL = {False: frozenset(("truncated", "next_values")),
             True: frozenset(("truncated", "next_values", "values"))}


def scan_plan(kernel: Kernel, x, call: Call, n_out: int, out_dtype: torch.dtype, *,
              variant: int = 0, carried: Optional[str] = None,
              expand_flags: Optional[str] = None) -> Optional[Launch]:
    """The launch plan of op inputs `x` (a NamedTuple in kernel slot order): per-step tensors
    time-major, bootstraps (`last_*`) over time with stride 0; `carried` names the bootstrap that
    enters as the scan's initial carry instead of a slot (`initial`, or `last_value` for
    discounted returns); `expand_flags` names a flag tensor broadcast over input 0's trailing
    feature axes. None when the strides cannot describe the batch axes."""
    fields = x._fields
    T = call.T
    ins = []
    for name, t in zip(fields, x):
        if t is None or name == carried:
            ins.append(None)
        elif name.startswith("last_"):
            ins.append(over_time(t, T))
        else:
            ins.append(tm(t, call.time_dim))
    if expand_flags is not None:
        i = fields.index(expand_flags)
        d, x0 = ins[i], ins[0]
        ins[i] = d[(...,) + (None,) * (x0.ndim - d.ndim)].expand(x0.shape)
    init = None if carried is None else getattr(x, carried)
    p = Launch(kernel, T, tuple(ins[0].shape[1:]), ins, tuple(x[0].shape), call.time_dim,
               n_out, out_dtype, init=init,
               init_src=None if init is None else fields.index(carried),
               has_trunc=getattr(x, "truncated", None) is not None,
               has_next=getattr(x, "next_values", None) is not None,
               has_last=carried != "last_value" and getattr(x, "last_value", None) is not None,
               variant=variant)
    return p if p.ok else None
