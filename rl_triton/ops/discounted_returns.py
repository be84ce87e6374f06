"""Discounted returns (reward-to-go)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import check_discount
from .._core.scan import ScanOp
from ..reference import _flags, _prep, _when
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import (cut_flags, flags_before, load_at, load_step, load_step_flag, row_value,
                           single_store, single_store_masked, store_at, store_out, successor)
from ..scan.launch import Kernel
from ._common import bits, like, run_backward, scan_plan, value_args

Tensor = torch.Tensor


class Inputs(NamedTuple):
    rewards: Tensor
    terminated: Tensor
    truncated: Optional[Tensor]
    last_value: Optional[Tensor]
    next_values: Optional[Tensor]
    mask: Optional[Tensor]


class Scalars(NamedTuple):
    gamma: float


class Extras(NamedTuple):
    # gamma is a nonzero number: last_value may enter as the scan's initial carry (`_plan`).
    # Derived by `discounted_returns` from gamma, not an argument of it; an option so that the
    # plan's key holds it
    carry_last: bool


R, TERM, TRUNC, LAST_V, NEXT_V, MASK = slots(Inputs)


@triton.jit
def coef(step, after):
    gamma = step.params[0]
    r = load_step(step, R)
    if step.VARIANT == 1:
        # last_value is the scan's initial carry A[T] (`Kernel.carries_last`): step T-1 passes
        # it on unless terminated. Through alpha instead, the rewards' loads waited on the
        # flags' and last_value's (time-major 16384x1024 68.6 -> 56.6 µs on the H200).
        cut = load_step_flag(step, TERM)
        if step.HAS_TRUNC:
            cut = cut | (load_step_flag(step, TRUNC) & (step.t < step.T - 1))
        return r, tl.where(cut, 0.0, gamma), 0.0
    term, cut = cut_flags(step, TERM, TRUNC)
    v_succ, _ = successor(step, 0, NEXT_V, LAST_V, None, False, False, None)
    alpha = r + tl.where(term, 0.0, tl.where(cut, gamma * v_succ, 0.0))
    beta = tl.where(cut, 0.0, gamma)
    return alpha, beta, 0.0


KERNEL = Kernel(coef, single_store, reverse=True, carries_last=True)


# ---- with a mask (semantics §7): the successor is the next decision step (the kernel's W scan) ---

@triton.jit
def coef_masked(step, after):
    """No values: a truncation bootstraps from w' = last_value past the last decision step and
    0 inside the row (w = 0); with next_values w = 1, and w' = 0 tells the window end."""
    r = load_step(step, R)
    term, cut = cut_flags(step, TERM, TRUNC)
    if step.HAS_NEXT:
        w = tl.full(step.mask.shape, 1.0, tl.float32)
        nv = load_step(step, NEXT_V)
    else:
        w = tl.zeros(step.mask.shape, tl.float32)
        nv = w
    return (w, (r, term, cut, nv)), 0.0, 0.0


@triton.jit
def finish_masked(step, pieces, beta, wn):
    gamma = step.params[0]
    r, term, cut, nv = pieces
    if step.HAS_NEXT:
        cut = cut | (wn == 0)
        v_succ = nv
    else:
        v_succ = wn
    return r + tl.where(cut & ~term, gamma * v_succ, 0.0), tl.where(cut, 0.0, gamma)


@triton.jit
def boot_masked(step):
    """(G, w) past the window: last_value for both (0 without it), or 0 with next_values."""
    last = tl.zeros(step.b1.shape, tl.float32)
    if step.HAS_LAST and not step.HAS_NEXT:
        last = row_value(step, LAST_V)
    return last, last


KERNEL_MASKED = Kernel(coef_masked, single_store_masked, reverse=True, aux=True,
                       mask_slot=MASK, boot=boot_masked, finish=finish_masked)


# ---- backward: H[t] = dG[t] + gamma * (1 - cut[t-1]) * H[t-1], a forward scan ----------------

class GradInputs(NamedTuple):
    terminated: Tensor  # slot 0: the full shape in the caller's layout
    truncated: Optional[Tensor]
    last_value: Optional[Tensor]  # for v' (d gamma)
    next_values: Optional[Tensor]
    returns: Optional[Tensor]  # G[t+1] (d gamma)
    grad_returns: Tensor


G_TERM, G_TRUNC, G_LAST_V, G_NEXT_V, G_RET, G_DRET = slots(GradInputs)
D_R, D_NEXT, D_ROWS, D_LAST = (tl.constexpr(1 << i) for i in range(4))  # VARIANT bits


@triton.jit
def grad_coef(step, after):
    mask = step.mask
    t = step.t
    gamma = step.params[0]
    d_ret = load_step(step, G_DRET)
    term, cut = cut_flags(step, G_TERM, G_TRUNC)
    _, cut_b = flags_before(step, G_TERM, G_TRUNC, term, cut)
    beta = tl.where(cut_b | (t == 0), 0.0, gamma)
    boot = cut & (term == 0)  # the steps that bootstrap from v'
    v_succ = tl.zeros(mask.shape, tl.float32)
    g_after = tl.zeros(mask.shape, tl.float32)
    if D_ROWS & step.VARIANT:
        v_succ, _ = successor(step, 0, G_NEXT_V, G_LAST_V, None, False, False, None)
        g_after = load_at(step, G_RET, t + 1, mask & (t + 1 < step.T))
    return d_ret, beta, (boot, cut, v_succ, g_after, t == step.T - 1)


