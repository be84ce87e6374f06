"""GAE: generalized advantage estimation."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import check_discount
from .._core.scan import ScanOp
from ..reference import _flags, _prep, _when
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import (cut_flags, finish_linear, flags_before, load_at, load_step, row_value,
                           store_at, store_out, successor)
from ..scan.launch import Kernel
from ._common import bits, like, run_backward, scan_plan, value_args

Tensor = torch.Tensor


class Inputs(NamedTuple):
    rewards: Tensor
    values: Tensor
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
    """alpha = delta[t], beta = gamma * lam where the trace goes on; aux: values[t]."""
    gamma = step.params[0]
    lam = step.params[1]
    r = load_step(step, R)
    v = load_step(step, V)
    term, cut = cut_flags(step, TERM, TRUNC)
    v_succ, _ = successor(step, V, NEXT_V, LAST_V, v, True, False, after)
    alpha = r + tl.where(term, 0.0, gamma * v_succ) - v
    beta = tl.where(cut, 0.0, gamma * lam)
    return alpha, beta, v


@triton.jit
def store(step, res, res_prev, aux):
    store_out(step, 0, res)  # advantages
    store_out(step, 1, res + aux)  # returns = A + V


KERNEL = Kernel(coef, store, reverse=True, aux=True)


# ---- with a mask (semantics §7): the successor is the next decision step (the kernel's W scan) ---

@triton.jit
def coef_masked(step, after):
    """w = V[t] (what the decision step before bootstraps from); alpha = (r - V) + c * w' with
    c = gamma (0 at a termination), or with next_values c = 0 and gamma v' in a."""
    gamma = step.params[0]
    lam = step.params[1]
    r = load_step(step, R)
    v = load_step(step, V)
    term, cut = cut_flags(step, TERM, TRUNC)
    a = r - v
    if step.HAS_NEXT:
        a += tl.where(term, 0.0, gamma * load_step(step, NEXT_V))
        c = tl.zeros(step.mask.shape, tl.float32)
    else:
        c = tl.where(term, 0.0, gamma + tl.zeros(step.mask.shape, tl.float32))
    # the window end (the last decision step) needs no cut of its own: A past it is 0
    return (v, (a, c)), tl.where(cut, 0.0, gamma * lam), v


@triton.jit
def boot_masked(step):
    """(A, w) past the window: 0, and last_value (the last decision step's successor)."""
    w = tl.zeros(step.b1.shape, tl.float32)
    if step.HAS_LAST:
        w = row_value(step, LAST_V)
    return tl.zeros(step.b1.shape, tl.float32), w


@triton.jit
def store_masked(step, res, res_prev, aux):
    v, keep, _ = aux
    store_out(step, 0, tl.where(keep, res, 0.0))
    store_out(step, 1, tl.where(keep, res + v, 0.0))


KERNEL_MASKED = Kernel(coef_masked, store_masked, reverse=True, aux=True, mask_slot=MASK,
                       boot=boot_masked, finish=finish_linear)


# ---- backward: H[t] = dA[t] + gamma * lam * (1 - cut[t-1]) * H[t-1], a forward scan ----------

class GradInputs(NamedTuple):
    terminated: Tensor  # slot 0: the full shape in the caller's layout
    truncated: Optional[Tensor]
    values: Optional[Tensor]  # for v' (d gamma)
    last_value: Optional[Tensor]
    next_values: Optional[Tensor]
    advantages: Optional[Tensor]  # A[t+1] (d gamma, d lam)
    grad_advantages: Optional[Tensor]
    grad_returns: Optional[Tensor]


G_TERM, G_TRUNC, G_V, G_LAST_V, G_NEXT_V, G_ADV, G_DADV, G_DRET = slots(GradInputs)
# VARIANT bits: gradients written, and the outputs' gradients given
D_R, D_V, D_NEXT, D_ROWS, D_LAST, HAS_DADV, HAS_DRET, SLOT_SUCC = (
    tl.constexpr(1 << i) for i in range(8))


@triton.jit
def grad_coef(step, after):
    """alpha = dA[t] = d advantages[t] + d returns[t]; beta = gamma * lam where the trace from
    t-1 went on (0 at t = 0)."""
    gamma = step.params[0]
    lam = step.params[1]
    t = step.t
    mask = step.mask
    VARIANT: tl.constexpr = step.VARIANT
    d_ret = tl.zeros(mask.shape, tl.float32)
    d_a = tl.zeros(mask.shape, tl.float32)
    if HAS_DRET & VARIANT:
        d_ret = load_step(step, G_DRET)
    if HAS_DADV & VARIANT:
        d_a = load_step(step, G_DADV)
    term, cut = cut_flags(step, G_TERM, G_TRUNC)
    term_b, cut_b = flags_before(step, G_TERM, G_TRUNC, term, cut)
    beta = tl.where(cut_b | (t == 0), 0.0, gamma * lam)
    v_succ = tl.zeros(mask.shape, tl.float32)
    a_after = tl.zeros(mask.shape, tl.float32)
    if D_ROWS & VARIANT:
        v_succ, _ = successor(step, G_V, G_NEXT_V, G_LAST_V, None, True, False, None)
        a_after = load_at(step, G_ADV, t + 1, mask & (t + 1 < step.T))
    return d_a + d_ret, beta, (d_ret, term_b | (t == 0), term, cut, v_succ, a_after,
                               t == step.T - 1)


