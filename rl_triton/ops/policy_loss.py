"""The LLM frameworks' policy losses (semantics §10): verl's `POLICY_LOSS_REGISTRY`, OpenRLHF's
`PolicyLoss` and TRL's GRPO loss types, one op with their metrics and every aggregation mode.

Structure. A loss is per position given its log-ratio d; where d is a sequence's (ratio_level
"sequence", verl's gspo) torch forms it first, with its own autograd graph (a segment sum), and
the per-position formula reads it as an input. clip_cov and kl_cov pick their positions with a
batch-wide statistic (a covariance, a random draw or a top-k): torch picks them first, on every
backend, and the formula reads the pick. geo_mean is a loss per sequence (a geometric mean of the
ratios): torch on every backend. The rest is one fused kernel forward (its last program adds the
partial sums) and one backward, as ppo_policy_loss.py, with the aggregation's global factors
(verl's `dp_size`, `batch_num_tokens`, `global_batch_size`, `loss_scale_factor`) applied to the
scalar after it.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import Call, check_backend, check_bool, check_choice, check_out_dtype, check_scalar
from ..scan.jit import cdiv, tl, triton
from .._core.op import Op
from . import _losses as L

Tensor = torch.Tensor

LOSS_TYPES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo",
              "dppo_tv", "dppo_kl", "dro")
AGGREGATIONS = ("token-mean", "token-sum", "sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                "seq-mean-token-mean", "seq-mean", "none")
METRICS = ("clip_fraction", "clip_fraction_lower", "clip_fraction_negative",
           "clip_fraction_positive", "kl")
RATIO_TYPES = ("vanilla", "sapo", "cispo")  # the ones with ratio_level="sequence"
# the formula's code in the kernels
CODES = {name: i for i, name in enumerate(LOSS_TYPES)}


class Options(NamedTuple):
    loss_type: str
    ratio_level: str
    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    delta: Optional[float]
    log_ratio_clamp: Optional[float]
    tau_pos: float
    tau_neg: float
    truncation: float
    dro_beta: Optional[float]
    kl_cov_coef: float
    aggregation: str  # one of _losses' (the global factors come after), or "seq-mean" (geo_mean)
    out_dtype: torch.dtype
    check_offsets: bool = True


# ---- the per-position formula (torch) ------------------------------------------------------------

def token_terms(o: Options, x: Tensor, old: Tensor, a: Tensor, d: Tensor, sel: Optional[Tensor]):
    """(l, clip, lower, negative, positive): the per-position loss of `o.loss_type` and the flags
    its metrics average (docs/semantics.md §10), from the new and old log-probabilities `x`,
    `old`, the advantages `a`, the log-ratio `d` the ratio is formed from (clamped already) and
    the positions clip_cov / kl_cov picked (`sel`, bool)."""
    t = o.loss_type
    zero = torch.zeros_like(x, dtype=torch.bool)
    clip = lower = negative = positive = zero
    lo, hi = 1.0 - o.clip_low, 1.0 + o.clip_high
    if t == "gpg":
        return -a * x, clip, lower, negative, positive
    if t == "dro":
        return -(x * a - 0.5 * o.dro_beta * (x - old) ** 2), clip, lower, negative, positive
    if t in ("dppo_tv", "dppo_kl"):
        r = d.exp()
        truncated = r.clamp(max=o.truncation).detach()
        p, p_old = x.detach().exp(), old.detach().exp()
        if t == "dppo_tv":
            up, down = p - p_old <= o.clip_high, p - p_old >= -o.clip_low
        else:
            xd, od = x.detach(), old.detach()
            bkl = p_old * (od - xd) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8)
                                                                / (1.0 - p + 1e-8))
            up, down = (bkl <= o.clip_high) | (p <= p_old), (bkl <= o.clip_low) | (p >= p_old)
        valid = torch.where(a > 0, up, down)
        # a product with the gate, verl's: a NaN log-probability is NaN where the gate closes
        l = -a * truncated * x * valid.to(x.dtype)
        return l, ~valid, (r > o.truncation) & valid, negative, positive
    r = d.exp()
    if t == "sapo":
        tau = torch.where(a > 0, a.new_tensor(o.tau_pos), a.new_tensor(o.tau_neg))
        return -a * torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau), clip, lower, negative, positive
    negative, positive = (r < lo) & (a < 0), (r > hi) & (a > 0)
    if t == "cispo":
        rc = r.clamp(lo, hi).detach()
        # clipped where r differs from its clamp, verl's: a NaN ratio counts
        return -rc * a * x, ~((r >= lo) & (r <= hi)), lower, negative, positive
    if t == "kl_cov":
        l = -a * r
        return torch.where(sel, l + o.kl_cov_coef * d.abs(), l), clip, lower, zero, zero
    # vanilla, gspo, clip_cov: the clipped surrogate
    u = -a * (r if o.delta is None else r.clamp(max=o.delta))
    if o.delta is not None:
        positive = (r.clamp(max=o.delta) > hi) & (a > 0)
    c = -a * r.clamp(lo, hi)
    l = torch.maximum(u, c)
    clip = c > u
    if t == "clip_cov":
        return torch.where(sel, 0.0, l), sel, lower, negative, positive
    if o.dual_clip is not None:
        bound = -a * o.dual_clip
        lower = (a < 0) & (l > bound)
        l = torch.where(a < 0, torch.minimum(l, bound), l)
    return l, clip, lower, negative, positive


def clamped(d: Tensor, c: Optional[float]) -> Tensor:
    return d if c is None else d.clamp(-c, c)


# ---- sequences (torch on every backend) ----------------------------------------------------------

def seq_sum(v: Tensor, cu: Optional[Tensor]) -> Tensor:
    """Per-sequence sums of a per-position `v` (0 at masked positions already): rows of [B, T],
    or segments of packed [L]."""
    if cu is None:
        return v.sum(-1)
    return v.new_zeros(cu.shape[0] - 1).index_add(0, L.segment_ids(cu, v.shape[0]), v)


def seq_spread(s: Tensor, cu: Optional[Tensor], like: Tensor) -> Tensor:
    """A per-sequence `s` at every position of its sequence."""
    if cu is None:
        return s[:, None].expand(like.shape)
    return s[L.segment_ids(cu, like.shape[0])]


def seq_log_ratio(o: Options, x, old, m, cu):
    """The log-ratio d every position of a sequence shares: the mean over its positions that count
    of x - old (at least 1 in the count), differentiable (OpenRLHF's gspo, TRL's
    importance_sampling_level="sequence"); verl's gspo: that mean without its gradient, plus
    x - sg(x), clamped above by `log_ratio_clamp` (its gradient is the ratio's, to x alone)."""
    mf = m.to(x.dtype)
    n = seq_sum(mf, cu).clamp_min(1)
    if o.loss_type == "gspo":
        mean = seq_sum(torch.where(m, x - old, 0.0), cu).detach() / n
        d = seq_spread(mean, cu, x) + x - x.detach()
        return d if o.log_ratio_clamp is None else d.clamp(max=o.log_ratio_clamp)
    return clamped(seq_spread(seq_sum(torch.where(m, x - old, 0.0), cu) / n, cu, x),
                   o.log_ratio_clamp)


def cov_pick(o: Options, cov_ratio: float, cov_bounds: tuple, generator, x, old, a, m):
    """The positions clip_cov and kl_cov treat apart (verl 0.9.1's selection, bool, no gradient):
    with cov = (a - mean a)(x - mean x) over the n positions that count, kl_cov takes the
    max(int(n * cov_ratio), 1) largest (top-k); clip_cov draws max(int(cov_ratio * n), 1), in
    the order of `torch.randperm(K, generator=generator)`, of the K positions with
    lb < cov < ub that the PPO clip leaves unclipped (flat row-major order, as verl)."""
    with torch.no_grad():
        x, old, a = x.detach(), old.detach(), a.detach()
        flat = m.reshape(-1)
        n = int(flat.sum())
        sel = torch.zeros_like(flat)
        if n == 0:
            return sel.view(m.shape)
        if o.loss_type == "kl_cov":
            idx = flat.nonzero().squeeze(1)
            af, xf = a.reshape(-1)[idx], x.reshape(-1)[idx]
            cov = (af - af.mean()) * (xf - xf.mean())
            sel[idx[torch.topk(cov, max(1, int(n * cov_ratio)), largest=True).indices]] = True
            return sel.view(m.shape)
        ma = torch.where(m, a, 0.0).sum() / (n + 1e-8)
        mx = torch.where(m, x, 0.0).sum() / (n + 1e-8)
        cov = (a - ma) * (x - mx)
        r = clamped(x - old, o.log_ratio_clamp).exp()
        clipped = -a * r.clamp(1.0 - o.clip_low, 1.0 + o.clip_high) > -a * r
        lb, ub = cov_bounds
        candidates = ((cov < ub) & (cov > lb) & m & ~clipped).reshape(-1).nonzero().squeeze(1)
        if candidates.numel():
            # drawn where the generator lives (the CPU without one, as verl draws)
            on = "cpu" if generator is None else generator.device
            perm = torch.randperm(candidates.numel(), generator=generator, device=on).to(m.device)
            sel[candidates[perm[:min(max(int(cov_ratio * n), 1), candidates.numel())]]] = True
        return sel.view(m.shape)


def geo_mean(o: Options, x, old, a, w, m, cu, aggregation):
    """verl's geo_mean (GMPO), per sequence: R = exp(mean of the log-ratio clipped toward 0 by
    the sign of A, within [-clip_low, clip_high]), loss = -mean(A) * R (times the geometric mean
    of the weights), averaged over every sequence ("seq-mean", empty ones included as verl's
    torch.mean) or per sequence ("none"). Means divide by n + 1e-8, as verl."""
    d = clamped(x - old, o.log_ratio_clamp)
    dc = d.clamp(-o.clip_low, o.clip_high)
    sgn = torch.sign(a)
    dm = torch.where(m, sgn * torch.minimum(sgn * d, sgn * dc), 0.0)
    n = seq_sum(m.to(x.dtype), cu) + 1e-8
    l = -seq_sum(torch.where(m, a, 0.0), cu) / n * torch.exp(seq_sum(dm, cu) / n)
    if w is not None:
        l = l * torch.exp(seq_sum(torch.where(m, torch.log(w + 1e-10), 0.0), cu) / n)
    loss = l if aggregation == "none" else l.sum() / max(l.numel(), 1)
    clipped = d != dc
    zero = torch.zeros_like(m)
    return loss, (clipped & (a > 0), clipped & (a < 0), zero, zero, -d)


class Inputs(NamedTuple):
    """The public function's tensor arguments."""
    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    mask: Optional[Tensor]
    weights: Optional[Tensor]
    cu_seqlens: Optional[Tensor]


class Tensors(NamedTuple):
    """The custom op's tensors: the public ones with what the call forms from values."""
    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    mask: Optional[Tensor]
    weights: Optional[Tensor]
    log_ratio: Optional[Tensor]  # a sequence's log-ratio at each position (seq_log_ratio)
    selected: Optional[Tensor]  # clip_cov's / kl_cov's pick (cov_pick)
    cu_seqlens: Optional[Tensor]


# ---- torch and loop backends ---------------------------------------------------------------------

def torch_impl(x: Tensors, o: Options, dtype):
    """(loss, *metrics) with the aggregation `o.aggregation` of _losses (or "seq-mean" / "none"
    for geo_mean); the global factors come after."""
    aggregation = o.aggregation
    m = L.counted(x.mask)
    if m is None:
        m = torch.ones(x.log_probs.shape, dtype=torch.bool, device=x.log_probs.device)
    # a masked position's inputs enter no arithmetic: its NaN or inf would reach the gradients
    # through 0 * NaN in the backward of the aggregation's select
    lp, old, adv, w, ld = L.kept(m, dtype, *x[:3], x.weights, x.log_ratio)
    if o.loss_type == "geo_mean":
        loss, flags = geo_mean(o, lp, old, adv, w, m, x.cu_seqlens, aggregation)
    else:
        d = ld if ld is not None else clamped(lp - old, o.log_ratio_clamp)
        sel = None if x.selected is None else x.selected & m
        l, *flags = token_terms(o, lp, old, adv, d, sel)
        # the token's log-ratio, clamped where the ratio is formed from it
        kl = clamped(lp - old, None if ld is not None else o.log_ratio_clamp)
        # (a new list: torch 2.11's dynamo makes the starred target above a tuple)
        flags = [*flags, kl.abs() if o.loss_type == "kl_cov" else -kl]
        if w is not None:
            l = l * w
        loss = L.aggregate(l, m, aggregation, x.cu_seqlens)
    # (the losses that stop old's gradient still give it one, 0, as the kernels do)
    loss = reference.attached(loss, *x[:3], x.weights)
    return (loss, *(L.masked_mean(f.to(dtype).detach(), m) for f in flags))


def loop_impl(x: Tensors, o: Options, dtype):
    loss, *metrics = reference.policy_loss(*x[:4], weights=x.weights, selected=x.selected,
                                           cu_seqlens=x.cu_seqlens, dtype=dtype,
                                           **{k: getattr(o, k) for k in Options._fields[:-2]})
    # (what no step reads, no position counting or none there, still gets its gradient, 0)
    return (reference.attached(loss, *x[:3], x.weights), *metrics)


# ---- the Triton backend --------------------------------------------------------------------------

@triton.jit
def terms(x, o, a, ld, sel, clip_low, clip_high, dual_clip, delta, ratio_clamp, tau_pos,
          tau_neg, truncation, dro_beta, kl_cov_coef, LOSS: tl.constexpr, HAS_LD: tl.constexpr,
          CLAMP: tl.constexpr, DUAL: tl.constexpr, DELTA: tl.constexpr):
    """The per-position loss l of loss type LOSS (`CODES`, as `token_terms`), its derivatives by
    the log-ratio d, by x directly, by old directly and by A, the metrics' flags (clip, lower,
    negative, positive) and the kl term; `ok`: whether d's clamp passes the gradient."""
    lo = 1.0 - clip_low
    hi = 1.0 + clip_high
    raw = x - o
    d = raw
    ok = tl.full(x.shape, 1, tl.int1)
    if HAS_LD:
        d = ld
    elif CLAMP:
        d = L.clamp(raw, -ratio_clamp, ratio_clamp)
        ok = tl.abs(raw) <= ratio_clamp
    r = tl.exp(d)
    zero = tl.zeros(x.shape, tl.float32)
    no = tl.zeros(x.shape, tl.int1)
    l = zero
    dl_dd = zero
    dl_dx = zero
    dl_do = zero
    dl_da = zero
    clip = no
    lower = no
    negative = no
    positive = no
    if LOSS == 3:  # gpg
        l = -a * x
        dl_dx = -a
        dl_da = -x
    elif LOSS == 10:  # dro
        l = -(x * a - 0.5 * dro_beta * raw * raw)
        dl_dx = -a + dro_beta * raw
        dl_do = -dro_beta * raw
        dl_da = -x
    elif LOSS == 8 or LOSS == 9:  # dppo_tv, dppo_kl
        tr = L.minimum(r, zero + truncation)
        p = tl.exp(x)
        q = tl.exp(o)
        if LOSS == 8:
            up = p - q <= clip_high
            down = p - q >= -clip_low
        else:
            bkl = q * (o - x) + (1.0 - q) * tl.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
            up = (bkl <= clip_high) | (p <= q)
            down = (bkl <= clip_low) | (p >= q)
        valid = tl.where(a > 0, up, down)
        v = valid.to(tl.float32)  # a product with the gate, as `token_terms`
        l = -a * tr * x * v
        dl_dx = -a * tr * v
        dl_da = -tr * x * v
        clip = ~valid
        lower = valid & (r > truncation)
    elif LOSS == 2:  # sapo
        tau = tl.where(a > 0, tau_pos, tau_neg)
        s = tl.sigmoid(tau * (r - 1.0))
        l = -a * s * (4.0 / tau)
        dl_dd = -4.0 * a * s * (1.0 - s) * r
        dl_da = -s * (4.0 / tau)
    else:
        negative = (r < lo) & (a < 0)
        positive = (r > hi) & (a > 0)
        rc = L.clamp(r, lo, hi)
        if LOSS == 7:  # cispo
            l = -rc * a * x
            dl_dx = -rc * a
            dl_da = -rc * x
            clip = ~((r >= lo) & (r <= hi))  # (a NaN ratio counts, as `token_terms`)
        elif LOSS == 5:  # kl_cov
            sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
            l = -a * r + tl.where(sel, kl_cov_coef * tl.abs(d), 0.0)
            dl_dd = -a * r + tl.where(sel, kl_cov_coef * sign, 0.0)
            dl_da = -r
            negative = no
            positive = no
        else:  # vanilla, gspo, clip_cov: the clipped surrogate
            rr = r
            if DELTA:
                rr = L.minimum(r, zero + delta)
                positive = (rr > hi) & (a > 0)
            u = -a * rr
            c = -a * rc
            l = L.maximum(u, c)
            clip = c > u
            # the clamps pass the gradient inside their bounds, the bounds included (torch's)
            du = -a
            if DELTA:
                du = tl.where(r <= delta, du, 0.0)
            dr = L.max_grad(u, c, du, tl.where((r >= lo) & (r <= hi), -a, 0.0))
            dl_da = L.max_grad(u, c, -rr, -rc)
            if DUAL:
                neg = a < 0
                bound = -a * dual_clip
                lower = neg & (bound < l)
                dr = tl.where(neg, L.min_grad(bound, l, 0.0, dr), dr)
                dl_da = tl.where(neg, L.min_grad(bound, l, -dual_clip, dl_da), dl_da)
                l = tl.where(neg, L.minimum(bound, l), l)
            dl_dd = dr * r
            if LOSS == 4:  # clip_cov: 0 at the pick
                l = tl.where(sel, 0.0, l)
                dl_dd = tl.where(sel, 0.0, dl_dd)
                dl_da = tl.where(sel, 0.0, dl_da)
                clip = sel
    return l, dl_dd, dl_dx, dl_do, dl_da, clip, lower, negative, positive, raw, d, ok


@triton.jit
def position_terms(lp, old, adv, mask, ld, sel, N, C, lp_r, lp_c, old_r, old_c, adv_r, adv_c,
                   m_r, m_c, ld_r, ld_c, s_r, s_c, clip_low, clip_high, dual_clip, delta,
                   ratio_clamp, tau_pos, tau_neg, truncation, dro_beta, kl_cov_coef,
                   LOSS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_LD: tl.constexpr,
                   HAS_SEL: tl.constexpr, CLAMP: tl.constexpr, DUAL: tl.constexpr,
                   DELTA: tl.constexpr, FLAT: tl.constexpr, INT64: tl.constexpr,
                   BLOCK: tl.constexpr):
    """The forward's and the backward's common start: this program's positions, whether each
    counts, and `terms` of its inputs."""
    i, inb = L.positions(N, INT64, BLOCK)
    x = L.load(lp, i, C, lp_r, lp_c, inb, FLAT)
    o = L.load(old, i, C, old_r, old_c, inb, FLAT)
    a = L.load(adv, i, C, adv_r, adv_c, inb, FLAT)
    keep = L.selected(mask, i, C, m_r, m_c, inb, HAS_MASK, FLAT)
    d_in = x
    if HAS_LD:
        d_in = L.load(ld, i, C, ld_r, ld_c, inb, FLAT)
    pick = tl.zeros(x.shape, tl.int1)
    if HAS_SEL:
        pick = L.selected(sel, i, C, s_r, s_c, inb, True, FLAT)
    l, dl_dd, dl_dx, dl_do, dl_da, clip, lower, negative, positive, raw, _, ok = terms(
        x, o, a, d_in, pick, clip_low, clip_high, dual_clip, delta, ratio_clamp, tau_pos,
        tau_neg, truncation, dro_beta, kl_cov_coef, LOSS, HAS_LD, CLAMP, DUAL, DELTA)
    return i, inb, keep, l, dl_dd, dl_dx, dl_do, dl_da, clip, lower, negative, positive, raw, ok


@triton.jit
def forward_kernel(lp, old, adv, mask, wt, ld, sel, scale, cu, loss, parts, ticket, inv, m0, m1,
                   m2, m3, m4, m5, N, C, S, STEPS, lp_r, lp_c, old_r, old_c, adv_r, adv_c, m_r,
                   m_c, w_r, w_c, ld_r, ld_c, s_r, s_c, clip_low, clip_high, dual_clip, delta,
                   ratio_clamp, tau_pos, tau_neg, truncation, dro_beta, kl_cov_coef,
                   LOSS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_W: tl.constexpr,
                   HAS_LD: tl.constexpr, HAS_SEL: tl.constexpr, CLAMP: tl.constexpr,
                   DUAL: tl.constexpr, DELTA: tl.constexpr, KL_ABS: tl.constexpr,
                   SEQ: tl.constexpr, PER_POSITION: tl.constexpr, FLAT: tl.constexpr,
                   INT64: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr,
                   METRICS: tl.constexpr, MEAN: tl.constexpr, WRITE_LOSS: tl.constexpr,
                   ROWS: tl.constexpr):
    """Partial sums of this program's positions, in three [programs, 4] blocks of `parts`:
    [count, weighted loss, clip, lower], [count, 0, negative, positive], [count, 0, kl, 0],
    added by the last program (`finish_last`: each block's count is the first's, the third
    block's second column is no metric); with PER_POSITION (aggregation "none") the masked
    losses too."""
    i, inb, keep, l, dl_dd, dl_dx, dl_do, dl_da, clip, lower, negative, positive, raw, ok = \
        position_terms(lp, old, adv, mask, ld, sel, N, C, lp_r, lp_c, old_r, old_c, adv_r, adv_c,
                       m_r, m_c, ld_r, ld_c, s_r, s_c, clip_low, clip_high, dual_clip, delta,
                       ratio_clamp, tau_pos, tau_neg, truncation, dro_beta, kl_cov_coef, LOSS,
                       HAS_MASK, HAS_LD, HAS_SEL, CLAMP, DUAL, DELTA, FLAT, INT64, BLOCK)
    if HAS_W:
        l = l * L.load(wt, i, C, w_r, w_c, inb, FLAT)
    if PER_POSITION:
        tl.store(loss + i, tl.where(keep, l, 0.0).to(loss.dtype.element_ty), mask=inb)
    w = l
    if SEQ != 0:
        w = l * L.seq_weight(scale, cu, i, C, S, inb, STEPS, SEQ)
    kl = raw  # the token's log-ratio, clamped where the ratio is formed from it
    if CLAMP:
        if not HAS_LD:
            kl = L.clamp(raw, -ratio_clamp, ratio_clamp)
    if KL_ABS:
        kl = tl.abs(kl)
    else:
        kl = -kl
    count = tl.sum(keep.to(tl.float32), axis=0)
    pid = tl.program_id(0)
    a_out = parts + pid * 4
    tl.store(a_out, count)
    tl.store(a_out + 1, tl.sum(tl.where(keep, w, 0.0), axis=0))
    tl.store(a_out + 2, tl.sum((keep & clip).to(tl.float32), axis=0))
    tl.store(a_out + 3, tl.sum((keep & lower).to(tl.float32), axis=0))
    b_out = parts + (tl.num_programs(0) + pid) * 4
    tl.store(b_out, count)
    tl.store(b_out + 1, 0.0)
    tl.store(b_out + 2, tl.sum((keep & negative).to(tl.float32), axis=0))
    tl.store(b_out + 3, tl.sum((keep & positive).to(tl.float32), axis=0))
    c_out = parts + (2 * tl.num_programs(0) + pid) * 4
    tl.store(c_out, count)
    tl.store(c_out + 1, 0.0)
    tl.store(c_out + 2, tl.sum(tl.where(keep, kl, 0.0), axis=0))
    tl.store(c_out + 3, 0.0)
    L.finish_last(parts, ticket, loss, inv, m0, m1, m2, m3, m4, m5, 4, R, METRICS, MEAN,
                  WRITE_LOSS, ROWS)


@triton.jit
def backward_kernel(lp, old, adv, mask, wt, ld, sel, scale, cu, g_loss, inv, d_lp, d_old, d_adv,
                    d_w, d_ld, N, C, S, STEPS, lp_r, lp_c, old_r, old_c, adv_r, adv_c, m_r, m_c,
                    w_r, w_c, ld_r, ld_c, s_r, s_c, g_r, g_c, clip_low, clip_high, dual_clip,
                    delta, ratio_clamp, tau_pos, tau_neg, truncation, dro_beta, kl_cov_coef,
                    LOSS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_W: tl.constexpr,
                    HAS_LD: tl.constexpr, HAS_SEL: tl.constexpr, CLAMP: tl.constexpr,
                    DUAL: tl.constexpr, DELTA: tl.constexpr, SEQ: tl.constexpr,
                    PER_POSITION: tl.constexpr, MEAN: tl.constexpr, HAS_G: tl.constexpr,
                    D_LP: tl.constexpr, D_OLD: tl.constexpr, D_ADV: tl.constexpr,
                    D_W: tl.constexpr, D_LD: tl.constexpr, FLAT: tl.constexpr,
                    INT64: tl.constexpr, BLOCK: tl.constexpr):
    """With g the loss's gradient times the position's aggregation weight and w its weight:
    d x = g w (dl/dx + dl/dd) (dl/dd where the log-ratio is formed here and inside its clamp;
    else it goes to the given log-ratio), d old = g w (dl/dold - dl/dd), d A = g w dl/dA,
    d w = g l; zero where a position does not count."""
    i, inb, keep, l, dl_dd, dl_dx, dl_do, dl_da, clip, lower, negative, positive, raw, ok = \
        position_terms(lp, old, adv, mask, ld, sel, N, C, lp_r, lp_c, old_r, old_c, adv_r, adv_c,
                       m_r, m_c, ld_r, ld_c, s_r, s_c, clip_low, clip_high, dual_clip, delta,
                       ratio_clamp, tau_pos, tau_neg, truncation, dro_beta, kl_cov_coef, LOSS,
                       HAS_MASK, HAS_LD, HAS_SEL, CLAMP, DUAL, DELTA, FLAT, INT64, BLOCK)
    g = tl.zeros(l.shape, tl.float32)
    if HAS_G:
        if PER_POSITION:
            g = L.load(g_loss, i, C, g_r, g_c, inb, FLAT)
        else:
            g += tl.load(g_loss).to(tl.float32)
        if MEAN:
            g = g * tl.load(inv)
        if SEQ != 0:
            g = g * L.seq_weight(scale, cu, i, C, S, inb, STEPS, SEQ)
    g = tl.where(keep, g, 0.0)
    gw = g
    if HAS_W:
        gw = g * L.load(wt, i, C, w_r, w_c, inb, FLAT)
    dd = tl.where(keep & ok, gw * dl_dd, 0.0)
    if D_LP:
        v = gw * dl_dx
        if not HAS_LD:
            v += dd
        tl.store(d_lp + i, tl.where(keep, v, 0.0).to(d_lp.dtype.element_ty), mask=inb)
    if D_OLD:
        v = gw * dl_do
        if not HAS_LD:
            v -= dd
        tl.store(d_old + i, tl.where(keep, v, 0.0).to(d_old.dtype.element_ty), mask=inb)
    if D_ADV:
        tl.store(d_adv + i, tl.where(keep, gw * dl_da, 0.0).to(d_adv.dtype.element_ty),
                 mask=inb)
    if D_W:
        tl.store(d_w + i, tl.where(keep, g * l, 0.0).to(d_w.dtype.element_ty), mask=inb)
    if D_LD:
        tl.store(d_ld + i, dd.to(d_ld.dtype.element_ty), mask=inb)


def _scalars(o: Options) -> tuple:
    none = 0.0
    return (o.clip_low, o.clip_high, none if o.dual_clip is None else o.dual_clip,
            none if o.delta is None else o.delta,
            none if o.log_ratio_clamp is None else o.log_ratio_clamp, o.tau_pos, o.tau_neg,
            o.truncation, none if o.dro_beta is None else o.dro_beta, o.kl_cov_coef)


def _meta(x: Tensors, o: Options) -> dict:
    return dict(LOSS=CODES[o.loss_type], HAS_MASK=x.mask is not None,
                HAS_W=x.weights is not None, HAS_LD=x.log_ratio is not None,
                HAS_SEL=x.selected is not None, CLAMP=o.log_ratio_clamp is not None,
                DUAL=o.dual_clip is not None, DELTA=o.delta is not None,
                SEQ=L.seq_kind(o.aggregation, x.cu_seqlens),
                PER_POSITION=o.aggregation == "none")


def _seq(x: Tensors, o: Options):
    return L.seq_weights(o.aggregation, x.mask, x.cu_seqlens, x.log_probs)


def _fixed(x: Tensors, o: Options):
    """The forward's sizes, grid, scalars and flags (fixed by the call's signature)."""
    N, per_position = x.log_probs.numel(), o.aggregation == "none"
    bl = L.block(N)
    # (a program at least: without positions it writes zeros, and the finish runs)
    return (N, max(cdiv(N, bl), 1), tuple(x.log_probs.shape) if per_position else (),
            _scalars(o),
            dict(**_meta(x, o), KL_ABS=o.loss_type == "kl_cov", BLOCK=bl,
                 num_warps=L.NUM_WARPS,
                 **L.finish_meta(5, mean=o.aggregation == "token-mean",
                                 write_loss=not per_position)))


def forward(x: Tensors, o: Options, plan=None):
    lp = x.log_probs
    dev = lp.device
    N, programs, loss_shape, scalars, meta = L.fixed(plan, _fixed, x, o)
    seq, scale, cu, S, steps = _seq(x, o)
    loss = L.new(plan, loss_shape, o.out_dtype, dev)
    metrics = L.scalars(plan, 5, o.out_dtype, dev)  # (no gradient: one allocation)
    inv = L.new(plan, (), torch.float32, dev)  # (saved for the backward: apart)
    lay = L.layout(tuple(lp.shape), lp, x.old_log_probs, x.advantages, x.mask, x.weights,
                   x.log_ratio, x.selected, plan=plan)
    L.launch(forward_kernel, programs, *lay.tensors, scale, cu,
             *L.finish_args(loss, inv, tuple(metrics), programs, 4), N, lay.C, S, steps,
             *lay.strides, *scalars, FLAT=lay.FLAT, INT64=lay.INT64, **meta, plan=plan)
    # (no sequence weights: a placeholder, the backward reads none; eagerly `inv` itself)
    return [loss, *metrics], [inv, scale if seq else inv if plan else inv.new_empty(0)]


def backward(x: Tensors, o: Options, saved, grads, needs, plan=None):
    lp = x.log_probs
    inv, scale = saved
    g_loss = grads[0]
    n_lp, n_old, n_adv, _, n_w, n_ld = needs[:6]
    seq, scale, cu, S, steps = L.saved_seq_weights(o.aggregation, x.cu_seqlens, lp, scale)
    ins = (lp, x.old_log_probs, x.advantages, x.weights, x.log_ratio)
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) if need and t is not None
            else None for t, need in zip(ins, (n_lp, n_old, n_adv, n_w, n_ld))]
    per_position = o.aggregation == "none"
    at = L.backward_site(plan, needs, g_loss)
    lay = L.layout(tuple(lp.shape), lp, x.old_log_probs, x.advantages, x.mask, x.weights,
                   x.log_ratio, x.selected, g_loss if per_position else None, plan=at)
    N = lp.numel()
    bl = L.block(N)
    dummy = lay.tensors[0]
    g = dummy if g_loss is None else lay.tensors[7] if per_position else g_loss
    d_lp, d_old, d_adv, d_w, d_ld = outs
    L.launch(backward_kernel, cdiv(N, bl), *lay.tensors[:7], scale, cu, g, inv,
             *(dummy if t is None else t for t in outs), N, lay.C, S, steps, *lay.strides,
             *_scalars(o), **_meta(x, o), MEAN=o.aggregation == "token-mean",
             HAS_G=g_loss is not None, D_LP=d_lp is not None, D_OLD=d_old is not None,
             D_ADV=d_adv is not None, D_W=d_w is not None, D_LD=d_ld is not None,
             FLAT=lay.FLAT, INT64=lay.INT64, BLOCK=bl, num_warps=L.NUM_WARPS, plan=at)
    return [d_lp, d_old, d_adv, None, d_w, d_ld, None, None]


