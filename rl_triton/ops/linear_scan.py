"""The primitive: a first-order linear recurrence, forward or reverse."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import Call, check_bool
from .._plans import Op
from ..reference import _prep
from ..scan import torch_scan
from ..scan.jit import slots, tl, triton
from ..scan.kernel import load_step, single_store
from ..scan.launch import Kernel
from ._common import scan_plan

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
def coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
         HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
         VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
         ACT_VEC: tl.constexpr, after):
    alpha = load_step(ins, st, s1, s2, ALPHA, t, b1, b2, mask)
    beta = load_step(ins, st, s1, s2, BETA, t, b1, b2, mask)
    # A[t] is NaN where beta[t] is: as alpha NaN with beta 0, so that betas stay finite (the
    # scan's combine relies on it) and a cut before that step still holds
    nan = beta != beta
    return tl.where(nan, float("nan"), alpha), tl.where(nan, 0.0, beta), 0.0


REVERSE = Kernel(coef, single_store, reverse=True)
FORWARD = Kernel(coef, single_store, reverse=False)


def _check(x: Inputs, time_dim, extra):
    call = Call("alpha", x.alpha, time_dim)
    return Inputs(call.step("alpha", x.alpha), call.step("beta", x.beta),
                  call.bootstrap("initial", x.initial)), call


def _torch(x: Inputs, s, extra: Extras, dtype=torch.float32):
    al, be, init = _prep(dtype, *x)
    return torch_scan.scan(al, be, reverse=extra.reverse, initial=init)


OP = Op("linear_scan", Inputs, NoScalars, extras=Extras, check=_check,
        plan=lambda x, call, out_dtype, extra: scan_plan(
            REVERSE if extra.reverse else FORWARD, x, call, 1, out_dtype,
            carried="initial" if x.initial is not None else None),
        kernel_scalars=lambda s: (0.0,), torch=_torch,
        loop=lambda x, s, extra, dtype: reference.linear_scan(
            x.alpha, x.beta, reverse=extra.reverse, initial=x.initial, dtype=dtype))


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
