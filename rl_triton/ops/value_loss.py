"""The value loss (semantics §9): squared or Huber error, optionally clipped around the old values;
one kernel forward (its last program adds the programs' partial sums), one backward."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import Call, check_backend, check_bool, check_choice, check_out_dtype, check_scalar
from ..scan.jit import cdiv, tl, triton
from .._core.op import Op
from . import _losses as L

Tensor = torch.Tensor
KINDS = ("mse", "huber")


class Inputs(NamedTuple):
    values: Tensor
    returns: Tensor
    old_values: Optional[Tensor]
    mask: Optional[Tensor]
    cu_seqlens: Optional[Tensor]


class Options(NamedTuple):
    clip: Optional[float]
    kind: str
    huber_delta: float
    aggregation: str
    out_dtype: torch.dtype
    check_offsets: bool = True


@triton.jit
def error(e, delta, HUBER: tl.constexpr):
    """f(e) and f'(e): 0.5 e^2, or Huber's (quadratic up to |e| = delta, linear beyond)."""
    if HUBER:
        a = tl.abs(e)
        return (tl.where(a <= delta, 0.5 * e * e, delta * (a - 0.5 * delta)),
                L.clamp(e, -delta, delta))
    return 0.5 * e * e, e


@triton.jit
def terms(v, ret, old, clip, delta, CLIPPED: tl.constexpr, HUBER: tl.constexpr):
    """l and its derivatives by V, by the returns (negated) and by the old values: of the larger
    error's, as torch.maximum's (`_losses.max_grad`); the clamp passes V's gradient inside the
    clip (a select) and old's outside it, as 1 - that (autograd's arithmetic: NaN where f' is)."""
    f, df = error(v - ret, delta, HUBER)
    l = f
    dv = df
    dr = df
    do = tl.zeros(v.shape, tl.float32)
    if CLIPPED:
        # (old - R) first: exact where old and R are close, as values far from 0 are
        fc, dfc = error((old - ret) + L.clamp(v - old, -clip, clip), delta, HUBER)
        l = L.maximum(f, fc)
        inside = tl.abs(v - old) <= clip
        dv = L.max_grad(f, fc, df, tl.where(inside, dfc, 0.0))
        dr = L.max_grad(f, fc, df, dfc)
        do = L.max_grad(f, fc, 0.0, dfc * tl.where(inside, 0.0, 1.0))
    return l, dv, dr, do


@triton.jit
def forward_kernel(values, returns, old, mask, scale, cu, loss, parts, ticket, inv, m0, m1, m2,
                   m3, m4, m5, N, C, S, STEPS, v_r, v_c, ret_r, ret_c, old_r, old_c, m_r, m_c,
                   clip, delta, CLIPPED: tl.constexpr, HUBER: tl.constexpr,
                   HAS_MASK: tl.constexpr, SEQ: tl.constexpr, PER_POSITION: tl.constexpr,
                   FLAT: tl.constexpr, INT64: tl.constexpr, BLOCK: tl.constexpr,
                   R: tl.constexpr, METRICS: tl.constexpr, MEAN: tl.constexpr,
                   WRITE_LOSS: tl.constexpr, ROWS: tl.constexpr):
    """Partial sums of this program's positions: [count, weighted loss], added by the last
    program (`finish_last`); with PER_POSITION (aggregation "none") the masked losses too."""
    i, inb = L.positions(N, INT64, BLOCK)
    v = L.load(values, i, C, v_r, v_c, inb, FLAT)
    ret = L.load(returns, i, C, ret_r, ret_c, inb, FLAT)
    o = v
    if CLIPPED:
        o = L.load(old, i, C, old_r, old_c, inb, FLAT)
    keep = L.selected(mask, i, C, m_r, m_c, inb, HAS_MASK, FLAT)
    l, _, _, _ = terms(v, ret, o, clip, delta, CLIPPED, HUBER)
    if PER_POSITION:
        tl.store(loss + i, tl.where(keep, l, 0.0).to(loss.dtype.element_ty), mask=inb)
    if SEQ != 0:
        l = l * L.seq_weight(scale, cu, i, C, S, inb, STEPS, SEQ)
    out = parts + tl.program_id(0) * 2
    tl.store(out, tl.sum(keep.to(tl.float32), axis=0))
    tl.store(out + 1, tl.sum(tl.where(keep, l, 0.0), axis=0))
    L.finish_last(parts, ticket, loss, inv, m0, m1, m2, m3, m4, m5, 2, R, METRICS, MEAN,
                  WRITE_LOSS, ROWS)