def fake(x: Tensors, o: Options):
    lp = x.log_probs
    shape = lp.shape if o.aggregation == "none" else ()
    outs = [lp.new_empty(shape, dtype=o.out_dtype)] + [lp.new_empty((), dtype=o.out_dtype)
                                                        for _ in range(5)]
    seq = L.seq_kind(o.aggregation, x.cu_seqlens)
    S = 0 if seq == L.NO_SEQ else lp.shape[0] if seq == L.ROWS else x.cu_seqlens.shape[0] - 1
    return outs, [lp.new_empty((), dtype=torch.float32), lp.new_empty(S, dtype=torch.float32)]


# ---- arguments and the public function -----------------------------------------------------------

def _count(name, value, device):
    """A global count or factor: a positive number, or a one-element real tensor on the data's
    `device` or the CPU (kept a tensor)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.dtype is torch.bool or value.is_complex():
            raise TypeError(f"{name} has dtype {value.dtype}; expected a real number dtype")
        if value.device != device and value.device.type != "cpu":
            raise ValueError(f"{name} is on {value.device} but the data is on {device}")
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")
        return value.reshape(())
    return check_scalar(name, value, high=None, low_open=True)


def _plan(aggregation, m, cu, shape, dp_size, batch_num_tokens, global_batch_size,
          loss_scale_factor):
    """(base, factor): the aggregation of _losses the backends run and the factor (a number, a
    tensor, or None) the loss is multiplied by after it, as verl's agg_loss (semantics §10)."""
    local = batch_num_tokens is None if aggregation == "token-mean" else global_batch_size is None
    if aggregation in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                       "seq-mean-token-mean") and local and dp_size != 1:
        need = "batch_num_tokens" if aggregation == "token-mean" else "global_batch_size"
        raise ValueError(f"aggregation={aggregation!r} with dp_size={dp_size} needs {need} (the "
                         "global count), as verl's agg_loss")
    factor = None if dp_size == 1 else float(dp_size)

    def times(f, g):
        return g if f is None else f * g

    if aggregation in ("none", "seq-mean"):
        return aggregation, None
    if aggregation in ("token-sum", "sum"):
        return "sum", factor
    if aggregation == "token-mean":
        if batch_num_tokens is None:
            return "token-mean", None
        return "sum", times(factor, 1.0 / batch_num_tokens)
    if aggregation == "seq-mean-token-mean":
        if global_batch_size is None:
            return aggregation, None
        # the mean over the S' sequences with a position that counts, times S' / global
        if cu is None:
            n_seq = m.any(-1).sum() if m is not None else shape[0] * (shape[1] > 0)
        else:
            n = seq_sum(m.to(torch.int64), cu) if m is not None else cu[1:] - cu[:-1]
            n_seq = (n > 0).sum()
        return aggregation, times(factor, n_seq / global_batch_size)
    base = "seq-mean-token-sum" if global_batch_size is None else "sum"
    if global_batch_size is not None:
        factor = times(factor, 1.0 / global_batch_size)
    if aggregation == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            if cu is not None:
                raise ValueError("aggregation='seq-mean-token-sum-norm' on packed rows needs "
                                 "loss_scale_factor (verl divides by the padded row length)")
            loss_scale_factor = shape[-1]
        factor = times(factor, 1.0 / loss_scale_factor)
    return base, factor


