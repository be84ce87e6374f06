"""The forward estimators: eligibility traces and episodic prefix sums, one kernel."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import FLAG, Call, check_discount
from .._core.op import OPS
from .._core.scan import ScanOp
from ..reference import _flags, _prep
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import (load_at, load_flag, load_flag_at, load_step, load_step_flag,
                           row_value, single_store, slot_offsets, store_at, store_out)
from ..scan.launch import Kernel
from ._common import bits, like, run_backward, scan_plan

Tensor = torch.Tensor


class Inputs(NamedTuple):
    x: Tensor  # [*S, *features]
    dones: Tensor  # [*S], broadcast over the feature axes
    initial: Optional[Tensor]  # [*batch, *features]
    mask: Optional[Tensor]  # [*S], broadcast over the feature axes


class TraceScalars(NamedTuple):
    gamma: float
    lam: float


class NoScalars(NamedTuple):
    pass


X, DONES, INITIAL, MASK = slots(Inputs)


@triton.jit
def coef(step, after):
    """A[t] = x[t] + keep * (1 - done[t-1]) * A[t-1]; keep = gamma * lam, or 1."""
    keep = step.params[0]
    x = load_step(step, X)
    done_before = load_flag(step.ins[DONES], slot_offsets(step, DONES, step.t - 1),
                            step.mask & (step.t >= 1))
    return x, tl.where(done_before, 0.0, keep), 0.0


KERNEL = Kernel(coef, single_store, reverse=False)


# ---- with a mask (semantics §7): t-1 is the previous decision step -------------------------------
# The scan carries Y[t] = (1 - done[t]) * A[t] instead (what the next decision step adds,
# divided by keep), so that every coefficient is the step's own: A[t] = x[t] + keep * Y[t-1].

@triton.jit
def coef_masked(step, after):
    keep = step.params[0]
    x = load_step(step, X)
    done = load_step_flag(step, DONES)
    return tl.where(done, 0.0, x), tl.where(done, 0.0, keep + tl.zeros(x.shape, tl.float32)), x


@triton.jit
def store_masked(step, res, res_prev, aux):
    keep = step.params[0]
    x, decision = aux
    z = x + tl.where(keep == 0, 0.0, keep * res_prev)  # a zero keep cuts, whatever Y holds
    store_out(step, 0, tl.where(decision, z, 0.0))


KERNEL_MASKED = Kernel(coef_masked, store_masked, reverse=False, exclusive=True, aux=True,
                       mask_slot=MASK)


# ---- packed rows (semantics §7): the scan of Y (each step's own coefficients, as with a mask),
# restarted at every segment's first step from Y = `initial` of that segment -----------------

@triton.jit
def boot_packed(step):
    """Y before a segment's first step: its `initial` (VARIANT 1), else 0 (done[-1] = 0)."""
    y = tl.zeros(step.b1.shape, tl.float32)
    if step.VARIANT == 1:
        y = row_value(step, INITIAL)
    return y, y


@triton.jit
def store_packed(step, res, res_prev, aux):
    keep = step.params[0]
    z = aux + tl.where(keep == 0, 0.0, keep * res_prev)  # as `store_masked`, every step kept
    store_out(step, 0, z)


KERNEL_PACKED = Kernel(coef_masked, store_packed, reverse=False, exclusive=True, aux=True,
                       boot=boot_packed)
KERNEL_PACKED_MASKED = Kernel(coef_masked, store_masked, reverse=False, exclusive=True,
                              aux=True, mask_slot=MASK, boot=boot_packed)


# ---- backward: H[t] = dA[t] + keep * (1 - done[t]) * H[t+1], a reverse scan ------------------

class GradInputs(NamedTuple):
    out: Tensor  # A (d keep); slot 0: the full shape in the caller's layout
    dones: Tensor
    initial: Optional[Tensor]
    grad: Tensor


G_OUT, G_DONES, G_INIT, G_DOUT = slots(GradInputs)
D_X, D_INIT, D_ROWS, HAS_INITIAL = (tl.constexpr(1 << i) for i in range(4))  # VARIANT bits


@triton.jit
def grad_coef(step, after):
    VARIANT: tl.constexpr = step.VARIANT
    mask = step.mask
    t = step.t
    keep = step.params[0]
    d_out = load_step(step, G_DOUT)
    done = load_step_flag(step, G_DONES)
    beta = tl.where(done | (t == step.T - 1), 0.0, keep)
    a_before = tl.zeros(mask.shape, tl.float32)
    first = t == 0
    if D_ROWS & VARIANT:  # (1 - done[t-1]) A[t-1], the initial value at t = 0
        before = mask & (t >= 1)
        done_b = load_flag_at(step, G_DONES, t - 1, before)
        a_before = tl.where(done_b, 0.0, load_at(step, G_OUT, t - 1, before))
        if HAS_INITIAL & VARIANT:
            init = load_at(step, G_INIT, 0, mask & first)
            a_before = tl.where(first, init, a_before)
    return d_out, beta, (a_before, first)


