"""PPO's clipped surrogate (semantics §9), with its clip fraction and KL estimate: one kernel
forward (its last program adds the programs' partial sums), one backward."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import Call, check_backend, check_bool, check_clips, check_out_dtype
from ..scan.jit import cdiv, tl, triton
from .._core.op import Op
from . import _losses as L

Tensor = torch.Tensor


class Inputs(NamedTuple):
    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    mask: Optional[Tensor]
    cu_seqlens: Optional[Tensor]


class Options(NamedTuple):
    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    log_ratio_clamp: float
    aggregation: str
    out_dtype: torch.dtype
    check_offsets: bool = True


@triton.jit
def surrogate(x, o, a, clip_low, clip_high, dual_clip, ratio_clamp, DUAL: tl.constexpr):
    """l at each position, and what its gradient needs: the raw and clamped log-ratios, the
    ratio and its clip, dl/dr and dl/dA (torch.maximum's and torch.minimum's at a tie or a NaN,
    `_losses.max_grad`)."""
    raw = x - o
    d = L.clamp(raw, -ratio_clamp, ratio_clamp)
    r = tl.exp(d)
    lo = 1.0 - clip_low
    hi = 1.0 + clip_high
    rc = L.clamp(r, lo, hi)
    u = -a * r
    c = -a * rc
    l = L.maximum(u, c)
    # the clamp passes the gradient inside its bounds, the bounds included (torch's)
    dl_dr = L.max_grad(u, c, -a, tl.where((r >= lo) & (r <= hi), -a, 0.0))
    dl_da = L.max_grad(u, c, -r, -rc)
    if DUAL:
        neg = a < 0
        bound = -a * dual_clip
        dl_dr = tl.where(neg, L.min_grad(bound, l, 0.0, dl_dr), dl_dr)
        dl_da = tl.where(neg, L.min_grad(bound, l, -dual_clip, dl_da), dl_da)
        l = tl.where(neg, L.minimum(bound, l), l)
    return l, raw, d, r, rc, dl_dr, dl_da


@triton.jit
def forward_kernel(lp, old, adv, mask, scale, cu, loss, parts, ticket, inv, m0, m1, m2, m3, m4,
                   m5, N, C, S, STEPS, lp_r, lp_c, old_r, old_c, adv_r, adv_c, m_r, m_c,
                   clip_low, clip_high, dual_clip, ratio_clamp,
                   HAS_MASK: tl.constexpr, SEQ: tl.constexpr, DUAL: tl.constexpr,
                   PER_POSITION: tl.constexpr, FLAT: tl.constexpr, INT64: tl.constexpr,
                   BLOCK: tl.constexpr, R: tl.constexpr, METRICS: tl.constexpr,
                   MEAN: tl.constexpr, WRITE_LOSS: tl.constexpr, ROWS: tl.constexpr):
    """Partial sums of this program's positions: [count, weighted loss, clipped, k3], added by
    the last program (`finish_last`); with PER_POSITION (aggregation "none") the masked losses
    too."""
    i, inb = L.positions(N, INT64, BLOCK)
    x = L.load(lp, i, C, lp_r, lp_c, inb, FLAT)
    o = L.load(old, i, C, old_r, old_c, inb, FLAT)
    a = L.load(adv, i, C, adv_r, adv_c, inb, FLAT)
    keep = L.selected(mask, i, C, m_r, m_c, inb, HAS_MASK, FLAT)
    l, raw, d, r, rc, _, _ = surrogate(x, o, a, clip_low, clip_high, dual_clip, ratio_clamp,
                                       DUAL)
    if PER_POSITION:
        tl.store(loss + i, tl.where(keep, l, 0.0).to(loss.dtype.element_ty), mask=inb)
    w = l
    if SEQ != 0:
        w = l * L.seq_weight(scale, cu, i, C, S, inb, STEPS, SEQ)
    out = parts + tl.program_id(0) * 4
    tl.store(out, tl.sum(keep.to(tl.float32), axis=0))
    tl.store(out + 1, tl.sum(tl.where(keep, w, 0.0), axis=0))
    tl.store(out + 2, tl.sum((keep & (-a * rc > -a * r)).to(tl.float32), axis=0))
    tl.store(out + 3, tl.sum(tl.where(keep, L.k3(-d)[0], 0.0), axis=0))
    L.finish_last(parts, ticket, loss, inv, m0, m1, m2, m3, m4, m5, 4, R, METRICS, MEAN,
                  WRITE_LOSS, ROWS)


@triton.jit
def backward_kernel(lp, old, adv, mask, scale, cu, g_loss, g_kl, inv, d_lp, d_old, d_adv,
                    N, C, S, STEPS, lp_r, lp_c, old_r, old_c, adv_r, adv_c, m_r, m_c, g_r, g_c,
                    clip_low, clip_high, dual_clip, ratio_clamp,
                    HAS_MASK: tl.constexpr, SEQ: tl.constexpr, DUAL: tl.constexpr,
                    PER_POSITION: tl.constexpr, MEAN: tl.constexpr, HAS_G: tl.constexpr,
                    HAS_GKL: tl.constexpr, D_LP: tl.constexpr, D_OLD: tl.constexpr,
                    D_ADV: tl.constexpr, FLAT: tl.constexpr, INT64: tl.constexpr,
                    BLOCK: tl.constexpr):
    """dl/dlp = g w (dl/dr) r + g_kl inv (r - 1) where the log-ratio is inside its clamp,
    dl/dold its negative, dl/dA = g w (dl/dA), zero where a position does not count."""
    i, inb = L.positions(N, INT64, BLOCK)
    x = L.load(lp, i, C, lp_r, lp_c, inb, FLAT)
    o = L.load(old, i, C, old_r, old_c, inb, FLAT)
    a = L.load(adv, i, C, adv_r, adv_c, inb, FLAT)
    keep = L.selected(mask, i, C, m_r, m_c, inb, HAS_MASK, FLAT)
    l, raw, d, r, rc, dl_dr, dl_da = surrogate(x, o, a, clip_low, clip_high, dual_clip,
                                               ratio_clamp, DUAL)
    g = tl.zeros(x.shape, tl.float32)
    if HAS_G:
        if PER_POSITION:
            g = L.load(g_loss, i, C, g_r, g_c, inb, FLAT)
        else:
            g += tl.load(g_loss).to(tl.float32)
        if MEAN:
            g = g * tl.load(inv)
        if SEQ != 0:
            g = g * L.seq_weight(scale, cu, i, C, S, inb, STEPS, SEQ)
    dd = g * dl_dr * r
    if HAS_GKL:  # approx_kl = mean of k3(-d) = r - 1 - d: its derivative r - 1 = -k3'(-d)
        dd -= tl.load(g_kl).to(tl.float32) * tl.load(inv) * L.k3(-d)[1]
    dd = tl.where(keep & (tl.abs(raw) <= ratio_clamp), dd, 0.0)
    if D_LP:
        tl.store(d_lp + i, dd.to(d_lp.dtype.element_ty), mask=inb)
    if D_OLD:
        tl.store(d_old + i, (-dd).to(d_old.dtype.element_ty), mask=inb)
    if D_ADV:
        tl.store(d_adv + i, tl.where(keep, g * dl_da, 0.0).to(d_adv.dtype.element_ty),
                 mask=inb)


def _scalars(o: Options) -> tuple:
    return (o.clip_low, o.clip_high, 0.0 if o.dual_clip is None else o.dual_clip,
            o.log_ratio_clamp)


def _seq(x: Inputs, o: Options):
    return L.seq_weights(o.aggregation, x.mask, x.cu_seqlens, x.log_probs)


def _fixed(x: Inputs, o: Options):
    """The forward's sizes, grid, scalars and flags (fixed by the call's signature)."""
    N, per_position = x.log_probs.numel(), o.aggregation == "none"
    bl = L.block(N)
    # (a program at least: without positions it writes zeros, and the finish runs)
    return (N, max(cdiv(N, bl), 1), tuple(x.log_probs.shape) if per_position else (),
            _scalars(o),
            dict(HAS_MASK=x.mask is not None, SEQ=L.seq_kind(o.aggregation, x.cu_seqlens),
                 DUAL=o.dual_clip is not None, PER_POSITION=per_position, BLOCK=bl,
                 num_warps=L.NUM_WARPS,
                 **L.finish_meta(2, mean=o.aggregation == "token-mean",
                                 write_loss=not per_position)))


def forward(x: Inputs, o: Options, plan=None):
    lp = x.log_probs
    dev = lp.device
    N, programs, loss_shape, scalars, meta = L.fixed(plan, _fixed, x, o)
    seq, scale, cu, S, steps = _seq(x, o)
    loss = L.new(plan, loss_shape, o.out_dtype, dev)
    clip, kl = L.new(plan, (), o.out_dtype, dev), L.new(plan, (), o.out_dtype, dev)
    inv = L.new(plan, (), torch.float32, dev)
    lay = L.layout(tuple(lp.shape), lp, x.old_log_probs, x.advantages, x.mask, plan=plan)
    L.launch(forward_kernel, programs, *lay.tensors, scale, cu,
             *L.finish_args(loss, inv, (clip, kl), programs, 4), N, lay.C, S, steps,
             *lay.strides, *scalars, FLAT=lay.FLAT, INT64=lay.INT64, **meta, plan=plan)
    # (no sequence weights: a placeholder, the backward reads none; eagerly `inv` itself)
    return [loss, clip, kl], [inv, scale if seq else inv if plan else inv.new_empty(0)]


def backward(x: Inputs, o: Options, saved, grads, needs, plan=None):
    lp = x.log_probs
    inv, scale = saved
    g_loss, _, g_kl = grads
    n_lp, n_old, n_adv = needs[:3]
    seq, scale, cu, S, steps = L.saved_seq_weights(o.aggregation, x.cu_seqlens, lp, scale)
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else None
            for t, need in zip((lp, x.old_log_probs, x.advantages), (n_lp, n_old, n_adv))]
    per_position = o.aggregation == "none"
    at = L.backward_site(plan, needs, *grads)
    lay = L.layout(tuple(lp.shape), lp, x.old_log_probs, x.advantages, x.mask,
                   g_loss if per_position else None, plan=at)
    N = lp.numel()
    bl = L.block(N)
    dummy = lay.tensors[0]
    g = dummy if g_loss is None else lay.tensors[4] if per_position else g_loss
    L.launch(backward_kernel, cdiv(N, bl), *lay.tensors[:4], scale, cu, g,
             dummy if g_kl is None else g_kl, inv, *(dummy if t is None else t for t in outs),
             N, lay.C, S, steps, *lay.strides, *_scalars(o), HAS_MASK=x.mask is not None,
             SEQ=seq, DUAL=o.dual_clip is not None, PER_POSITION=per_position,
             MEAN=o.aggregation == "token-mean", HAS_G=g_loss is not None,
             HAS_GKL=g_kl is not None, D_LP=n_lp, D_OLD=n_old, D_ADV=n_adv, FLAT=lay.FLAT,
             INT64=lay.INT64, BLOCK=bl, num_warps=L.NUM_WARPS, plan=at)
    return outs + [None, None]


def fake(x: Inputs, o: Options):
    lp = x.log_probs
    shape = lp.shape if o.aggregation == "none" else ()
    outs = [lp.new_empty(shape, dtype=o.out_dtype)] + [lp.new_empty((), dtype=o.out_dtype)
                                                        for _ in range(2)]
    seq = L.seq_kind(o.aggregation, x.cu_seqlens)
    S = 0 if seq == L.NO_SEQ else lp.shape[0] if seq == L.ROWS else x.cu_seqlens.shape[0] - 1
    return outs, [lp.new_empty((), dtype=torch.float32), lp.new_empty(S, dtype=torch.float32)]


def torch_impl(x: Inputs, o: Options, dtype):
    m = L.counted(x.mask)
    # a masked position's inputs enter no arithmetic: its NaN or inf would reach the gradients
    # through 0 * NaN in the backward of the aggregation's select
    lp, old, adv = L.kept(m, dtype, *x[:3])
    d = (lp - old).clamp(-o.log_ratio_clamp, o.log_ratio_clamp)
    ratio = d.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - o.clip_low, 1 + o.clip_high)
    l = torch.maximum(unclipped, clipped)
    if o.dual_clip is not None:
        l = torch.where(adv < 0, torch.minimum(l, -adv * o.dual_clip), l)
    return (L.aggregate(l, m, o.aggregation, x.cu_seqlens),
            L.masked_mean((clipped > unclipped).to(dtype), m),
            L.masked_mean(reference.k3(-d), m))


def loop_impl(x: Inputs, o: Options, dtype):
    return reference.ppo_policy_loss(*x[:4], cu_seqlens=x.cu_seqlens, clip_low=o.clip_low,
                                     clip_high=o.clip_high, dual_clip=o.dual_clip,
                                     log_ratio_clamp=o.log_ratio_clamp,
                                     aggregation=o.aggregation, dtype=dtype)




def _check(t: tuple, a: tuple):
    """The public call's arguments checked (`ppo_policy_loss`'s order): (inputs, plan)."""
    log_probs, old_log_probs, advantages, mask, cu_seqlens = t
    (clip_low, clip_high, dual_clip, log_ratio_clamp, aggregation, check_offsets,
     backend, out_dtype) = a
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    call = Call("log_probs", log_probs, None)
    lp = call.step("log_probs", log_probs)
    old = call.step("old_log_probs", old_log_probs)
    adv = call.step("advantages", advantages)
    check_offsets = check_bool("check_offsets", check_offsets)
    aggregation, mask, cu = L.aggregation_args(call, aggregation, mask, cu_seqlens,
                                               check_offsets)
    clip_low, clip_high, dual_clip, log_ratio_clamp = check_clips(clip_low, clip_high, dual_clip,
                                                                  log_ratio_clamp)
    o = Options(clip_low, clip_high, dual_clip, log_ratio_clamp, aggregation, out_dtype,
                check_offsets)
    return Inputs(lp, old, adv, mask, cu), L.plan(call, backend, o)


OP = Op("ppo_policy_loss", "loss", Inputs, Options, outputs=3, saved=2, nondiff=(1,),
        forward=forward, backward=backward, fake=fake, check=_check,
        runtime_check=L.runtime_check, torch=torch_impl, loop=loop_impl)


def ppo_policy_loss(log_probs, old_log_probs, advantages, mask=None, *, clip_low=0.2,
                    clip_high=None, dual_clip=None, log_ratio_clamp=20.0,
                    aggregation="token-mean", cu_seqlens=None, check_offsets=True,
                    backend="auto", out_dtype=torch.float32):
    """PPO's clipped surrogate loss. Returns `(loss, clip_fraction, approx_kl)`.

    Per position, with A the advantages::

        d     = clamp(log_probs - old_log_probs, -log_ratio_clamp, log_ratio_clamp)
        ratio = exp(d)
        l     = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
        l     = min(l, -A * dual_clip)   where A < 0   (dual-clip PPO, with dual_clip = c > 1)

    `clip_high` defaults to `clip_low` (asymmetric clips: DAPO's clip-higher). `mask` (bool,
    integer or float, set where nonzero; the shape of `log_probs`) selects the positions that
    count, and `aggregation` reduces them: "token-mean" (`sum(l m) / sum(m)`),
    "seq-mean-token-sum", "seq-mean-token-mean" (the mean over sequences, with at least one
    position that counts, of each one's sum or mean; a sequence is a row of `[B, T]` inputs
    or a segment of `cu_seqlens`, FlashAttention's offsets of packed `[L]` inputs), "sum", or
    "none" (`l * m` per position). An empty selection gives 0. Offsets that do not start at 0,
    end at L, or decrease raise `ValueError`, checked on every call (one device sync where they
    are on a GPU); `check_offsets=False` skips that read (CUDA-graph capture).

    `clip_fraction` is the mean over the positions that count of those where the clipped term
    is the larger (no gradient); `approx_kl` the mean of `ratio - 1 - d`, the k3 estimate of
    KL(old || new) (differentiable: it can be added to the loss). Gradients flow to every
    floating input by the formula; every output has dtype `out_dtype`.

    Example::

        >>> loss, clip_fraction, approx_kl = rl_triton.ppo_policy_loss(
        ...     new_log_probs, old_log_probs, advantages, response_mask, clip_high=0.28)
    """
    return OP((log_probs, old_log_probs, advantages, mask, cu_seqlens),
              (clip_low, clip_high, dual_clip, log_ratio_clamp, aggregation, check_offsets,
               backend, out_dtype))
