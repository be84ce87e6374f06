"""The primitive: a first-order linear recurrence, forward or reverse."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import Call, check_bool
from .._core.scan import ScanOp
from ..reference import _prep
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import (load_at, load_step, nan_beta, single_store, store_at, store_out,
                           value_before)
from ..scan.launch import Kernel
from ._common import bits, like, run_backward, scan_plan

Tensor = torch.Tensor


class Inputs(NamedTuple):
    alpha: Tensor
    beta: Tensor
    initial: Optional[Tensor]


class NoScalars(NamedTuple):
    pass


class Extras(NamedTuple):
    reverse: bool


ALPHA, BETA, INITIAL = slots(Inputs)


@triton.jit
def coef(step, after):
    alpha = load_step(step, ALPHA)
    beta = load_step(step, BETA)
    # A[t] is NaN where beta[t] is, and a cut before that step still holds
    alpha, beta = nan_beta(alpha, beta)
    return alpha, beta, 0.0


REVERSE = Kernel(coef, single_store, reverse=True)
FORWARD = Kernel(coef, single_store, reverse=False)


# ---- backward: the adjoint scan runs the other way -------------------------------------------
# reverse: H[t] = dA[t] + beta[t-1] H[t-1], d beta[t] = H[t] A[t+1] (A[T] = initial),
#          d initial = beta[T-1] H[T-1];
# forward: H[t] = dA[t] + beta[t+1] H[t+1], d beta[t] = H[t] A[t-1] (A[-1] = initial),
#          d initial = beta[0] H[0].

class GradInputs(NamedTuple):
    beta: Tensor  # slot 0: the full shape in the caller's layout
    out: Optional[Tensor]  # A (d beta)
    initial: Optional[Tensor]
    grad: Tensor


G_BETA, G_OUT, G_INIT, G_DOUT = slots(GradInputs)
# VARIANT bits
D_ALPHA, D_BETA, D_INIT, FORWARD_OP, HAS_INITIAL = (tl.constexpr(1 << i) for i in range(5))


@triton.jit
def grad_coef(step, after):
    VARIANT: tl.constexpr = step.VARIANT
    mask = step.mask
    t = step.t
    d_out = load_step(step, G_DOUT)
    beta = load_step(step, G_BETA)
    if FORWARD_OP & VARIANT:
        before = t + 1  # the step before t in the adjoint's order
        edge = t == 0  # the step that reads the initial value
        inside = mask & (before < step.T)
        beta_b = load_at(step, G_BETA, before, inside)
    else:
        before = t - 1
        edge = t == step.T - 1
        inside = mask & (before >= 0)
        beta_b = value_before(step, G_BETA, beta)
    beta_b = tl.where(inside & (beta_b == beta_b), beta_b, 0.0)  # NaN betas: as the forward
    a_other = tl.zeros(mask.shape, tl.float32)
    if D_BETA & VARIANT:
        other = 2 * t - before  # A[t+1] (reverse) or A[t-1] (forward)
        a_other = load_at(step, G_OUT, other, mask & (other >= 0) & (other < step.T))
        if HAS_INITIAL & VARIANT:  # the initial value, where `other` is outside the window
            init = load_at(step, G_INIT, 0, mask & edge)
            a_other = tl.where(edge, init, a_other)
    return d_out, beta_b, (a_other, beta, edge)


@triton.jit
def grad_store(step, res, res_prev, aux):
    VARIANT: tl.constexpr = step.VARIANT
    a_other, beta, edge = aux
    if D_ALPHA & VARIANT:
        store_out(step, 0, res)
    if D_BETA & VARIANT:
        store_out(step, 1, res * a_other)
    if D_INIT & VARIANT:
        store_at(step, 2, step.mask & edge, res * beta)


GRAD_REVERSE = Kernel(grad_coef, grad_store, reverse=False, aux=True)
GRAD_FORWARD = Kernel(grad_coef, grad_store, reverse=True, aux=True)


def backward(x: Inputs, outs, grads, s, rows, call, extra: Extras, needs):
    n_alpha, n_beta, n_init, _ = needs
    (d_out,) = grads
    if d_out is None:
        d_out = torch.zeros_like(outs[0])
    gx = GradInputs(x.beta, outs[0] if n_beta else None,
                    x.initial if n_beta else None, d_out)
    variant = bits(n_alpha, n_beta, n_init, not extra.reverse, gx.initial is not None)
    kernel = GRAD_REVERSE if extra.reverse else GRAD_FORWARD
    da, db, dinit = run_backward(OP.name, kernel, gx, call, 2, 1, variant, (0.0,), None, 0)
    return [like(da, x.alpha) if n_alpha else None, like(db, x.beta) if n_beta else None,
            like(dinit, x.initial) if n_init else None, None]


def _check(x: Inputs, time_dim, extra):
    call = Call("alpha", x.alpha, time_dim)
    return Inputs(call.step("alpha", x.alpha), call.step("beta", x.beta),
                  call.bootstrap("initial", x.initial)), call


def _torch(x: Inputs, s, extra: Extras, dtype=torch.float32):
    al, be, init = _prep(dtype, *x)
    if init is None:
        # A[T] (A[-1]) = 0 is read as the other backends read it (docs/semantics.md §2): a NaN
        # or infinite beta at the boundary step makes A NaN there (beta * 0), a zero one cuts
        init = torch.zeros_like(al[0])
    return torch_scan.scan(al, be, reverse=extra.reverse, initial=init)


OP = ScanOp("linear_scan", Inputs, NoScalars, extras=Extras, check=_check,
            plan=lambda x, call, out_dtype, extra: scan_plan(
                REVERSE if extra.reverse else FORWARD, x, call, 1, out_dtype,
                carried="initial" if x.initial is not None else None),
            kernel_scalars=lambda s: (0.0,), torch=_torch,
            loop=lambda x, s, extra, dtype: reference.linear_scan(
                x.alpha, x.beta, reverse=extra.reverse, initial=x.initial, dtype=dtype),
            backward=backward)


def linear_scan(alpha, beta, *, reverse=True, initial=None, time_dim=0, backend="auto",
                out_dtype=torch.float32):
    """The primitive: a first-order linear recurrence along `time_dim`. Returns `A`.

    ::

        reverse=True:   A[t] = alpha[t] + beta[t] * A[t+1],   A[T]  = initial (default 0)
        reverse=False:  A[t] = alpha[t] + beta[t] * A[t-1],   A[-1] = initial (default 0)

    Evaluated as an associative scan over pairs (a, b) with the combine
    `(a1, b1) then (a2, b2) -> (a2 + b2 * a1, b1 * b2)`. `alpha` and `beta` have one shape;
    `initial` has it without the time axis. Express your own estimators with it.

    Example::

        >>> # discounted reward-to-go with a fixed gamma, no episode ends
        >>> G = rl_triton.linear_scan(rewards, torch.full_like(rewards, 0.99))
    """
    return OP(Inputs(alpha, beta, initial), NoScalars(), time_dim, backend, out_dtype,
              Extras(check_bool("reverse", reverse)))
