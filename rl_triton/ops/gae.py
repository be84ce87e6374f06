"""GAE: generalized advantage estimation."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import check_scalar
from .._plans import Op
from ..reference import _flags, _prep
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import cut_flags, load_step, store_out, successor
from ..scan.launch import Kernel
from ._common import scan_plan, value_args

Tensor = torch.Tensor


class Inputs(NamedTuple):
    rewards: Tensor
    values: Tensor
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
    """alpha = delta[t], beta = gamma * lam where the trace goes on; aux: values[t]."""
    gamma = params[0]
    lam = params[1]
    r = load_step(ins, st, s1, s2, R, t, b1, b2, mask)
    v = load_step(ins, st, s1, s2, V, t, b1, b2, mask)
    term, cut = cut_flags(ins, st, s1, s2, TERM, TRUNC, t, b1, b2, mask, T, HAS_TRUNC)
    v_succ, _ = successor(ins, st, s1, s2, V, NEXT_V, LAST_V, t, b1, b2, mask, end_rows, T, v,
                          True, HAS_NEXT, HAS_LAST, False, after)
    alpha = r + tl.where(term, 0.0, gamma * v_succ) - v
    beta = tl.where(cut, 0.0, gamma * lam)
    return alpha, beta, v


@triton.jit
def store(outs, ost, os1, os2, t, b1, b2, mask, res, res_prev, aux, params,
          VARIANT: tl.constexpr):
    store_out(outs, ost, os1, os2, 0, t, b1, b2, mask, res)  # advantages
    store_out(outs, ost, os1, os2, 1, t, b1, b2, mask, res + aux)  # returns = A + V


KERNEL = Kernel(coef, store, reverse=True, aux=True)


def torch_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float32):
    r, v, lv, nv = _prep(dtype, x.rewards, x.values, x.last_value, x.next_values)
    term, trunc = _flags(x.terminated, x.truncated)
    v_succ = torch_scan.successor(v, nv, lv, r)
    alpha = r + torch.where(term, 0.0, s.gamma * v_succ) - v
    beta = torch_scan.keep(torch_scan.cut(term, trunc), s.gamma * s.lam, dtype)
    adv = torch_scan.scan(alpha, beta, reverse=True)
    return adv, adv + v


def loop_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float64):
    return reference.gae(**x._asdict(), **s._asdict(), dtype=dtype)


OP = Op("gae", Inputs, Scalars, outputs=2, check=lambda x, td, extra: value_args(x, td),
        plan=lambda x, call, out_dtype, extra: scan_plan(KERNEL, x, call, 2, out_dtype),
        torch=torch_impl, loop=loop_impl)


def gae(rewards, values, terminated, truncated=None, *, last_value=None, next_values=None,
        gamma=0.99, lam=0.95, time_dim=0, backend="auto", out_dtype=torch.float32):
    """Generalized Advantage Estimation. Returns `(advantages, returns)`.

    Recurrence (reverse in time), with v'[t] the successor value and cut[t] = terminated[t] or
    truncated[t] or t == T-1::

        delta[t] = r[t] + gamma * (1 - terminated[t]) * v'[t] - V[t]
        A[t]     = delta[t] + gamma * lam * (1 - cut[t]) * A[t+1]
        returns  = A + V

    Boundaries: a termination drops v'[t]; a truncation keeps v'[t] (the value of the state the
    episode was cut at) and stops the trace; the last step of the window bootstraps from
    `last_value` (or `next_values[T-1]`) and stops the trace.

    Example::

        >>> T, N = 128, 8
        >>> rewards, values = torch.randn(T, N), torch.randn(T, N)
        >>> terminated = torch.rand(T, N) < 0.01
        >>> adv, ret = rl_triton.gae(rewards, values, terminated, last_value=torch.randn(N))
    """
    return OP(Inputs(rewards, values, terminated, truncated, last_value, next_values),
              Scalars(check_scalar("gamma", gamma), check_scalar("lam", lam)),
              time_dim, backend, out_dtype)
