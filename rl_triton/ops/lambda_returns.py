"""TD(lambda) returns."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import check_scalar
from .._plans import Op
from ..reference import _flags, _prep
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import cut_flags, load_step, single_store, successor
from ..scan.launch import Kernel
from ._common import scan_plan, value_args

Tensor = torch.Tensor


class Inputs(NamedTuple):
    rewards: Tensor
    values: Optional[Tensor]  # used as successor values only: may be None with next_values
    terminated: Tensor
    truncated: Optional[Tensor]
    last_value: Optional[Tensor]
    next_values: Optional[Tensor]


class Scalars(NamedTuple):
    gamma: float
    lam: float


R, V, TERM, TRUNC, LAST_V, NEXT_V = slots(Inputs)


@triton.jit
def coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
         HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
         VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
         ACT_VEC: tl.constexpr, after):
    gamma = params[0]
    lam = params[1]
    r = load_step(ins, st, s1, s2, R, t, b1, b2, mask)
    term, cut = cut_flags(ins, st, s1, s2, TERM, TRUNC, t, b1, b2, mask, T, HAS_TRUNC)
    v_succ, _ = successor(ins, st, s1, s2, V, NEXT_V, LAST_V, t, b1, b2, mask, end_rows, T,
                          None, True, HAS_NEXT, HAS_LAST, False, None)
    keep = tl.where(cut, 0.0, lam)
    alpha = r + tl.where(term, 0.0, gamma * (1.0 - keep) * v_succ)
    beta = gamma * keep  # keep is 0 at terminations (cut includes them)
    return alpha, beta, 0.0


KERNEL = Kernel(coef, single_store, reverse=True, trunc_slot_always=(TERM.value, TRUNC.value))


def torch_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float32):
    r, v, lv, nv = _prep(dtype, x.rewards, x.values, x.last_value, x.next_values)
    term, trunc = _flags(x.terminated, x.truncated)
    v_succ = torch_scan.successor(v, nv, lv, r)
    keep = torch_scan.keep(torch_scan.cut(term, trunc), s.lam, dtype)  # 0 at terminations too
    alpha = r + torch.where(term, 0.0, s.gamma * (1 - keep) * v_succ)
    beta = s.gamma * keep
    return torch_scan.scan(alpha, beta, reverse=True)


def loop_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float64):
    return reference.lambda_returns(**x._asdict(), **s._asdict(), dtype=dtype)


OP = Op("lambda_returns", Inputs, Scalars,
        check=lambda x, td, extra: value_args(x, td, values_optional=x.next_values is not None),
        plan=lambda x, call, out_dtype, extra: scan_plan(KERNEL, x, call, 1, out_dtype),
        torch=torch_impl, loop=loop_impl)


def lambda_returns(rewards, values, terminated, truncated=None, *, last_value=None,
                   next_values=None, gamma=0.99, lam=0.95, time_dim=0, backend="auto",
                   out_dtype=torch.float32):
    """TD(lambda) returns. Returns the tensor `G` of lambda-returns.

    Recurrence (reverse), with v'[t] the successor value and cut[t] as in `gae`::

        G[t] = r[t] + gamma * (1 - terminated[t]) * ((1 - lam * (1 - cut[t])) * v'[t]
                                                      + lam * (1 - cut[t]) * G[t+1])

    `values` are used only as successor values: with `next_values` given, `values` may be None.
    Equal to `gae(...)[1]` (the GAE returns) for the same inputs.

    Example::

        >>> G = rl_triton.lambda_returns(rewards, values, terminated, last_value=v_last, lam=0.9)
    """
    return OP(Inputs(rewards, values, terminated, truncated, last_value, next_values),
              Scalars(check_scalar("gamma", gamma), check_scalar("lam", lam)),
              time_dim, backend, out_dtype)
