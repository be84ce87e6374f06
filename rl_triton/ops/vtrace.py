"""V-trace (IMPALA) targets and policy-gradient advantages."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import check_discount, check_scalar
from .._plans import Op
from ..reference import _flags, _prep
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import clip, cut_flags, load_step, store_out, successor
from ..scan.launch import Kernel
from ._common import scan_plan, value_args

Tensor = torch.Tensor


class Inputs(NamedTuple):
    rewards: Tensor
    values: Tensor
    terminated: Tensor
    target_log_probs: Tensor
    behavior_log_probs: Tensor
    truncated: Optional[Tensor]
    last_value: Optional[Tensor]
    next_values: Optional[Tensor]


class Scalars(NamedTuple):
    gamma: float
    lam: float
    rho_clip: float
    c_clip: float
    pg_rho_clip: float


R, V, TERM, TARGET_LP, BEHAVIOR_LP, TRUNC, LAST_V, NEXT_V = slots(Inputs)


@triton.jit
def coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
         HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
         VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
         ACT_VEC: tl.constexpr, after):
    gamma = params[0]
    lam = params[1]
    rho_clip = params[2]
    c_clip = params[3]
    r = load_step(ins, st, s1, s2, R, t, b1, b2, mask)
    v = load_step(ins, st, s1, s2, V, t, b1, b2, mask)
    term, cut = cut_flags(ins, st, s1, s2, TERM, TRUNC, t, b1, b2, mask, T, HAS_TRUNC)
    v_succ, v_slot_next = successor(ins, st, s1, s2, V, NEXT_V, LAST_V, t, b1, b2, mask,
                                    end_rows, T, v, True, HAS_NEXT, HAS_LAST, True,
                                    None if after is None else after[1])
    ratio = tl.exp(load_step(ins, st, s1, s2, TARGET_LP, t, b1, b2, mask)
                   - load_step(ins, st, s1, s2, BEHAVIOR_LP, t, b1, b2, mask))
    target = r + tl.where(term, 0.0, gamma * v_succ)
    alpha = clip(ratio, rho_clip) * (target - v)
    # a NaN ratio makes alpha NaN; beta stays finite (the scan's combine relies on it)
    beta = tl.where(cut | (ratio != ratio), 0.0, gamma * lam * clip(ratio, c_clip))
    return alpha, beta, (r, v, term, cut, ratio, v_succ, v_slot_next)


@triton.jit
def store(outs, ost, os1, os2, t, b1, b2, mask, res, res_prev, aux, params,
          VARIANT: tl.constexpr):
    gamma = params[0]
    lam = params[1]
    pg_rho_clip = params[4]
    r, v, term, cut, ratio, v_succ, v_slot_next = aux
    store_out(outs, ost, os1, os2, 0, t, b1, b2, mask, v + res)  # vs
    # vs'[t] = vs[t+1] = V[t+1] + D[t+1] inside an episode and the window, v'[t] at a cut.
    vs_succ = tl.where(cut, v_succ, v_slot_next + res_prev)
    pg = clip(ratio, pg_rho_clip) * (
        r + tl.where(term, 0.0, gamma * (lam * vs_succ + (1.0 - lam) * v_succ)) - v)
    store_out(outs, ost, os1, os2, 1, t, b1, b2, mask, pg)


KERNEL = Kernel(coef, store, reverse=True, exclusive=True, aux=True)


def torch_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float32):
    r, v, tlp, blp, lv, nv = _prep(dtype, x.rewards, x.values, x.target_log_probs,
                                   x.behavior_log_probs, x.last_value, x.next_values)
    term, trunc = _flags(x.terminated, x.truncated)
    v_succ = torch_scan.successor(v, nv, lv, r)
    cut = torch_scan.cut(term, trunc)
    ratio = torch.exp(tlp - blp)  # torch.clamp keeps a NaN ratio NaN
    target = r + torch.where(term, 0.0, s.gamma * v_succ)
    alpha = torch.clamp(ratio, max=s.rho_clip) * (target - v)
    beta = torch.where(cut, 0.0, s.gamma * s.lam * torch.clamp(ratio, max=s.c_clip))
    d = torch_scan.scan(alpha, beta, reverse=True)
    vs = v + d
    vs_succ = torch.where(cut, v_succ, torch_scan.shift_up(vs, torch.zeros_like(r[0])))
    boot = s.lam * vs_succ + (1 - s.lam) * v_succ
    pg = torch.clamp(ratio, max=s.pg_rho_clip) * (r + torch.where(term, 0.0, s.gamma * boot) - v)
    return vs, pg


def loop_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float64):
    return reference.vtrace(**x._asdict(), **s._asdict(), dtype=dtype)


OP = Op("vtrace", Inputs, Scalars, outputs=2, check=lambda x, td, extra: value_args(x, td),
        plan=lambda x, call, out_dtype, extra: scan_plan(KERNEL, x, call, 2, out_dtype),
        torch=torch_impl, loop=loop_impl, row_params=2)


def vtrace(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated=None, *,
           last_value=None, next_values=None, gamma=0.99, lam=1.0, rho_clip=1.0, c_clip=1.0,
           pg_rho_clip=1.0, time_dim=0, backend="auto", out_dtype=torch.float32):
    """V-trace targets (IMPALA). Returns `(vs, pg_advantages)`.

    With ratio[t] = exp(target_log_probs[t] - behavior_log_probs[t]) (log-probabilities of the
    taken actions), rho[t] = min(rho_clip, ratio[t]) and c[t] = lam * min(c_clip, ratio[t])::

        delta[t] = rho[t] * (r[t] + gamma * (1 - terminated[t]) * v'[t] - V[t])
        D[t]     = delta[t] + gamma * c[t] * (1 - cut[t]) * D[t+1]          vs = V + D
        vs'[t]   = vs[t+1] if not cut[t] else v'[t]
        pg_advantages[t] = min(pg_rho_clip, ratio[t])
                           * (r[t] + gamma * (1 - terminated[t]) * (lam * vs'[t] + (1 - lam) * v'[t]) - V[t])

    On-policy (ratio 1) with lam = 1 and no clipping, vs equals the lambda-return with lambda 1.

    Example::

        >>> vs, pg_adv = rl_triton.vtrace(rewards, values, terminated, logp_target, logp_behavior,
        ...                               last_value=v_last)
    """
    clip = dict(high=None, low_open=True)
    s = Scalars(check_discount("gamma", gamma), check_discount("lam", lam),
                check_scalar("rho_clip", rho_clip, **clip), check_scalar("c_clip", c_clip, **clip),
                check_scalar("pg_rho_clip", pg_rho_clip, **clip))
    return OP(Inputs(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated,
                     last_value, next_values), s, time_dim, backend, out_dtype)
