"""V-trace (IMPALA) targets and policy-gradient advantages."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import check_discount, check_scalar
from .._core.scan import ScanOp
from ..reference import _decided, _flags, _prep, _when
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import (clip, cut_coefficient, cut_flags, finish_linear, flags_before, load_at,
                           load_step, row_value, store_out, successor, value_before)
from ..scan.launch import Kernel
from ._common import bits, like, run_backward, scan_plan, value_args

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
    mask: Optional[Tensor]


class Scalars(NamedTuple):
    gamma: float
    lam: float
    rho_clip: float
    c_clip: float
    pg_rho_clip: float


R, V, TERM, TARGET_LP, BEHAVIOR_LP, TRUNC, LAST_V, NEXT_V, MASK = slots(Inputs)


@triton.jit
def coef(step, after):
    gamma = step.params[0]
    lam = step.params[1]
    rho_clip = step.params[2]
    c_clip = step.params[3]
    r = load_step(step, R)
    v = load_step(step, V)
    term, cut = cut_flags(step, TERM, TRUNC)
    v_succ, v_slot_next = successor(step, V, NEXT_V, LAST_V, v, True, True,
                                    None if after is None else after[1])
    ratio = tl.exp(load_step(step, TARGET_LP) - load_step(step, BEHAVIOR_LP))
    target = r + tl.where(term, 0.0, gamma * v_succ)
    alpha = clip(ratio, rho_clip) * (target - v)
    # a NaN trace coefficient (a NaN ratio, or gamma lam = 0 times an infinite ratio with
    # c_clip = inf) makes alpha NaN, with beta 0 (the scan's combine relies on it)
    alpha, beta = cut_coefficient(alpha, gamma * lam * clip(ratio, c_clip), cut)
    return alpha, beta, (r, v, term, cut, ratio, v_succ, v_slot_next)


@triton.jit
def store(step, res, res_prev, aux):
    gamma = step.params[0]
    lam = step.params[1]
    pg_rho_clip = step.params[4]
    r, v, term, cut, ratio, v_succ, v_slot_next = aux
    store_out(step, 0, v + res)  # vs
    # vs'[t] = vs[t+1] = V[t+1] + D[t+1] inside an episode and the window, v'[t] at a cut.
    vs_succ = tl.where(cut, v_succ, v_slot_next + res_prev)
    pg = clip(ratio, pg_rho_clip) * (
        r + tl.where(term, 0.0, gamma * (lam * vs_succ + (1.0 - lam) * v_succ)) - v)
    store_out(step, 1, pg)


KERNEL = Kernel(coef, store, reverse=True, exclusive=True, aux=True)


# ---- with a mask (semantics §7): the successor is the next decision step (the kernel's W scan) ---

@triton.jit
def coef_masked(step, after):
    """w = V[t]; delta = rho (r - V) + rho gamma (1 - term) w' (`finish_linear`), or with
    next_values rho (r + gamma (1 - term) v' - V) (c = 0), v' in the aux."""
    gamma = step.params[0]
    lam = step.params[1]
    rho_clip = step.params[2]
    c_clip = step.params[3]
    r = load_step(step, R)
    v = load_step(step, V)
    term, cut = cut_flags(step, TERM, TRUNC)
    ratio = tl.exp(load_step(step, TARGET_LP) - load_step(step, BEHAVIOR_LP))
    rho = clip(ratio, rho_clip)
    if step.HAS_NEXT:
        nv = load_step(step, NEXT_V)
        c = tl.zeros(step.mask.shape, tl.float32)
    else:
        c = tl.where(term, 0.0, rho * gamma)  # NaN with a NaN ratio: alpha NaN
    # (one return: Triton 3.6 checks every return's types)
    if step.HAS_NEXT:
        a = rho * (r + tl.where(term, 0.0, gamma * nv) - v)
        own = (r, v, term, cut, ratio, nv)
    else:
        a = rho * (r - v)
        own = (r, v, term, cut, ratio)
    a, beta = cut_coefficient(a, gamma * lam * clip(ratio, c_clip), cut)  # as `coef`'s
    return (v, (a, c)), beta, own


@triton.jit
def boot_masked(step):
    """(D, w) past the window: 0, and last_value; with next_values w = NaN, which marks the
    last decision step (`store_masked`)."""
    if step.HAS_NEXT:
        w = tl.full(step.b1.shape, float("nan"), tl.float32)
    else:
        w = row_value(step, LAST_V)
    return tl.zeros(step.b1.shape, tl.float32), w


NEXT = tl.constexpr(1)  # the masked kernel's VARIANT bit: next_values (no HAS_NEXT in writers)


@triton.jit
def store_masked(step, res, res_prev, aux):
    VARIANT: tl.constexpr = step.VARIANT
    gamma = step.params[0]
    lam = step.params[1]
    pg_rho_clip = step.params[4]
    own, keep, wn = aux  # (no nested unpacking: Triton 3.6)
    if NEXT & VARIANT:
        r, v, term, cut, ratio, v_succ = own
    else:
        r, v, term, cut, ratio = own
        v_succ = wn
    store_out(step, 0, tl.where(keep, v + res, 0.0))
    # vs' = vs at the next decision step = its value (w') + its D (the exclusive scan)
    if NEXT & VARIANT:
        # past the last decision step w' is the boot's NaN and D' is 0; elsewhere w' is V at
        # the next decision step, and a NaN there makes its D NaN: the window end, vs' = v'
        end = (wn != wn) & (res_prev == res_prev)
        vs_succ = tl.where(cut | end, v_succ, wn + res_prev)
    else:
        vs_succ = tl.where(cut, v_succ, v_succ + res_prev)
    pg = clip(ratio, pg_rho_clip) * (
        r + tl.where(term, 0.0, gamma * (lam * vs_succ + (1.0 - lam) * v_succ)) - v)
    store_out(step, 1, tl.where(keep, pg, 0.0))


KERNEL_MASKED = Kernel(coef_masked, store_masked, reverse=True, exclusive=True, aux=True,
                       mask_slot=MASK, boot=boot_masked, finish=finish_linear)


# ---- backward: H[t] = dD[t] + gamma * c[t-1] * (1 - cut[t-1]) * H[t-1], a forward scan ------
# dD[t] = d vs[t] plus, inside an episode, pg[t-1]'s dependence on vs'[t-1] = vs[t].

class GradInputs(NamedTuple):
    terminated: Tensor  # slot 0: the full shape in the caller's layout
    truncated: Optional[Tensor]
    rewards: Tensor
    values: Tensor
    target_log_probs: Tensor
    behavior_log_probs: Tensor
    last_value: Optional[Tensor]
    next_values: Optional[Tensor]
    vs: Tensor  # D[t+1] = vs[t+1] - V[t+1]
    grad_vs: Optional[Tensor]
    grad_pg: Optional[Tensor]


(G_TERM, G_TRUNC, G_R, G_V, G_TLP, G_BLP, G_LAST_V, G_NEXT_V, G_VS, G_DVS,
 G_DPG) = slots(GradInputs)
# VARIANT bits
D_R, D_V, D_TLP, D_BLP, D_NEXT, D_ROWS, HAS_DVS, HAS_DPG, SLOT_SUCC = (
    tl.constexpr(1 << i) for i in range(9))


@triton.jit
def grad_coef(step, after):
    """alpha = dD[t], beta = gamma lam c[t-1] where the trace from t-1 went on. The aux: each
    gradient at t as c0 + c1 * H[t] (+ c2 * H[t-1]), its coefficients formed here, so that the
    scan holds those (8 per step without per-row discounts) rather than the 15 values behind
    them (they spilled registers)."""
    VARIANT: tl.constexpr = step.VARIANT
    t = step.t
    gamma = step.params[0]
    lam = step.params[1]
    rho_clip = step.params[2]
    c_clip = step.params[3]
    pg_rho_clip = step.params[4]
    zero = tl.zeros(step.mask.shape, tl.float32)
    first = t == 0
    # step t
    r = load_step(step, G_R)
    v = load_step(step, G_V)
    term, cut = cut_flags(step, G_TERM, G_TRUNC)
    v_succ, v_after = successor(step, G_V, G_NEXT_V, G_LAST_V, v, True, True, None)
    tlp = load_step(step, G_TLP)
    blp = load_step(step, G_BLP)
    ratio = tl.exp(tlp - blp)
    vs_after = load_at(step, G_VS, t + 1, step.mask & (t + 1 < step.T))
    d_after = tl.where(cut, 0.0, vs_after - v_after)  # D[t+1] inside the episode
    vs_succ = tl.where(cut, v_succ, vs_after)
    d_pg = zero
    if HAS_DPG & VARIANT:
        d_pg = load_step(step, G_DPG)
    d_vs = zero
    if HAS_DVS & VARIANT:
        d_vs = load_step(step, G_DVS)
    # step t-1: its trace coefficient and pg[t-1]'s weight on vs[t]
    term_b, cut_b = flags_before(step, G_TERM, G_TRUNC, term, cut)
    ratio_b = tl.exp(value_before(step, G_TLP, tlp) - value_before(step, G_BLP, blp))
    stop_b = cut_b | first
    c_b = gamma * lam * clip(ratio_b, c_clip)  # NaN (a NaN ratio, 0 * inf): 0, as a NaN ratio's
    beta = tl.where(stop_b | (c_b != c_b), 0.0, c_b)
    p_b = zero
    if HAS_DPG & VARIANT:
        p_b = value_before(step, G_DPG, d_pg) * clip(ratio_b, pg_rho_clip)
    alpha = d_vs + tl.where(stop_b, 0.0, gamma * lam * p_b)
    # the gradients' coefficients; rho H[t] + p is d r[t] (p: d pg[t] / d its bracket)
    rho = clip(ratio, rho_clip)
    p = d_pg * clip(ratio, pg_rho_clip)
    # d V[t] = dv0 - rho H[t] + dv2 H[t-1]
    if SLOT_SUCC & VARIANT:  # V[t] = v'[t-1], and vs[t] = V[t] + D[t] = vs'[t-1]
        off_b = term_b | first
        dv0 = d_vs - p + tl.where(off_b, 0.0, gamma * p_b)
        dv2 = tl.where(off_b, 0.0, gamma * clip(ratio_b, rho_clip))
    else:  # vs'[t-1] only
        dv0 = d_vs - p + tl.where(stop_b, 0.0, gamma * lam * p_b)
        dv2 = zero
    # d log ratio[t] = dl1 H[t] + dl0; ties count as below the clip, as torch.clamp's gradient
    target = r + tl.where(term, 0.0, gamma * v_succ)
    boot = tl.where(term, 0.0, lam * vs_succ + (1.0 - lam) * v_succ)
    dl1 = ratio * (tl.where(ratio <= rho_clip, target - v, 0.0)
                   + tl.where(ratio <= c_clip, gamma * lam * d_after, 0.0))
    dl0 = ratio * tl.where(ratio <= pg_rho_clip, d_pg * (r + gamma * boot - v), 0.0)
    # d v'[t] = dn1 H[t] + dn0 (next_values[t], or last_value at T-1)
    dn1 = tl.where(term, 0.0, gamma * rho)
    dn0 = tl.where(term, 0.0, gamma * p * tl.where(cut, 1.0, 1.0 - lam))
    # per-row gamma and lam: dg1 H[t] + dg0, dm1 H[t] + dm0
    c = clip(ratio, c_clip)
    dg1 = rho * tl.where(term, 0.0, v_succ) + lam * c * d_after
    dg0 = p * boot
    dm1 = gamma * c * d_after
    dm0 = p * tl.where(term, 0.0, gamma * (vs_succ - v_succ))
    return alpha, beta, (rho, p, dv0, dv2, dl1, dl0, dn1, dn0, dg1, dg0, dm1, dm0)


@triton.jit
def grad_store(step, res, res_prev, aux):
    """res = H[t], res_prev = H[t-1]: the inputs' gradients at t."""
    VARIANT: tl.constexpr = step.VARIANT
    rho, p, dv0, dv2, dl1, dl0, dn1, dn0, dg1, dg0, dm1, dm0 = aux
    h_rho = res * rho
    if D_R & VARIANT:
        store_out(step, 0, h_rho + p)
    if D_V & VARIANT:
        dv = dv0 - h_rho
        if SLOT_SUCC & VARIANT:
            dv += dv2 * res_prev
        store_out(step, 1, dv)
    if (D_TLP | D_BLP) & VARIANT:
        d_log = dl1 * res + dl0
        if D_TLP & VARIANT:
            store_out(step, 2, d_log)
        if D_BLP & VARIANT:
            store_out(step, 3, -d_log)
    if D_NEXT & VARIANT:
        store_out(step, 4, dn1 * res + dn0)
    if D_ROWS & VARIANT:
        store_out(step, 5, dg1 * res + dg0)
        store_out(step, 6, dm1 * res + dm0)


GRAD_KERNEL = Kernel(grad_coef, grad_store, reverse=False, exclusive=True, aux=True, heavy=True)


def backward(x: Inputs, outs, grads, s: Scalars, rows, call, extra, needs):
    nr, nv, _, ntlp, nblp, _, nlast, nnext, nrows = needs
    d_vs, d_pg = grads
    gx = GradInputs(x.terminated, x.truncated, x.rewards, x.values, x.target_log_probs,
                    x.behavior_log_probs, x.last_value, x.next_values, outs[0], d_vs, d_pg)
    variant = bits(nr or nlast, nv, ntlp, nblp, nnext, nrows, d_vs is not None,
                   d_pg is not None, x.next_values is None)
    dr, dv, dtlp, dblp, dnext, dg, dl = run_backward(
        OP.name, GRAD_KERNEL, gx, call, 7, 0, variant, s, rows, OP.row_params)
    dlast = None
    if nlast:
        # d last_value = d v'[T-1] = gamma (1 - terminated[T-1]) d r[T-1] (T-1 is a cut): from
        # d r, as the kernel's store of one step per row with time stride 0 took 40 registers
        td = call.time_dim
        gamma = rows[0] if rows is not None else s.gamma
        dlast = torch.where(x.terminated.select(td, -1) != 0, 0.0, gamma * dr.select(td, -1))
    return [like(dr, x.rewards) if nr else None, like(dv, x.values) if nv else None, None,
            like(dtlp, x.target_log_probs) if ntlp else None,
            like(dblp, x.behavior_log_probs) if nblp else None, None,
            like(dlast, x.last_value) if nlast else None,
            like(dnext, x.next_values) if nnext else None,
            torch.stack([dg.sum(call.time_dim), dl.sum(call.time_dim)]) if nrows else None]


def torch_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float32, packed=None):
    r, v, tlp, blp, lv, nv = _prep(dtype, x.rewards, x.values, x.target_log_probs,
                                   x.behavior_log_probs, x.last_value, x.next_values)
    term, trunc = _flags(x.terminated, x.truncated)
    m, end = torch_scan.decisions(x.mask, r, packed)
    r, v, tlp, blp, nv = _decided(m, r, v, tlp, blp, nv)
    v_succ = torch_scan.successor(v, nv, lv, r, m, packed)
    cut = torch_scan.cut(term, trunc, end)
    ratio = torch.exp(tlp - blp)  # torch.clamp keeps a NaN ratio NaN
    target = r + _when(~term, s.gamma, v_succ)
    alpha = torch.clamp(ratio, max=s.rho_clip) * (target - v)
    beta = _when(~cut, s.gamma * s.lam, torch.clamp(ratio, max=s.c_clip))
    d = torch_scan.scan(*torch_scan.masked(alpha, beta, m), reverse=True)
    vs = v + d
    vs_succ = torch.where(cut, v_succ, torch_scan.shift_up(vs, torch.zeros_like(r[0]), m))
    boot = _when(~term, s.lam, vs_succ) + _when(~term, 1 - s.lam, v_succ)  # (as the loop's)
    pg = torch.clamp(ratio, max=s.pg_rho_clip) * (r + _when(~term, s.gamma, boot) - v)
    return torch_scan.zero_masked(vs, m), torch_scan.zero_masked(pg, m)


