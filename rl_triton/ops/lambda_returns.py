"""TD(lambda) returns."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import check_discount
from .._core.scan import ScanOp
from ..reference import _flags, _prep, _when
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import (cut_flags, flags_before, load_at, load_step, row_value, single_store,
                           single_store_masked, store_at, store_out, successor)
from ..scan.launch import Kernel
from ._common import bits, like, run_backward, scan_plan, value_args

Tensor = torch.Tensor


class Inputs(NamedTuple):
    rewards: Tensor
    values: Optional[Tensor]  # used as successor values only: may be None with next_values
    terminated: Tensor
    truncated: Optional[Tensor]
    last_value: Optional[Tensor]
    next_values: Optional[Tensor]
    mask: Optional[Tensor]


class Scalars(NamedTuple):
    gamma: float
    lam: float


R, V, TERM, TRUNC, LAST_V, NEXT_V, MASK = slots(Inputs)


@triton.jit
def coef(step, after):
    gamma = step.params[0]
    lam = step.params[1]
    r = load_step(step, R)
    term, cut = cut_flags(step, TERM, TRUNC)
    v_succ, _ = successor(step, V, NEXT_V, LAST_V, None, True, False, None)
    # 0 at a cut (terminations included): a select, not gamma * keep (NaN for a NaN gamma);
    # gamma (1 - keep) as gamma - beta, one select on cut (two cost 28 registers and 5 more
    # rounds of loads at 4096x128: docs/dev/ab-history.md)
    beta = tl.where(cut, 0.0, gamma * lam)
    alpha = r + tl.where(term, 0.0, (gamma - beta) * v_succ)
    return alpha, beta, 0.0


KERNEL = Kernel(coef, single_store, reverse=True, trunc_slot_always=(TERM.value, TRUNC.value))


# ---- with a mask (semantics §7): the successor is the next decision step (the kernel's W scan) ---

@triton.jit
def coef_masked(step, after):
    """w = V[t], the successor's value; with next_values w = 1 instead: the W scan then tells
    the window end (the last decision step: no decision step after it, w' = 0), where the trace
    is cut."""
    r = load_step(step, R)
    term, cut = cut_flags(step, TERM, TRUNC)
    if step.HAS_NEXT:
        w = tl.full(step.mask.shape, 1.0, tl.float32)
        nv = load_step(step, NEXT_V)
    else:
        w = load_step(step, V)
        nv = w
    return (w, (r, term, cut, nv)), 0.0, 0.0


@triton.jit
def finish_masked(step, pieces, beta, wn):
    gamma = step.params[0]
    lam = step.params[1]
    r, term, cut, nv = pieces
    if step.HAS_NEXT:
        cut = cut | (wn == 0)
        v_succ = nv
    else:
        v_succ = wn
    keep = tl.where(cut, 0.0, lam)
    return (r + tl.where(term, 0.0, gamma * (1.0 - keep) * v_succ),
            tl.where(cut, 0.0, gamma * lam))  # (a select at a cut, as `coef`'s)


@triton.jit
def boot_masked(step):
    """(G, w) past the window: last_value for both (the last decision step's G reads
    (1 - lam) v' + lam G[t+1] = last_value unless cut), or 0 with next_values."""
    last = tl.zeros(step.b1.shape, tl.float32)
    if not step.HAS_NEXT:  # (one return: Triton 3.6 checks both where rows are packed rows' steps)
        last = row_value(step, LAST_V)
    return last, last


KERNEL_MASKED = Kernel(coef_masked, single_store_masked, reverse=True, aux=True,
                       mask_slot=MASK, boot=boot_masked, finish=finish_masked)


# ---- backward: H[t] = dG[t] + gamma * keep[t-1] * H[t-1], a forward scan ---------------------

class GradInputs(NamedTuple):
    terminated: Tensor  # slot 0: the full shape in the caller's layout
    truncated: Optional[Tensor]
    values: Optional[Tensor]  # for v' (d gamma, d lam)
    last_value: Optional[Tensor]
    next_values: Optional[Tensor]
    returns: Optional[Tensor]  # G[t+1] (d gamma, d lam)
    grad_returns: Tensor


G_TERM, G_TRUNC, G_V, G_LAST_V, G_NEXT_V, G_RET, G_DRET = slots(GradInputs)
D_R, D_V, D_NEXT, D_ROWS, D_LAST = (tl.constexpr(1 << i) for i in range(5))  # VARIANT bits


@triton.jit
def grad_coef(step, after):
    mask = step.mask
    t = step.t
    gamma = step.params[0]
    lam = step.params[1]
    d_ret = load_step(step, G_DRET)
    term, cut = cut_flags(step, G_TERM, G_TRUNC)
    term_b, cut_b = flags_before(step, G_TERM, G_TRUNC, term, cut)
    first = t == 0
    beta = tl.where(cut_b | first, 0.0, gamma * lam)
    v_succ = tl.zeros(mask.shape, tl.float32)
    g_after = tl.zeros(mask.shape, tl.float32)
    if D_ROWS & step.VARIANT:
        v_succ, _ = successor(step, G_V, G_NEXT_V, G_LAST_V, None, True, False, None)
        g_after = load_at(step, G_RET, t + 1, mask & (t + 1 < step.T))
    # the weight of v'[t-1] = V[t] in G[t-1]: gamma (1 - term) (1 - keep), keep = lam (1 - cut)
    w_b = tl.where(term_b | first, 0.0, gamma * (1.0 - tl.where(cut_b, 0.0, lam)))
    return d_ret, beta, (w_b, term, cut, v_succ, g_after, t == step.T - 1)


@triton.jit
def grad_store(step, res, res_prev, aux):
    """res = H[t], res_prev = H[t-1]: the inputs' gradients at t."""
    VARIANT: tl.constexpr = step.VARIANT
    gamma = step.params[0]
    lam = step.params[1]
    w_b, term, cut, v_succ, g_after, at_end = aux
    if D_R & VARIANT:
        store_out(step, 0, res)
    if D_V & VARIANT:  # values as successors of the steps before
        store_out(step, 1, w_b * res_prev)
    keep = tl.where(cut, 0.0, lam)
    d_succ = tl.where(term, 0.0, gamma * (1.0 - keep) * res)
    if D_NEXT & VARIANT:
        store_out(step, 2, d_succ)
    if D_ROWS & VARIANT:
        # (G[t+1] is not read at a cut: a select, as keep's, so that its NaN stays out)
        store_out(step, 3, res * (tl.where(term, 0.0, (1.0 - keep) * v_succ)
                                  + tl.where(cut, 0.0, lam * g_after)))
        store_out(step, 4, res * tl.where(cut, 0.0, gamma * (g_after - v_succ)))
    if D_LAST & VARIANT:
        store_at(step, 5, step.mask & at_end, d_succ)


GRAD_KERNEL = Kernel(grad_coef, grad_store, reverse=False, exclusive=True, aux=True)


def backward(x: Inputs, outs, grads, s: Scalars, rows, call, extra, needs):
    nr, nv, _, _, nlast, nnext, nrows = needs
    (d_ret,) = grads
    if d_ret is None:
        d_ret = torch.zeros_like(outs[0])
    gx = GradInputs(x.terminated, x.truncated, x.values, x.last_value, x.next_values,
                    outs[0] if nrows else None, d_ret)
    # values[t] are successors only where next_values are not given
    nv = nv and x.next_values is None
    variant = bits(nr, nv, nnext, nrows, nlast)
    dr, dv, dnext, dg, dl, dlast = run_backward(OP.name, GRAD_KERNEL, gx, call, 5, 1, variant,
                                                s, rows, OP.row_params)
    drows = torch.stack([dg.sum(call.time_dim), dl.sum(call.time_dim)]) if nrows else None
    dv = like(dv, x.values) if nv else (torch.zeros_like(x.values) if needs[1] else None)
    return [like(dr, x.rewards) if nr else None, dv, None, None,
            like(dlast, x.last_value) if nlast else None,
            like(dnext, x.next_values) if nnext else None, drows]


def torch_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float32, packed=None):
    r, v, lv, nv = _prep(dtype, x.rewards, x.values, x.last_value, x.next_values)
    term, trunc = _flags(x.terminated, x.truncated)
    m, end = torch_scan.decisions(x.mask, r, packed)
    v_succ = torch_scan.successor(v, nv, lv, r, m, packed)
    cut = torch_scan.cut(term, trunc, end)
    keep = torch_scan.keep(cut, s.lam, dtype)  # 0 at terms too
    alpha = r + _when(~term, s.gamma * (1 - keep), v_succ)
    beta = torch_scan.keep(cut, s.gamma * s.lam, dtype)  # a select: no gradient at a cut
    out = torch_scan.zero_masked(
        torch_scan.scan(*torch_scan.masked(alpha, beta, m), reverse=True), m)
    # values unread beside next_values: a zero gradient, as the kernels give (semantics §6)
    return out if nv is None else reference.attached(out, x.values)


def loop_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float64):
    return reference.lambda_returns(**x._asdict(), **s._asdict(), dtype=dtype)