@triton.jit
def grad_store(step, res, res_prev, aux):
    VARIANT: tl.constexpr = step.VARIANT
    keep = step.params[0]
    a_before, first = aux
    if D_X & VARIANT:
        store_out(step, 0, res)
    if D_ROWS & VARIANT:
        store_out(step, 1, res * a_before)
    if D_INIT & VARIANT:
        store_at(step, 2, step.mask & first, keep * res)


GRAD_KERNEL = Kernel(grad_coef, grad_store, reverse=True, aux=True)


def _backward(op_name: str, row_params: int):
    def backward(x: Inputs, outs, grads, s, rows, call, extra, needs):
        n_x, _, n_init, n_rows = needs
        (d_out,) = grads
        if d_out is None:
            d_out = torch.zeros_like(outs[0])
        gx = GradInputs(outs[0], x.dones, x.initial if n_rows else None, d_out)
        variant = bits(n_x, n_init, n_rows, gx.initial is not None)
        dx, dk, dinit = run_backward(op_name, GRAD_KERNEL, gx, call, 2, 1, variant,
                                     OPS[op_name].kernel_scalars(s), rows, row_params,
                                     expand_flags="dones", copy=_grad_copy)
        return [like(dx, x.x) if n_x else None, None, like(dinit, x.initial) if n_init else None,
                dk.sum(call.time_dim)[None] if n_rows else None]
    return backward


def _grad_copy(x: GradInputs):
    d = x.dones[(...,) + (None,) * (x.out.ndim - x.dones.ndim)].expand(x.out.shape)
    return GradInputs(*(None if t is None else t.contiguous() for t in (x.out, d, x.initial,
                                                                         x.grad)))


def _scan_torch(xs, dones, mask, init, scale, packed=None):
    """z[t] = x[t] + scale * (1 - done[t-1]) * z[t-1], done[-1] = 0, the flags (and the mask)
    broadcast over x's feature axes; with a mask, t-1 is the previous decision step. Packed
    rows restart at each segment's first decision step from its `initial` (`init` per step)."""
    tail = (1,) * (xs.ndim - dones.ndim)
    d = dones.reshape(dones.shape + tail)
    m, _ = torch_scan.decisions(mask, xs)
    if m is not None:
        d = d.expand(xs.shape)
    before = torch_scan.shift_down(d, torch.zeros_like(d[0]), m)
    if init is None:
        # z[-1] = 0 is read as the other backends read it: scale * 0 (NaN for a non-finite
        # per-row discount)
        init = torch.zeros_like(xs if packed is not None else xs[0])
    if packed is not None:
        starts = packed.starts.reshape(packed.starts.shape + tail)
        before = before | starts
        # z = x + scale * initial there (a zero scale cuts, a select, whose d scale is still
        # the product's: reference._trace)
        xs = xs + reference._trace(~starts, scale, init)
        init = None
    z = torch_scan.scan(*torch_scan.masked(xs, torch_scan.keep(before, scale, xs.dtype), m),
                        reverse=False, initial=init)
    return torch_scan.zero_masked(z, m)


def _check(x: Inputs, time_dim, extra, segments=None):
    call = Call("dones", x.dones, time_dim, kind=FLAG, segments=segments)
    trailing = max(0, x.x.ndim - x.dones.ndim) if isinstance(x.x, Tensor) else 0
    xs = call.step("x", x.x, trailing=trailing)
    d = call.step("dones", x.dones, FLAG)
    init = call.bootstrap("initial", x.initial, trailing_shape=tuple(xs.shape[xs.ndim - trailing:]))
    return Inputs(xs, d, init, call.step("mask", x.mask, FLAG, optional=True)), call


def _plan(x, call, out_dtype, extra):
    if call.segments is not None:  # packed rows: `initial` is read per segment, not carried
        return scan_plan(KERNEL_PACKED if x.mask is None else KERNEL_PACKED_MASKED, x, call, 1,
                         out_dtype, variant=int(x.initial is not None), expand_flags="dones")
    return scan_plan(KERNEL if x.mask is None else KERNEL_MASKED, x, call, 1, out_dtype,
                     carried="initial" if x.initial is not None else None, expand_flags="dones")


def _copy(x: Inputs):
    """The flags materialized over the feature axes, so that one stride group describes them."""
    d = x.dones[(...,) + (None,) * (x.x.ndim - x.dones.ndim)].expand(x.x.shape)
    m = None if x.mask is None else x.mask[(...,) + (None,) * (x.x.ndim - x.mask.ndim)]
    return Inputs(x.x.contiguous(), d.contiguous(),
                  None if x.initial is None else x.initial.contiguous(),
                  None if m is None else m.expand(x.x.shape).contiguous())