@triton.jit
def grad_store(step, res, res_prev, aux):
    """res = H[t]: the inputs' gradients at t."""
    VARIANT: tl.constexpr = step.VARIANT
    gamma = step.params[0]
    boot, cut, v_succ, g_after, at_end = aux
    if D_R & VARIANT:
        store_out(step, 0, res)
    d_succ = tl.where(boot, gamma * res, 0.0)
    if D_NEXT & VARIANT:
        store_out(step, 1, d_succ)
    if D_ROWS & VARIANT:
        store_out(step, 2, res * (tl.where(boot, v_succ, 0.0) + tl.where(cut, 0.0, g_after)))
    if D_LAST & VARIANT:
        store_at(step, 3, step.mask & at_end, d_succ)


GRAD_KERNEL = Kernel(grad_coef, grad_store, reverse=False, exclusive=True, aux=True)


def backward(x: Inputs, outs, grads, s: Scalars, rows, call, extra, needs):
    nr, _, _, nlast, nnext, nrows = needs
    (d_ret,) = grads
    if d_ret is None:
        d_ret = torch.zeros_like(outs[0])
    gx = GradInputs(x.terminated, x.truncated, x.last_value, x.next_values,
                    outs[0] if nrows else None, d_ret)
    variant = bits(nr, nnext, nrows, nlast)
    dr, dnext, dg, dlast = run_backward(OP.name, GRAD_KERNEL, gx, call, 3, 1, variant, s,
                                        rows, OP.row_params)
    return [like(dr, x.rewards) if nr else None, None, None,
            like(dlast, x.last_value) if nlast else None,
            like(dnext, x.next_values) if nnext else None,
            dg.sum(call.time_dim)[None] if nrows else None]


def torch_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float32, packed=None):
    r, lv, nv = _prep(dtype, x.rewards, x.last_value, x.next_values)
    term, trunc = _flags(x.terminated, x.truncated)
    m, end = torch_scan.decisions(x.mask, r, packed)
    v_succ = torch_scan.successor(None, nv, lv, r, m, packed)
    cut = torch_scan.cut(term, trunc, end)
    alpha = r + _when(cut & ~term, s.gamma, v_succ)
    beta = torch_scan.keep(cut, s.gamma, dtype)
    return torch_scan.zero_masked(
        torch_scan.scan(*torch_scan.masked(alpha, beta, m), reverse=True), m)


def loop_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float64):
    return reference.discounted_returns(**x._asdict(), **s._asdict(), dtype=dtype)


def _plan(x, call, out_dtype, extra: Extras):
    if x.mask is not None:
        return scan_plan(KERNEL_MASKED, x, call, 1, out_dtype)
    # last_value as the initial carry: one row's (packed rows read one per segment). Not with a
    # gamma that is 0 or may be (a tensor): the carry enters G[T-1] through beta = gamma, a
    # select at 0, where r + gamma v' is a product (NaN for an inf or NaN v'; docs/semantics.md
    # §1, §3), which variant 0 forms in alpha
    carried = (extra.carry_last and x.last_value is not None and x.next_values is None
               and call.segments is None)
    return scan_plan(KERNEL, x, call, 1, out_dtype, variant=int(carried),
                     carried="last_value" if carried else None)


OP = ScanOp("discounted_returns", Inputs, Scalars, extras=Extras,
            check=lambda x, td, extra, segments=None: value_args(x, td, bootstrap=False,
                                                                 segments=segments), plan=_plan,
            torch=torch_impl, loop=loop_impl, row_params=1, backward=backward,
            masked_kernels=lambda x: True, packed_kernels=lambda x: True)


def discounted_returns(rewards, terminated, truncated=None, *, last_value=None, next_values=None,
                       mask=None, cu_seqlens=None, check_offsets=True, gamma=0.99, time_dim=0,
                       backend="auto", out_dtype=torch.float32):
    """Discounted returns (reward-to-go). Returns `G`.

    Recurrence (reverse)::

        G[t] = r[t] + gamma * (1 - terminated[t]) * (cut[t] * v'[t] + (1 - cut[t]) * G[t+1])

    A missing bootstrap means zero: without `last_value` the window end is treated as the end of
    the returns (Monte-Carlo reward-to-go inside the window), and without `next_values` a
    truncation inside the window bootstraps with zero. The one estimator that allows it.

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

        >>> G = rl_triton.discounted_returns(rewards, terminated, gamma=0.99)
    """
    gamma = check_discount("gamma", gamma)
    return OP(Inputs(rewards, terminated, truncated, last_value, next_values, mask),
              Scalars(gamma), time_dim, backend, out_dtype,
              Extras(not isinstance(gamma, Tensor) and gamma != 0),
              cu_seqlens=cu_seqlens, check_offsets=check_offsets)