def check_options(loss_type, clip_low, clip_high, dual_clip, delta, log_ratio_clamp, tau_pos,
                  tau_neg, truncation, dro_beta, cov_ratio, cov_bounds, kl_cov_coef) -> tuple:
    """The loss types' scalar options checked (one place: `policy_loss` and the fused head's
    `linear_policy_loss`), returned as floats in this order."""
    clip_low = check_scalar("clip_low", clip_low, high=None)
    clip_high = clip_low if clip_high is None else check_scalar("clip_high", clip_high,
                                                                high=None)
    if dual_clip is not None:
        dual_clip = check_scalar("dual_clip", dual_clip, low=1.0, high=None, low_open=True)
    if delta is not None:
        delta = check_scalar("delta", delta, low=1.0, high=None, low_open=True)
    if log_ratio_clamp is not None:
        log_ratio_clamp = check_scalar("log_ratio_clamp", log_ratio_clamp, high=None,
                                       low_open=True)
    tau_pos = check_scalar("tau_pos", tau_pos, high=None, low_open=True)
    tau_neg = check_scalar("tau_neg", tau_neg, high=None, low_open=True)
    truncation = check_scalar("truncation", truncation, high=None, low_open=True)
    if loss_type == "dro":
        if dro_beta is None:
            raise ValueError("loss_type='dro' needs dro_beta (> 0)")
        dro_beta = check_scalar("dro_beta", dro_beta, high=None, low_open=True)
    cov_ratio = check_scalar("cov_ratio", cov_ratio, low_open=True)
    if not (isinstance(cov_bounds, (tuple, list)) and len(cov_bounds) == 2):
        raise ValueError(f"cov_bounds must be a pair (lb, ub), got {cov_bounds!r}")
    cov_bounds = tuple(check_scalar("cov_bounds", b, low=-math.inf, high=None)
                       for b in cov_bounds)
    kl_cov_coef = check_scalar("kl_cov_coef", kl_cov_coef, high=None)
    return (clip_low, clip_high, dual_clip, delta, log_ratio_clamp, tau_pos, tau_neg, truncation,
            dro_beta, cov_ratio, cov_bounds, kl_cov_coef)