def _traces_torch(x: Inputs, s: TraceScalars, extra=(), dtype=torch.float32, packed=None):
    xs, init = _prep(dtype, x.x, x.initial)
    (d,) = _flags(x.dones)
    return _scan_torch(xs, d, x.mask, init, s.gamma * s.lam, packed)


def _cumsum_torch(x: Inputs, s: NoScalars, extra=(), dtype=torch.float32, packed=None):
    xs, init = _prep(dtype, x.x, x.initial)
    (d,) = _flags(x.dones)
    return _scan_torch(xs, d, x.mask, init, 1.0, packed)


TRACES = ScanOp("eligibility_traces", Inputs, TraceScalars, check=_check, plan=_plan, copy=_copy,
                kernel_scalars=lambda s: (s.gamma * s.lam,), torch=_traces_torch, row_params=1,
                masked_kernels=lambda x: True, packed_kernels=lambda x: True,
                loop=lambda x, s, extra, dtype: reference.eligibility_traces(
                    *x[:2], initial=x.initial, mask=x.mask, **s._asdict(), dtype=dtype),
                backward=_backward("eligibility_traces", 1))
CUMSUM = ScanOp("episodic_cumsum", Inputs, NoScalars, check=_check, plan=_plan, copy=_copy,
                kernel_scalars=lambda s: (1.0,), torch=_cumsum_torch, masked_kernels=lambda x: True,
                packed_kernels=lambda x: True,
                loop=lambda x, s, extra, dtype: reference.episodic_cumsum(
                    *x[:2], initial=x.initial, mask=x.mask, dtype=dtype),
                backward=_backward("episodic_cumsum", 0))


def eligibility_traces(x, dones, *, gamma, lam, initial=None, mask=None, cu_seqlens=None,
                       check_offsets=True, time_dim=0, backend="auto", out_dtype=torch.float32):
    """Accumulating eligibility traces (forward in time). Returns `z`, shaped like `x`.

    ::

        z[t] = x[t] + gamma * lam * (1 - done[t-1]) * z[t-1],   z[-1] = initial (default 0),
                                                                done[-1] = 0

    `x` has the shape of `dones` followed by any trailing feature axes (traces of vectors, e.g.
    gradients); the flags broadcast over them. `done[t]` marks the last step of an episode, so
    the trace restarts at t+1. `time_dim` refers to `dones` (negative counts from its end).

    `mask` (semantics §7; the shape of `dones`, broadcast over the feature axes): the decision
    steps. The state passes masked steps unchanged, t-1 reads "the previous decision step", and
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

        >>> z = rl_triton.eligibility_traces(grads, dones, gamma=0.99, lam=0.9)  # grads [T, N, D]
    """
    return TRACES(Inputs(x, dones, initial, mask),
                  TraceScalars(check_discount("gamma", gamma), check_discount("lam", lam)),
                  time_dim, backend, out_dtype, cu_seqlens=cu_seqlens, check_offsets=check_offsets)


def episodic_cumsum(x, dones, *, initial=None, mask=None, cu_seqlens=None, check_offsets=True,
                    time_dim=0, backend="auto", out_dtype=torch.float32):
    """Prefix sums that restart after every episode end (forward in time). Returns `C`.

    ::

        C[t] = x[t] + (1 - done[t-1]) * C[t-1],   C[-1] = initial (default 0),   done[-1] = 0

    `done[t]` marks the last step of an episode (as everywhere in rl_triton), so the sum restarts
    at t+1. `x` may carry trailing feature axes; `time_dim` refers to `dones`.

    `mask` (semantics §7; the shape of `dones`, broadcast over the feature axes): the decision
    steps. The state passes masked steps unchanged, t-1 reads "the previous decision step", and
    outputs at masked steps are 0.
    `cu_seqlens` (semantics §7; integers [S + 1], FlashAttention's convention): packed rows. The
    per-step tensors are `[L, ...]` (time on axis 0), each segment [cu[i], cu[i+1]) a row of its
    own whose last step is a window end; bootstraps are `[S, ...]`. Combines with `mask`.
    Per-step tensors may carry batch axes after the packed one (`[L, N]`, `initial`
    `[S, N]`). The offsets must
    start at 0, end at L and never decrease (else `ValueError`), checked on every call: free
    on CPU offsets, one device sync on CUDA ones, which `check_offsets=False` skips (for
    CUDA-graph capture; whatever the offsets hold, nothing is read outside the tensors).

    Example::

        >>> episode_return_so_far = rl_triton.episodic_cumsum(rewards, dones)
    """
    return CUMSUM(Inputs(x, dones, initial, mask), NoScalars(), time_dim, backend, out_dtype,
                  cu_seqlens=cu_seqlens, check_offsets=check_offsets)