def loop_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float64):
    return reference.vtrace(**x._asdict(), **s._asdict(), dtype=dtype)


OP = ScanOp("vtrace", Inputs, Scalars, outputs=2,
            check=lambda x, td, extra, segments=None: value_args(x, td, segments=segments),
            plan=lambda x, call, out_dtype, extra: scan_plan(
                KERNEL if x.mask is None else KERNEL_MASKED, x, call, 2, out_dtype,
                variant=int(x.mask is not None and x.next_values is not None)),
            masked_kernels=lambda x: True, packed_kernels=lambda x: True,
            torch=torch_impl, loop=loop_impl, row_params=2, backward=backward)


def vtrace(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated=None, *,
           last_value=None, next_values=None, mask=None, cu_seqlens=None, check_offsets=True,
           gamma=0.99, lam=1.0, rho_clip=1.0, c_clip=1.0, pg_rho_clip=1.0, time_dim=0,
           backend="auto", out_dtype=torch.float32):
    """V-trace targets (IMPALA). Returns `(vs, pg_advantages)`.

    With ratio[t] = exp(target_log_probs[t] - behavior_log_probs[t]) (log-probabilities of the
    taken actions), rho[t] = min(rho_clip, ratio[t]) and c[t] = lam * min(c_clip, ratio[t])::

        delta[t] = rho[t] * (r[t] + gamma * (1 - terminated[t]) * v'[t] - V[t])
        D[t]     = delta[t] + gamma * c[t] * (1 - cut[t]) * D[t+1]          vs = V + D
        vs'[t]   = vs[t+1] if not cut[t] else v'[t]
        pg_advantages[t] = min(pg_rho_clip, ratio[t])
                           * (r[t] + gamma * (1 - terminated[t]) * (lam * vs'[t] + (1 - lam) * v'[t]) - V[t])

    On-policy (ratio 1) with lam = 1 and no clipping, vs equals the lambda-return with lambda 1.

    `mask` (semantics §7; bool, integer or float, the shape of `rewards`): the decision steps. The
    recurrence runs over them only, as if the other steps were deleted from each row: a step's
    successor is the next decision step, each row's last decision step is its window end, and
    outputs at masked steps are 0.
    `cu_seqlens` (semantics §7; integers [S + 1], FlashAttention's convention): packed rows. The
    per-step tensors are `[L, ...]` (time on axis 0), each segment [cu[i], cu[i+1]) a row of its
    own whose last step is a window end; bootstraps are `[S, ...]`. Combines with `mask`.
    Per-step tensors may carry batch axes after the packed one (`[L, N]`, bootstraps
    `[S, N]`); a tensor discount is one per segment, `[S]` or `[S, N]`. The offsets must
    start at 0, end at L and never decrease (else `ValueError`), checked on every call: free
    on CPU offsets, one device sync on CUDA ones, which `check_offsets=False` skips (for
    CUDA-graph capture; whatever the offsets hold, nothing is read outside the tensors).

    Example::

        >>> vs, pg_adv = rl_triton.vtrace(rewards, values, terminated, logp_target, logp_behavior,
        ...                               last_value=v_last)
    """
    clip = dict(high=None, low_open=True)
    s = Scalars(check_discount("gamma", gamma), check_discount("lam", lam),
                check_scalar("rho_clip", rho_clip, **clip), check_scalar("c_clip", c_clip, **clip),
                check_scalar("pg_rho_clip", pg_rho_clip, **clip))
    return OP(Inputs(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated,
                     last_value, next_values, mask), s, time_dim, backend, out_dtype,
              cu_seqlens=cu_seqlens, check_offsets=check_offsets)
