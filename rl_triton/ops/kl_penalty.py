"""KL penalties per position (semantics §9): Schulman's estimators k1, k2, k3 and |d|, optionally
clamped, and their straight-through "+" kinds (semantics §9); one elementwise kernel forward, one
backward."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import Call, check_backend, check_choice, check_out_dtype, check_scalar
from ..scan.jit import cdiv, tl, triton
from .._core.op import Op
from . import _losses as L

Tensor = torch.Tensor
# the kernels' KIND, in this order; "+": straight-through, the value of the kind before it and
# the gradient of d^2 / 2 (d, unclamped), verl's "k3+" (semantics §9)
KINDS = ("k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+")


class Inputs(NamedTuple):
    log_probs: Tensor
    ref_log_probs: Tensor


class Options(NamedTuple):
    kind: str
    clamp: Optional[float]
    out_dtype: torch.dtype


@triton.jit
def estimate(d, clamp, KIND: tl.constexpr, CLAMPED: tl.constexpr):
    """The estimate k(d) and dk/dd (0 where the clamp binds; d itself for the "+" kinds)."""
    d0 = d
    if KIND % 4 == 0:
        k = d
        dk = tl.full(d.shape, 1.0, tl.float32)
    elif KIND % 4 == 1:
        k = tl.abs(d)
        dk = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    elif KIND % 4 == 2:
        k = 0.5 * d * d
        dk = d
    else:
        if CLAMPED:  # k3 > clamp below d = -(clamp + 1): bounded there, exp(-d) stays finite
            low = -(tl.minimum(clamp, 80.0) + 1.0)  # (d = -inf: inf - inf would be NaN)
            d = tl.where(d < low, low, d)
        k, dk = L.k3(d)
    if CLAMPED:
        dk = tl.where(tl.abs(k) <= clamp, dk, 0.0)
        k = L.clamp(k, -clamp, clamp)
    if KIND >= 4:
        dk = d0
    return k, dk


@triton.jit
def forward_kernel(lp, ref, out, N, C, lp_r, lp_c, ref_r, ref_c, clamp, KIND: tl.constexpr,
                   CLAMPED: tl.constexpr, FLAT: tl.constexpr, INT64: tl.constexpr,
                   BLOCK: tl.constexpr):
    i, inb = L.positions(N, INT64, BLOCK)
    d = L.load(lp, i, C, lp_r, lp_c, inb, FLAT) - L.load(ref, i, C, ref_r, ref_c, inb, FLAT)
    k, _ = estimate(d, clamp, KIND, CLAMPED)
    tl.store(out + i, k.to(out.dtype.element_ty), mask=inb)


@triton.jit
def backward_kernel(lp, ref, g, d_lp, d_ref, N, C, lp_r, lp_c, ref_r, ref_c, g_r, g_c, clamp,
                    KIND: tl.constexpr, CLAMPED: tl.constexpr, D_LP: tl.constexpr,
                    D_REF: tl.constexpr, FLAT: tl.constexpr, INT64: tl.constexpr,
                    BLOCK: tl.constexpr):
    i, inb = L.positions(N, INT64, BLOCK)
    d = L.load(lp, i, C, lp_r, lp_c, inb, FLAT) - L.load(ref, i, C, ref_r, ref_c, inb, FLAT)
    _, dk = estimate(d, clamp, KIND, CLAMPED)
    grad = L.load(g, i, C, g_r, g_c, inb, FLAT) * dk
    if D_LP:
        tl.store(d_lp + i, grad.to(d_lp.dtype.element_ty), mask=inb)
    if D_REF:
        tl.store(d_ref + i, (-grad).to(d_ref.dtype.element_ty), mask=inb)


def _meta(o: Options, lay: L.Layout, N: int) -> dict:
    return dict(KIND=KINDS.index(o.kind), CLAMPED=o.clamp is not None, FLAT=lay.FLAT,
                INT64=lay.INT64, BLOCK=L.block(N), num_warps=L.NUM_WARPS)


def forward(x: Inputs, o: Options, plan=None):
    lp = x.log_probs
    out = torch.empty(lp.shape, dtype=o.out_dtype, device=lp.device)
    lay = L.layout(tuple(lp.shape), lp, x.ref_log_probs, plan=plan)
    N = lp.numel()
    meta = _meta(o, lay, N)
    L.launch(forward_kernel, cdiv(N, meta["BLOCK"]), *lay.tensors, out, N, lay.C,
             *lay.strides, 0.0 if o.clamp is None else o.clamp, **meta, plan=plan)
    return [out], []


def backward(x: Inputs, o: Options, saved, grads, needs, plan=None):
    lp, ref = x
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else None
            for t, need in zip(x, needs)]
    at = L.backward_site(plan, needs, *grads)
    lay = L.layout(tuple(lp.shape), lp, ref, grads[0], plan=at)
    N = lp.numel()
    meta = _meta(o, lay, N)
    L.launch(backward_kernel, cdiv(N, meta["BLOCK"]), *lay.tensors,
             *(lay.tensors[0] if t is None else t for t in outs), N, lay.C, *lay.strides,
             0.0 if o.clamp is None else o.clamp, D_LP=needs[0], D_REF=needs[1], **meta,
             plan=at)
    return outs


def fake(x: Inputs, o: Options):
    return [x.log_probs.new_empty(x.log_probs.shape, dtype=o.out_dtype)], []


def torch_impl(x: Inputs, o: Options, dtype):
    return (reference.kl_estimate(x.log_probs.to(dtype) - x.ref_log_probs.to(dtype), o.kind,
                                  o.clamp),)


def loop_impl(x: Inputs, o: Options, dtype):
    return (reference.kl_penalty(*x, kind=o.kind, clamp=o.clamp, dtype=dtype),)


def _check(t: tuple, a: tuple):
    """The public call's arguments checked (`kl_penalty`'s order): (inputs, plan)."""
    log_probs, ref_log_probs = t
    kind, clamp, backend, out_dtype = a
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    call = Call("log_probs", log_probs, None)
    lp = call.step("log_probs", log_probs)
    ref = call.step("ref_log_probs", ref_log_probs)
    kind = check_choice("kind", kind, KINDS)
    if clamp is not None:
        clamp = check_scalar("clamp", clamp, high=None, low_open=True)
    return Inputs(lp, ref), L.plan(call, backend, Options(kind, clamp, out_dtype))


OP = Op("kl_penalty", "loss", Inputs, Options, outputs=1, forward=forward, backward=backward,
        fake=fake, check=_check, torch=torch_impl, loop=loop_impl)


def kl_penalty(log_probs, ref_log_probs, kind="k3", clamp=None, *, backend="auto",
               out_dtype=torch.float32):
    """A per-position estimate of KL(pi || pi_ref) from log-probabilities of the sampled
    tokens (Schulman's estimators), with d = log_probs - ref_log_probs::

        "k1"   d
        "abs"  |d|
        "k2"   d^2 / 2
        "k3"   exp(-d) + d - 1

    `clamp` bounds the result to [-clamp, clamp] (OpenRLHF and verl clamp k3 to 10). Returns a
    tensor of `log_probs`' shape; differentiable with respect to both inputs (zero where the
    clamp binds). The straight-through kinds "k1+", "abs+", "k2+", "k3+" (verl's) have the value
    of the kind without "+" (clamped as it is) and the gradient of d^2 / 2, d, wherever the
    clamp binds or not: an unbiased gradient of KL(pi || pi_ref) (docs/semantics.md §9).

    Example::

        >>> kl = rl_triton.kl_penalty(log_probs, ref_log_probs, "k3", clamp=10.0)
        >>> loss = pg_loss + 0.001 * (kl * mask).sum() / mask.sum()
    """
    return OP((log_probs, ref_log_probs),
              (kind, clamp, backend, out_dtype))