@triton.jit
def grad_store(step, res, res_prev, aux):
    """res = H[t] = d delta[t], res_prev = H[t-1]: the inputs' gradients at t."""
    gamma = step.params[0]
    lam = step.params[1]
    VARIANT: tl.constexpr = step.VARIANT
    d_ret, term_b, term, cut, v_succ, a_after, at_end = aux
    if D_R & VARIANT:
        store_out(step, 0, res)
    if D_V & VARIANT:  # returns = A + V; delta[t] has -V[t]; delta[t-1] has gamma v'[t-1]
        dv = d_ret - res
        if SLOT_SUCC & VARIANT:  # v'[t-1] = V[t] (no next_values)
            dv += tl.where(term_b, 0.0, gamma * res_prev)
        store_out(step, 1, dv)
    d_succ = tl.where(term, 0.0, gamma * res)
    if D_NEXT & VARIANT:
        store_out(step, 2, d_succ)
    if D_ROWS & VARIANT:
        store_out(step, 3, res * (tl.where(term, 0.0, v_succ) + tl.where(cut, 0.0, lam * a_after)))
        store_out(step, 4, res * tl.where(cut, 0.0, gamma * a_after))
    if D_LAST & VARIANT:
        store_at(step, 5, step.mask & at_end, d_succ)


GRAD_KERNEL = Kernel(grad_coef, grad_store, reverse=False, exclusive=True, aux=True)


def backward(x: Inputs, outs, grads, s: Scalars, rows, call, extra, needs):
    nr, nv, _, _, nlast, nnext, nrows = needs
    d_adv, d_ret = grads
    gx = GradInputs(x.terminated, x.truncated, x.values, x.last_value, x.next_values,
                    outs[0] if nrows else None, d_adv, d_ret)
    variant = bits(nr, nv, nnext, nrows, nlast, d_adv is not None, d_ret is not None,
                   x.next_values is None)
    dr, dv, dnext, dg, dl, dlast = run_backward(OP.name, GRAD_KERNEL, gx, call, 5, 1, variant,
                                                s, rows, OP.row_params)
    drows = torch.stack([dg.sum(call.time_dim), dl.sum(call.time_dim)]) if nrows else None
    return [like(dr, x.rewards) if nr else None, like(dv, x.values) if nv else None, None, None,
            like(dlast, x.last_value) if nlast else None,
            like(dnext, x.next_values) if nnext else None, drows]


def torch_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float32, packed=None):
    r, v, lv, nv = _prep(dtype, x.rewards, x.values, x.last_value, x.next_values)
    term, trunc = _flags(x.terminated, x.truncated)
    m, end = torch_scan.decisions(x.mask, r, packed)
    v_succ = torch_scan.successor(v, nv, lv, r, m, packed)
    alpha = r + _when(~term, s.gamma, v_succ) - v
    beta = torch_scan.keep(torch_scan.cut(term, trunc, end), s.gamma * s.lam, dtype)
    adv = torch_scan.scan(*torch_scan.masked(alpha, beta, m), reverse=True)
    return torch_scan.zero_masked(adv, m), torch_scan.zero_masked(adv + v, m)


def loop_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float64):
    return reference.gae(**x._asdict(), **s._asdict(), dtype=dtype)


OP = ScanOp("gae", Inputs, Scalars, outputs=2,
            check=lambda x, td, extra, segments=None: value_args(x, td, segments=segments),
            plan=lambda x, call, out_dtype, extra: scan_plan(
                KERNEL if x.mask is None else KERNEL_MASKED, x, call, 2, out_dtype),
            torch=torch_impl, loop=loop_impl, row_params=2,
            backward=backward, masked_kernels=lambda x: True, packed_kernels=lambda x: True)


def gae(rewards, values, terminated, truncated=None, *, last_value=None, next_values=None,
        mask=None, cu_seqlens=None, check_offsets=True, gamma=0.99, lam=0.95, time_dim=0,
        backend="auto", out_dtype=torch.float32):
    """Generalized Advantage Estimation. Returns `(advantages, returns)`.

    Recurrence (reverse in time), with v'[t] the successor value and cut[t] = terminated[t] or
    truncated[t] or t == T-1::

        delta[t] = r[t] + gamma * (1 - terminated[t]) * v'[t] - V[t]
        A[t]     = delta[t] + gamma * lam * (1 - cut[t]) * A[t+1]
        returns  = A + V

    Boundaries: a termination drops v'[t]; a truncation keeps v'[t] (the value of the state the
    episode was cut at) and stops the trace; the last step of the window bootstraps from
    `last_value` (or `next_values[T-1]`) and stops the trace.

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

        >>> T, N = 128, 8
        >>> rewards, values = torch.randn(T, N), torch.randn(T, N)
        >>> terminated = torch.rand(T, N) < 0.01
        >>> adv, ret = rl_triton.gae(rewards, values, terminated, last_value=torch.randn(N))
    """
    return OP(Inputs(rewards, values, terminated, truncated, last_value, next_values, mask),
              Scalars(check_discount("gamma", gamma), check_discount("lam", lam)),
              time_dim, backend, out_dtype, cu_seqlens=cu_seqlens, check_offsets=check_offsets)