@triton.jit
def backward_kernel(values, returns, old, mask, scale, cu, g_loss, inv, d_v, d_ret, d_old,
                    N, C, S, STEPS, v_r, v_c, ret_r, ret_c, old_r, old_c, m_r, m_c, g_r, g_c,
                    clip, delta, CLIPPED: tl.constexpr, HUBER: tl.constexpr,
                    HAS_MASK: tl.constexpr, SEQ: tl.constexpr, PER_POSITION: tl.constexpr,
                    MEAN: tl.constexpr, D_V: tl.constexpr, D_RET: tl.constexpr,
                    D_OLD: tl.constexpr, FLAT: tl.constexpr, INT64: tl.constexpr,
                    BLOCK: tl.constexpr):
    """The larger error's f', times g w: to V (inside the clip, for the clipped error), to the
    returns (negated), and to the old values (outside the clip)."""
    i, inb = L.positions(N, INT64, BLOCK)
    v = L.load(values, i, C, v_r, v_c, inb, FLAT)
    ret = L.load(returns, i, C, ret_r, ret_c, inb, FLAT)
    o = v
    if CLIPPED:
        o = L.load(old, i, C, old_r, old_c, inb, FLAT)
    keep = L.selected(mask, i, C, m_r, m_c, inb, HAS_MASK, FLAT)
    l, dv, dr, do = terms(v, ret, o, clip, delta, CLIPPED, HUBER)
    if PER_POSITION:
        g = L.load(g_loss, i, C, g_r, g_c, inb, FLAT)
    else:
        g = tl.zeros(v.shape, tl.float32) + tl.load(g_loss).to(tl.float32)
    if MEAN:
        g = g * tl.load(inv)
    if SEQ != 0:
        g = g * L.seq_weight(scale, cu, i, C, S, inb, STEPS, SEQ)
    # selects after the products: a masked position's NaN or inf (in f') stays out (0 * NaN)
    if D_V:
        tl.store(d_v + i, tl.where(keep, g * dv, 0.0).to(d_v.dtype.element_ty), mask=inb)
    if D_RET:
        tl.store(d_ret + i, tl.where(keep, -g * dr, 0.0).to(d_ret.dtype.element_ty), mask=inb)
    if D_OLD:
        tl.store(d_old + i, tl.where(keep, g * do, 0.0).to(d_old.dtype.element_ty), mask=inb)


def _scalars(o: Options) -> tuple:
    return 0.0 if o.clip is None else o.clip, o.huber_delta


def _flags(x: Inputs, o: Options) -> dict:
    return dict(CLIPPED=o.clip is not None, HUBER=o.kind == "huber", HAS_MASK=x.mask is not None,
                SEQ=L.seq_kind(o.aggregation, x.cu_seqlens),
                PER_POSITION=o.aggregation == "none")


def _seq(x: Inputs, o: Options):
    """(scale, cu, S, STEPS) of the kernels' sequence weights (unused ones: any tensor)."""
    return L.seq_weights(o.aggregation, x.mask, x.cu_seqlens, x.values)[1:]


def _fixed(x: Inputs, o: Options):
    """The forward's sizes, grid, scalars and flags (fixed by the call's signature)."""
    N, per_position = x.values.numel(), o.aggregation == "none"
    bl = L.block(N)
    flags = _flags(x, o)
    # (a program at least: without positions it writes zeros, and the finish runs)
    return (N, max(cdiv(N, bl), 1), tuple(x.values.shape) if per_position else (),
            _scalars(o),
            dict(flags, BLOCK=bl, num_warps=L.NUM_WARPS,
                 **L.finish_meta(0, mean=o.aggregation == "token-mean",
                                 write_loss=not per_position)),
            flags["SEQ"] != L.NO_SEQ)


def forward(x: Inputs, o: Options, plan=None):
    v = x.values
    dev = v.device
    N, programs, loss_shape, scalars, meta, seq = L.fixed(plan, _fixed, x, o)
    scale, cu, S, steps = _seq(x, o)
    loss = L.new(plan, loss_shape, o.out_dtype, dev)
    inv = L.new(plan, (), torch.float32, dev)
    lay = L.layout(tuple(v.shape), v, x.returns, x.old_values, x.mask, plan=plan)
    L.launch(forward_kernel, programs, *lay.tensors, scale, cu,
             *L.finish_args(loss, inv, (), programs, 2), N, lay.C, S, steps, *lay.strides,
             *scalars, FLAT=lay.FLAT, INT64=lay.INT64, **meta, plan=plan)
    # (no sequence weights: a placeholder, the backward reads none; eagerly `inv` itself)
    return [loss], [inv, scale if seq else inv if plan else inv.new_empty(0)]


def backward(x: Inputs, o: Options, saved, grads, needs, plan=None):
    v = x.values
    inv, scale = saved
    (g_loss,) = grads
    n_v, n_ret, n_old = needs[:3]
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else None
            for t, need in zip((v, x.returns, x.old_values), (n_v, n_ret, n_old))]
    _, scale, cu, S, steps = L.saved_seq_weights(o.aggregation, x.cu_seqlens, v, scale)
    per_position = o.aggregation == "none"
    at = L.backward_site(plan, needs, *grads)
    lay = L.layout(tuple(v.shape), v, x.returns, x.old_values, x.mask,
                   g_loss if per_position else None, plan=at)
    N = v.numel()
    bl = L.block(N)
    dummy = lay.tensors[0]
    L.launch(backward_kernel, cdiv(N, bl), *lay.tensors[:4], scale, cu,
             lay.tensors[4] if per_position else g_loss, inv,
             *(dummy if t is None else t for t in outs), N, lay.C, S, steps, *lay.strides,
             *_scalars(o), **_flags(x, o), MEAN=o.aggregation == "token-mean", D_V=n_v,
             D_RET=n_ret, D_OLD=n_old, FLAT=lay.FLAT, INT64=lay.INT64, BLOCK=bl,
             num_warps=L.NUM_WARPS, plan=at)
    return outs + [None, None]