OP = ScanOp("lambda_returns", Inputs, Scalars,
            check=lambda x, td, extra, segments=None: value_args(
                x, td, values_optional=x.next_values is not None, segments=segments),
            plan=lambda x, call, out_dtype, extra: scan_plan(
                KERNEL if x.mask is None else KERNEL_MASKED, x, call, 1, out_dtype),
            masked_kernels=lambda x: True, packed_kernels=lambda x: True,
            torch=torch_impl, loop=loop_impl, row_params=2, backward=backward)


def lambda_returns(rewards, values, terminated, truncated=None, *, last_value=None,
                   next_values=None, mask=None, cu_seqlens=None, check_offsets=True,
                   gamma=0.99, lam=0.95, time_dim=0, backend="auto", out_dtype=torch.float32):
    """TD(lambda) returns. Returns the tensor `G` of lambda-returns.

    Recurrence (reverse), with v'[t] the successor value and cut[t] as in `gae`::

        G[t] = r[t] + gamma * (1 - terminated[t]) * ((1 - lam * (1 - cut[t])) * v'[t]
                                                      + lam * (1 - cut[t]) * G[t+1])

    `values` are used only as successor values: with `next_values` given, `values` may be None.
    Equal to `gae(...)[1]` (the GAE returns) for the same inputs.

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

        >>> G = rl_triton.lambda_returns(rewards, values, terminated, last_value=v_last, lam=0.9)
    """
    return OP(Inputs(rewards, values, terminated, truncated, last_value, next_values, mask),
              Scalars(check_discount("gamma", gamma), check_discount("lam", lam)),
              time_dim, backend, out_dtype, cu_seqlens=cu_seqlens, check_offsets=check_offsets)