class Prep(NamedTuple):
    """What a call forms from values before the kernels run (module docstring), fixed by its
    checked arguments: kept in the plan (`plan.prep`), run on every call by `_run`."""
    aggregation: str  # the call's (verl's agg_loss mode)
    seq_ratio: bool  # a log-ratio per sequence (seq_log_ratio)
    pick: bool  # clip_cov's / kl_cov's positions (cov_pick)
    cov_ratio: float
    cov_bounds: tuple
    generator: Optional[torch.Generator]
    counts: Optional[tuple]  # (dp_size, batch_num_tokens, global_batch_size,
    #                           loss_scale_factor) where a global factor applies, else None


def _check(t: tuple, a: tuple):
    """The public call's arguments checked (`policy_loss`'s order): (inputs, plan), every
    error raised here; a function of the call's signature but where a count is a tensor or a
    generator is given (objects of the call: that plan is not cached, `Plan.cache`)."""
    log_probs, old_log_probs, advantages, mask, weights, cu_seqlens = t
    (loss_type, aggregation, ratio_level, clip_low, clip_high, dual_clip, delta, log_ratio_clamp,
     tau_pos, tau_neg, truncation, dro_beta, cov_ratio, cov_bounds, kl_cov_coef, generator,
     dp_size, batch_num_tokens, global_batch_size, loss_scale_factor, check_offsets, backend,
     out_dtype) = a
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    loss_type = check_choice("loss_type", loss_type, LOSS_TYPES)
    ratio_level = check_choice("ratio_level", ratio_level, ("token", "sequence"))
    if (dual_clip is not None or delta is not None) and loss_type != "vanilla":
        raise ValueError(f"dual_clip and delta apply to loss_type='vanilla'; got "
                         f"loss_type={loss_type!r}")
    if ratio_level == "sequence" and loss_type not in RATIO_TYPES:
        raise ValueError(f"ratio_level='sequence' applies to loss_type {RATIO_TYPES}; "
                         f"{loss_type!r} has its own (use ratio_level='token')")
    agg = check_choice("aggregation", aggregation, AGGREGATIONS)
    if (loss_type == "geo_mean") != (agg in ("seq-mean", "none")) and agg != "none":
        raise ValueError(f"aggregation={agg!r} with loss_type={loss_type!r}: geo_mean's loss is "
                         "per sequence, aggregated by 'seq-mean' or 'none', and 'seq-mean' "
                         "belongs to geo_mean alone")
    call = Call("log_probs", log_probs, None)
    lp = call.step("log_probs", log_probs)
    old = call.step("old_log_probs", old_log_probs)
    adv = call.step("advantages", advantages)
    w = call.step("weights", weights, optional=True)
    check_offsets = check_bool("check_offsets", check_offsets)
    per_seq = loss_type in ("geo_mean", "gspo") or ratio_level == "sequence"
    base_check = {"token-sum": "sum", "seq-mean-token-sum-norm": "seq-mean-token-sum"}.get(
        agg, agg)
    if agg == "seq-mean" or (agg == "none" and per_seq):
        base_check = "seq-mean-token-sum"  # sequences: rows of [B, T] or segments
    _, mask, cu = L.aggregation_args(call, base_check, mask, cu_seqlens, check_offsets)
    if per_seq and cu is None and lp.ndim != 2:
        raise ValueError(f"loss_type={loss_type!r} with ratio_level={ratio_level!r} forms a "
                         "ratio per sequence, the rows of [B, T] inputs or the segments of "
                         f"cu_seqlens; log_probs has shape {tuple(lp.shape)}")
    (clip_low, clip_high, dual_clip, delta, log_ratio_clamp, tau_pos, tau_neg, truncation,
     dro_beta, cov_ratio, cov_bounds, kl_cov_coef) = check_options(
        loss_type, clip_low, clip_high, dual_clip, delta, log_ratio_clamp, tau_pos, tau_neg,
        truncation, dro_beta, cov_ratio, cov_bounds, kl_cov_coef)
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
    batch_num_tokens = _count("batch_num_tokens", batch_num_tokens, lp.device)
    global_batch_size = _count("global_batch_size", global_batch_size, lp.device)
    loss_scale_factor = _count("loss_scale_factor", loss_scale_factor, lp.device)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    seq_ratio = ratio_level == "sequence" or loss_type == "gspo"
    # the mask as bool where the global sequence count reads it (semantics §10)
    m = L.counted(mask) if global_batch_size is not None else None
    base, factor = _plan(agg, m, cu, tuple(lp.shape), dp_size, batch_num_tokens,
                         global_batch_size, loss_scale_factor)
    o = Options(loss_type, ratio_level, clip_low, clip_high, dual_clip, delta, log_ratio_clamp,
                tau_pos, tau_neg, truncation, dro_beta, kl_cov_coef, base, out_dtype,
                check_offsets)
    plan = L.plan(call, backend, o)
    if plan.backend == "triton" and loss_type == "geo_mean":
        plan.backend = "torch"  # a loss per sequence: segment sums, no kernel (module docstring)
    counts = (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    plan.prep = Prep(agg, seq_ratio, loss_type in ("clip_cov", "kl_cov"), cov_ratio, cov_bounds,
                     generator, None if factor is None else counts)
    plan.cache = generator is None and not any(isinstance(c, Tensor) for c in counts)
    return Inputs(lp, old, adv, mask, w, cu), plan


def _run(x: Inputs, plan) -> tuple:
    """A checked call: what it forms from values (the covariance picks, the sequence ratios,
    the global factor: on every call, `Prep`), then the op on its backend; (loss, metrics)."""
    o, p = plan.o, plan.prep
    lp, old, adv, mask, cu = x.log_probs, x.old_log_probs, x.advantages, x.mask, x.cu_seqlens
    ld = sel = None
    if p.seq_ratio or p.pick:
        # the mask as bool where torch reads it, all set without one; the kernels read the
        # mask as it is
        m = L.counted(mask)
        if m is None:
            m = torch.ones(lp.shape, dtype=torch.bool, device=lp.device)
        if p.pick:
            sel = cov_pick(o, p.cov_ratio, p.cov_bounds, p.generator, lp, old, adv, m)
        if p.seq_ratio and plan.backend != "loop":
            ld = seq_log_ratio(o, *L.kept(m, plan.dtype, lp, old), m, cu)
    loss, *metrics = Op.run(OP, Tensors(lp, old, adv, mask, x.weights, ld, sel, cu), plan)
    if p.counts is not None:
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor = p.counts
        m = L.counted(mask) if global_batch_size is not None else None
        _, factor = _plan(p.aggregation, m, cu, tuple(lp.shape), dp_size, batch_num_tokens,
                          global_batch_size, loss_scale_factor)
        loss = (loss * factor).to(o.out_dtype)
    return loss, dict(zip(METRICS, metrics))


# declared as an op (docs/dev/op-framework.md): its checks, custom ops, autograd and hot path
# the framework's; `_run` forms what the call reads of values before the kernels run
OP = Op("policy_loss", "loss", Inputs, Options, tensors=Tensors, outputs=6, saved=2,
        nondiff=(1, 2, 3, 4, 5), forward=forward, backward=backward, fake=fake, check=_check,
        runtime_check=L.runtime_check, torch=torch_impl, loop=loop_impl, run=_run,
        pairs=(13,))  # cov_bounds


def policy_loss(log_probs, old_log_probs, advantages, mask=None, *, loss_type="vanilla",
                aggregation="token-mean", cu_seqlens=None, weights=None, ratio_level="token",
                clip_low=0.2, clip_high=None, dual_clip=None, delta=None, log_ratio_clamp=20.0,
                tau_pos=1.0, tau_neg=1.05, truncation=20.0, dro_beta=None, cov_ratio=2e-4,
                cov_bounds=(1.0, 5.0), kl_cov_coef=1.0, generator=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None,
                check_offsets=True, backend="auto", out_dtype=torch.float32):
    """A policy loss of the LLM frameworks' zoo (docs/llm.md). Returns `(loss, metrics)`.

    Per position, with d the log-ratio (`clamp(log_probs - old_log_probs, +-log_ratio_clamp)`,
    no clamp with None; or a sequence's, below), r = exp(d), A the advantages and x the new
    log-probability, the loss l is (`loss_type`, verl's names):

    - "vanilla": `max(-A r', -A clamp(r, 1 - clip_low, 1 + clip_high))`, r' = min(r, delta)
      (TRL's two-sided clip; r without `delta`); with `dual_clip = c > 1`, `min(l, -A c)` where
      A < 0 (verl's dual clip; OpenRLHF's ppo; TRL's grpo / bnpo / dr_grpo / dapo);
    - "gspo": vanilla's without dual clip on verl's sequence ratio: d = min(the mean of the
      sequence's log-ratios, log_ratio_clamp) as a stopped gradient, plus x - sg(x);
    - "sapo": `-A sigmoid(tau (r - 1)) 4 / tau`, tau = tau_pos where A > 0, else tau_neg;
    - "gpg": `-A x` (REINFORCE; verl's bypass_mode "reinforce");
    - "clip_cov": vanilla's (no dual clip), 0 at the positions `cov_pick` draws;
    - "kl_cov": `-A r`, plus `kl_cov_coef |d|` at the top-k positions of `cov_pick`;
    - "geo_mean": per sequence (GMPO, `geo_mean`); aggregation "seq-mean" or "none";
    - "cispo": `-sg(clamp(r, 1 - clip_low, 1 + clip_high)) A x` (clip_low = inf: no lower bound);
    - "dppo_tv" / "dppo_kl": `-A sg(min(r, truncation)) x` where the probability's change (total
      variation, or binary KL) is within clip_high (A > 0) or clip_low (A <= 0), else 0;
    - "dro": `-(x A - dro_beta (x - old)^2 / 2)`.

    `ratio_level="sequence"` (vanilla, sapo, cispo: OpenRLHF's gspo, TRL's
    importance_sampling_level="sequence") forms d from the mean of the sequence's log-ratios,
    differentiable. `weights` (e.g. rollout-correction importance weights) multiply l.
    `aggregation` is verl's agg_loss: "token-mean", "token-sum" (or "sum"),
    "seq-mean-token-sum", "seq-mean-token-sum-norm" (divided by `loss_scale_factor`, default the
    row length T), "seq-mean-token-mean", or "none" (l per position, 0 where the mask is not
    set); `batch_num_tokens` / `global_batch_size` replace the local counts and `dp_size`
    multiplies, as verl's (a count the mode does not use is ignored, as verl's agg_loss does).
    Sequences are rows of [B, T] inputs or segments of `cu_seqlens`. An empty selection gives 0
    (verl's token-mean gives NaN there).

    `metrics`: a dict of 0-d tensors without gradient, means over the positions that count:
    "clip_fraction" (verl's pg_clipfrac: the positions the loss clipped, by loss type),
    "clip_fraction_lower" (verl's pg_clipfrac_lower: the dual clip binds; dppo: the truncation
    binds; geo_mean: clipped with A < 0), "clip_fraction_negative" / "clip_fraction_positive"
    (TRL's clip_ratio/low_mean and high_mean: r < 1 - clip_low with A < 0, r > 1 + clip_high
    with A > 0), "kl" (verl's ppo_kl: the mean of -d at token level; kl_cov: of |d|).
    """
    return OP((log_probs, old_log_probs, advantages, mask, weights, cu_seqlens),
              (loss_type, aggregation, ratio_level, clip_low, clip_high, dual_clip, delta,
               log_ratio_clamp, tau_pos, tau_neg, truncation, dro_beta, cov_ratio, cov_bounds,
               kl_cov_coef, generator, dp_size, batch_num_tokens, global_batch_size,
               loss_scale_factor, check_offsets, backend, out_dtype))