def fake(x: Inputs, o: Options):
    v = x.values
    seq = L.seq_kind(o.aggregation, x.cu_seqlens)
    S = 0 if seq == L.NO_SEQ else v.shape[0] if seq == L.ROWS else x.cu_seqlens.shape[0] - 1
    return ([v.new_empty(v.shape if o.aggregation == "none" else (), dtype=o.out_dtype)],
            [v.new_empty((), dtype=torch.float32), v.new_empty(S, dtype=torch.float32)])


def torch_impl(x: Inputs, o: Options, dtype):
    m = L.counted(x.mask)
    # a masked position's values enter no arithmetic: its NaN or inf would reach the
    # gradients through 0 * NaN in the backward of the aggregation's select
    v, ret, old = L.kept(m, dtype, x.values, x.returns, x.old_values)

    def error(e):
        if o.kind == "mse":
            return 0.5 * e * e
        # (torch's: f' = clamp(e, +-delta), NaN at a NaN error, +-delta at an infinite one)
        return torch.nn.functional.huber_loss(e, torch.zeros_like(e), reduction="none",
                                              delta=o.huber_delta)

    l = error(v - ret)
    if o.clip is not None:
        l = torch.maximum(l, error((old - ret) + (v - old).clamp(-o.clip, o.clip)))
    return (L.aggregate(l, m, o.aggregation, x.cu_seqlens),)


def loop_impl(x: Inputs, o: Options, dtype):
    return (reference.value_loss(*x[:4], cu_seqlens=x.cu_seqlens, clip=o.clip, kind=o.kind,
                                 huber_delta=o.huber_delta, aggregation=o.aggregation,
                                 dtype=dtype),)


def _check(t: tuple, a: tuple):
    """The public call's arguments checked (`value_loss`'s order): (inputs, plan)."""
    values, returns, old_values, mask, cu_seqlens = t
    clip, kind, huber_delta, aggregation, check_offsets, backend, out_dtype = a
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    call = Call("values", values, None)
    v = call.step("values", values)
    ret = call.step("returns", returns)
    old = call.step("old_values", old_values, optional=True)
    check_offsets = check_bool("check_offsets", check_offsets)
    aggregation, mask, cu = L.aggregation_args(call, aggregation, mask, cu_seqlens,
                                               check_offsets)
    kind = check_choice("kind", kind, KINDS)
    huber_delta = check_scalar("huber_delta", huber_delta, high=None, low_open=True)
    if clip is not None:
        clip = check_scalar("clip", clip, high=None)
        if old is None:
            raise ValueError("clip needs old_values (the values at rollout time) to clip "
                             "around")
    else:
        old = None  # unread without a clip (`Op` gives it a zero gradient)
    o = Options(clip, kind, huber_delta, aggregation, out_dtype, check_offsets)
    return Inputs(v, ret, old, mask, cu), L.plan(call, backend, o)


OP = Op("value_loss", "loss", Inputs, Options, outputs=1, saved=2, forward=forward,
        backward=backward, fake=fake, check=_check, runtime_check=L.runtime_check,
        torch=torch_impl, loop=loop_impl)


def value_loss(values, returns, old_values=None, mask=None, *, clip=None, kind="mse",
               huber_delta=1.0, aggregation="token-mean", cu_seqlens=None, check_offsets=True,
               backend="auto", out_dtype=torch.float32):
    """The value loss of predicted `values` against their targets `returns`.

    Per position, with e = values - returns::

        f(e) = 0.5 * e^2                                        kind="mse"
        f(e) = 0.5 * e^2 if |e| <= delta, else delta * (|e| - 0.5 * delta)   kind="huber"
        l    = f(values - returns)
        l    = max(l, f(old_values + clamp(values - old_values, -clip, clip) - returns))
                                                                with clip (CleanRL's, verl's)

    `old_values` (the values at rollout time) are read only with `clip`. `mask`, `aggregation`,
    `cu_seqlens` and `check_offsets` as in `ppo_policy_loss` (default: the mean over the
    positions that count).
    Gradients flow to `values`, `returns` and `old_values` by the formula.

    Example::

        >>> v_loss = rl_triton.value_loss(new_values, returns, old_values, mask, clip=0.2)
    """
    return OP((values, returns, old_values, mask, cu_seqlens),
              (clip, kind, huber_delta, aggregation, check_offsets, backend, out_dtype))
