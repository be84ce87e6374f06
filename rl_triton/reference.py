"""Sequential references: the readable definition of every estimator.

Each function is the plain loop of the specification (the recurrences in the docstrings of
`rl_triton.estimators`), written to be checked by eye against the formulas.
They take time-major tensors (`[T, *batch]`, time on axis 0) and compute in `dtype`: float64 in
the tests, float32 as the library's `backend="loop"`. Flags are read as `flag != 0`, whatever
their dtype, and every flag (and every zero coefficient of the recurrence) is a select, never a
multiplication by zero: a NaN or inf reaches only the outputs whose formula uses it, and never
the steps before a termination or truncation (`(1 - term) * v'` below is `where(term, 0, v')`).

Notation: g = gamma, l = lambda, v'[t] the successor value (`next_values[t]` if given, else
`values[t+1]`, and `last_value` at t = T-1), cut[t] = done[t] or t == T-1.

With a `mask` (semantics §7) only the decision steps (mask set) count, as if the others were
deleted: "t+1" reads "the next decision step", "t-1" the previous one, and the window end is each
row's last decision step; outputs at masked steps are 0. Each loop below keeps, per row, what the
next (or previous) decision step left: its value, its output, its flags.

The losses (semantics §9) have no recurrence: each is its per-position formula, written out by
cases, and the aggregation over positions, one sequence at a time.
"""
from __future__ import annotations

import math

import torch


def _exp(v: float) -> float:
    """math.exp with torch's value past the double's range (inf), not OverflowError."""
    try:
        return math.exp(v)
    except OverflowError:
        return math.inf


def _log(v: float) -> float:
    """math.log with torch's values at 0 (-inf) and below it or at NaN (NaN), not ValueError."""
    return math.log(v) if v > 0 else -math.inf if v == 0 else math.nan


def _prep(dtype, *xs):
    """Cast values to `dtype` (None stays None)."""
    return [None if x is None else x.to(dtype) for x in xs]


def _flags(*xs):
    """Flags (bool / int / float) as bool: set wherever nonzero (None stays None)."""
    return [None if x is None else x != 0 for x in xs]


def _decisions(mask, like):
    """(m, end) as bool tensors of `like`'s shape: m[t] the decision steps (every step without a
    mask; a mask broadcasts over trailing feature axes), end[t] each row's window end: its last
    decision step (t = T-1 without a mask)."""
    if mask is None:
        m = torch.ones(like.shape, dtype=torch.bool, device=like.device)
    else:
        m = mask != 0
        m = m.reshape(m.shape + (1,) * (like.ndim - m.ndim)).expand(like.shape)
    later = m.flip(0).cumsum(0).flip(0)  # decision steps at or after t
    return m, m & (later == 1)


def _cut(terminated, truncated, t, end):
    """cut[t] = done[t] or t is the window end (bool)."""
    done = terminated[t] if truncated is None else terminated[t] | truncated[t]
    return done | end[t]


def _trace(cut, coef, later):
    """coef * later where the trace goes on, and 0 where it is cut (`cut` set, or coef 0),
    whatever `later` holds: a select, not a multiplication by zero (0 * inf is NaN), so that
    nothing after a cut reaches the steps before it. `cut`, `coef`: bools / numbers or tensors.
    A tensor coef's gradient is the product's, `later`, also where coef is 0 (gamma = 0,
    lam = 0: semantics §6), and none at a cut (`_Trace`)."""
    if isinstance(coef, torch.Tensor) and coef.requires_grad and torch.is_grad_enabled():
        return _Trace.apply(coef, later, torch.as_tensor(cut, device=later.device))
    stop = cut | (coef == 0)
    if not isinstance(stop, torch.Tensor):
        return torch.zeros_like(later) if stop else coef * later
    return torch.where(stop, 0.0, coef * later)


class _Trace(torch.autograd.Function):
    """`_trace` of a coefficient that needs its gradient: autograd through the select would
    give d coef = 0 where coef = 0, where the formula's derivative is `later`."""

    @staticmethod
    def forward(ctx, coef, later, cut):
        ctx.save_for_backward(coef, later, cut)
        return torch.where(cut | (coef == 0), 0.0, coef * later)

    @staticmethod
    def backward(ctx, grad):
        coef, later, cut = ctx.saved_tensors
        d_coef = torch.where(cut, 0.0, grad * later).sum_to_size(coef.shape)
        d_later = torch.where(cut | (coef == 0), 0.0, grad * coef).sum_to_size(later.shape)
        return d_coef, d_later, None


def _when(keep, coef, x):
    """coef * x where `keep`, and 0 elsewhere: a select, whose dropped x (an inf or NaN
    successor past a termination) reaches neither the value nor coef's gradient (a plain
    `where(keep, coef * x, 0)` passes coef 0 * x, NaN there)."""
    return torch.where(keep, coef * torch.where(keep, x, 0.0), 0.0)


def _successor(next_values, last_value, t, end, v_next):
    """v'[t]: next_values[t], else `v_next` (the value of the next decision step), and
    last_value at the window end; zero where nothing is given (only discounted_returns allows
    that)."""
    if next_values is not None:
        return next_values[t]
    last = last_value if last_value is not None else torch.zeros_like(v_next)
    return torch.where(end[t], last, v_next)


def _decided(m, *xs, fill=0.0):
    """`xs` with `fill` at the masked steps (`m`: the decision steps, broadcast over trailing
    axes; None stays None): what a masked step holds enters no arithmetic, so that a NaN or inf
    there reaches no gradient (0 * NaN in the backward of a product that a select dropped)."""
    if m is None:
        return list(xs)
    return [None if x is None else torch.where(m.reshape(m.shape + (1,) * (x.ndim - m.ndim)),
                                               x, fill) for x in xs]


def _kept(m, new, old):
    """The state after step t: `new` at decision steps, `old` carried through masked ones."""
    return torch.where(m, new, old)


def gae(rewards, values, terminated, truncated=None, *, last_value=None, next_values=None,
        mask=None, gamma=0.99, lam=0.95, dtype=torch.float64):
    r, v, lv, nv = _prep(dtype, rewards, values, last_value, next_values)
    term, trunc = _flags(terminated, truncated)
    m, end = _decisions(mask, r)
    adv = torch.zeros_like(r)
    ret = torch.zeros_like(r)
    a_next = torch.zeros_like(r[0])
    v_next = torch.zeros_like(r[0])
    for t in reversed(range(r.shape[0])):
        v_succ = _successor(nv, lv, t, end, v_next)
        delta = r[t] + _when(~term[t], gamma, v_succ) - v[t]
        a = delta + _trace(_cut(term, trunc, t, end), gamma * lam, a_next)
        adv[t] = torch.where(m[t], a, 0.0)
        ret[t] = torch.where(m[t], a + v[t], 0.0)
        a_next, v_next = _kept(m[t], a, a_next), _kept(m[t], v[t], v_next)
    return adv, ret


def lambda_returns(rewards, values, terminated, truncated=None, *, last_value=None,
                   next_values=None, mask=None, gamma=0.99, lam=0.95, dtype=torch.float64):
    r, v, lv, nv = _prep(dtype, rewards, values, last_value, next_values)
    term, trunc = _flags(terminated, truncated)
    m, end = _decisions(mask, r)
    ret = torch.zeros_like(r)
    g_next = torch.zeros_like(r[0])
    v_next = torch.zeros_like(r[0])
    for t in reversed(range(r.shape[0])):
        v_succ = _successor(nv, lv, t, end, v_next)
        cut = _cut(term, trunc, t, end)
        # G[t] = r + g (1 - term) (1 - l (1 - cut)) v' + g l (1 - cut) G[t+1]  (cut includes term)
        keep = torch.where(cut, 0.0, lam * torch.ones_like(r[t]))  # lam: a number or per row
        g = (r[t] + _when(~term[t], gamma * (1 - keep), v_succ)
             + _trace(cut, gamma * lam, g_next))
        ret[t] = torch.where(m[t], g, 0.0)
        g_next = _kept(m[t], g, g_next)
        if v is not None:
            v_next = _kept(m[t], v[t], v_next)
    return ret


def discounted_returns(rewards, terminated, truncated=None, *, last_value=None, next_values=None,
                       mask=None, gamma=0.99, dtype=torch.float64):
    r, lv, nv = _prep(dtype, rewards, last_value, next_values)
    term, trunc = _flags(terminated, truncated)
    m, end = _decisions(mask, r)
    ret = torch.zeros_like(r)
    g_next = torch.zeros_like(r[0])
    for t in reversed(range(r.shape[0])):
        v_succ = _successor(nv, lv, t, end, torch.zeros_like(r[0]))  # no values: 0 inside
        cut = _cut(term, trunc, t, end)
        # G[t] = r + g (1 - term) cut v' + g (1 - cut) G[t+1]  (cut includes term)
        g = r[t] + _when(cut & ~term[t], gamma, v_succ) + _trace(cut, gamma, g_next)
        ret[t] = torch.where(m[t], g, 0.0)
        g_next = _kept(m[t], g, g_next)
    return ret


def vtrace(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated=None, *,
           last_value=None, next_values=None, mask=None, gamma=0.99, lam=1.0, rho_clip=1.0,
           c_clip=1.0, pg_rho_clip=1.0, dtype=torch.float64):
    r, v, tlp, blp, lv, nv = _prep(dtype, rewards, values, target_log_probs, behavior_log_probs,
                                   last_value, next_values)
    term, trunc = _flags(terminated, truncated)
    m, end = _decisions(mask, r)
    r, v, tlp, blp, nv = _decided(m, r, v, tlp, blp, nv)
    vs = torch.zeros_like(r)
    pg = torch.zeros_like(r)
    d_next = torch.zeros_like(r[0])
    v_next = torch.zeros_like(r[0])
    vs_next = torch.zeros_like(r[0])
    for t in reversed(range(r.shape[0])):
        v_succ = _successor(nv, lv, t, end, v_next)
        cut = _cut(term, trunc, t, end)
        ratio = torch.exp(tlp[t] - blp[t])
        rho = torch.clamp(ratio, max=rho_clip)  # a NaN ratio stays NaN
        c = _when(~cut, lam, torch.clamp(ratio, max=c_clip))  # (not read at a cut)
        # vs'[t]: vs[t+1] inside the episode and window, v'[t] at a cut.
        vs_succ = torch.where(cut, v_succ, vs_next)
        # (both successors dropped after a termination: nothing of them reaches d lam there)
        boot = _when(~term[t], lam, vs_succ) + _when(~term[t], 1 - lam, v_succ)
        p = torch.clamp(ratio, max=pg_rho_clip) * (
            r[t] + _when(~term[t], gamma, boot) - v[t])
        delta = rho * (r[t] + _when(~term[t], gamma, v_succ) - v[t])
        d = delta + _trace(cut, gamma * c, d_next)
        vs[t] = torch.where(m[t], v[t] + d, 0.0)
        pg[t] = torch.where(m[t], p, 0.0)
        d_next, v_next = _kept(m[t], d, d_next), _kept(m[t], v[t], v_next)
        vs_next = _kept(m[t], v[t] + d, vs_next)
    return vs, pg


def retrace(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated=None,
            *, last_q_values=None, last_target_probs=None, mask=None, gamma=0.99, lam=1.0,
            c_clip=1.0, dtype=torch.float64):
    """Returns (G, G - Q(s_t, a_t)). q_values / target_probs: [T, *batch, A]; actions: [T, *batch]."""
    r, q, pi, mu, lq, lpi = _prep(dtype, rewards, q_values, target_probs, behavior_probs,
                                  last_q_values, last_target_probs)
    term, trunc = _flags(terminated, truncated)
    m, end = _decisions(mask, r)
    r, q, pi = _decided(m, r, q, pi)
    (mu,) = _decided(m, mu, fill=1.0)  # pi / mu stays finite
    a = torch.where(m, actions.long(), 0).unsqueeze(-1)  # masked steps' actions: ignored
    G = torch.zeros_like(r)
    diff = torch.zeros_like(r)
    g_next = e_next = c_next = q_next_a = torch.zeros_like(r[0])  # of the next decision step
    # (formed once: one formed per step and dropped by the select below would give an infinite
    # bootstrap Q-value 0 * inf = NaN gradients)
    e_last = (lpi * lq).sum(-1)
    for t in reversed(range(r.shape[0])):
        # E[t], c[t+1], Q(s_{t+1}, a_{t+1}) from the next decision step, or from the bootstrap
        # state s_T at the window end (where the trace is cut: no c, no Q')
        expected = torch.where(end[t], e_last, e_next)
        cut = _cut(term, trunc, t, end)
        # G[t] = r + g (1 - term) (E - (1 - cut) c Q') + g (1 - cut) c G[t+1]  (cut includes term)
        boot = expected - _when(~cut, c_next, q_next_a)
        g = (r[t] + _when(~term[t], gamma, boot)
             + _trace(cut, _when(~cut, gamma, c_next), g_next))
        q_a = q[t].gather(-1, a[t]).squeeze(-1)
        G[t] = torch.where(m[t], g, 0.0)
        diff[t] = torch.where(m[t], g - q_a, 0.0)
        c_own = lam * torch.clamp(pi[t].gather(-1, a[t]).squeeze(-1) / mu[t], max=c_clip)
        g_next, q_next_a = _kept(m[t], g, g_next), _kept(m[t], q_a, q_next_a)
        e_next = _kept(m[t], (pi[t] * q[t]).sum(-1), e_next)
        c_next = _kept(m[t], c_own, c_next)
    return G, diff


def eligibility_traces(x, dones, *, initial=None, mask=None, gamma, lam, dtype=torch.float64):
    """x: [T, *batch, *features]; dones (and mask): [T, *batch], broadcast over the features."""
    return _forward(x, dones, initial, mask, gamma * lam, dtype)


def episodic_cumsum(x, dones, *, initial=None, mask=None, dtype=torch.float64):
    """x: [T, *batch, *features]; dones (and mask): [T, *batch], broadcast over the features."""
    return _forward(x, dones, initial, mask, 1.0, dtype)


def _forward(x, dones, initial, mask, keep, dtype):
    """z[t] = x[t] + keep * (1 - done[t-1]) * z[t-1], z[-1] = initial, done[-1] = 0."""
    xs, init = _prep(dtype, x, initial)
    (d,) = _flags(dones)
    d = d.reshape(d.shape + (1,) * (xs.ndim - d.ndim)).expand(xs.shape)
    m, _ = _decisions(mask, xs)
    z = torch.zeros_like(xs)
    z_prev = init if init is not None else torch.zeros_like(xs[0])
    d_prev = torch.zeros_like(d[0])  # done at the previous decision step
    for t in range(xs.shape[0]):
        zt = xs[t] + _trace(d_prev, keep, z_prev)
        z[t] = torch.where(m[t], zt, 0.0)
        z_prev, d_prev = _kept(m[t], zt, z_prev), _kept(m[t], d[t], d_prev)
    return z


def linear_scan(alpha, beta, *, reverse=True, initial=None, dtype=torch.float64):
    al, be, init = _prep(dtype, alpha, beta, initial)
    T = al.shape[0]
    out = torch.zeros_like(al)
    acc = init if init is not None else torch.zeros_like(al[0])
    for t in (reversed(range(T)) if reverse else range(T)):
        acc = al[t] + _trace(False, be[t], acc)  # beta = 0: A[t] = alpha[t], whatever follows
        out[t] = acc
    return out


def group_advantages(scores, ids, *, baseline="mean", scale="std", eps=1e-6, std_correction=1,
                     dtype=torch.float64):
    """Group-relative advantages (semantics §8), one group at a time; `ids`: each score's group."""
    s = scores.to(dtype)
    if s.numel() == 0:
        return s.clone()  # (a function of the scores: no input silently detached)
    out = torch.empty_like(s)
    batch_sigma = None
    if scale == "batch_std":  # (shifted by the first score, as below)
        batch_sigma = torch.std(s - (s[0].detach() if s[0].isfinite() else 0),
                                correction=std_correction)
    for g in torch.unique(ids):
        at = ids == g
        x = s[at]
        n = x.shape[0]
        if n == 1:  # a group of one: baseline 0, scale 1
            out[at] = x
            continue
        if x[0].isfinite():  # (a shift the baseline cancels: the digits of a large mean)
            x = x - x[0].detach()
        base = x.mean() if baseline == "mean" else (x.sum() - x) / (n - 1)
        a = x - base
        if scale == "std":
            a = a / (torch.std(x, correction=std_correction) + eps)
        elif scale == "batch_std":
            a = a / (batch_sigma + eps)
        out[at] = a
    return out


def masked_whiten(x, mask, *, shift_mean=True, eps=1e-8, std_correction=1, dtype=torch.float64):
    """(x - mean) * rsqrt(var + eps) over the positions where `mask` is set (semantics §8), in
    float64 whatever `dtype` (the result's): a float32 mean and sum of squares lose the digits
    that |mean| >> std cancels. Fewer than 1 + std_correction positions set: NaN there."""
    xs = torch.where(mask, x.to(torch.float64), 0.0)  # a masked position enters no arithmetic
    kept = xs[mask]
    n = kept.numel()
    mean = kept.sum() / max(n, 1)
    var = ((kept - mean) ** 2).sum() / max(n - std_correction, 1)
    if n <= std_correction:
        var = torch.full_like(var, torch.nan)
    out = (xs - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, 0.0).to(dtype)


# ---- losses (semantics §9): each position's formula, and the aggregation sequence by sequence ----

def _aggregate(l, keep, aggregation, cu_seqlens=None):
    """Per-position losses `l` over the positions `keep` (bool): "none" (l where kept, else 0),
    "sum", "token-mean", or the mean over sequences (rows of a [B, T] `l`, or the segments of
    `cu_seqlens`) with any position kept of each one's sum ("seq-mean-token-sum") or mean
    ("seq-mean-token-mean"). An empty selection gives 0."""
    kept = torch.where(keep, l, 0.0)
    if aggregation == "none":
        return kept
    if aggregation == "sum":
        return kept.sum()
    if aggregation == "token-mean":
        return kept.sum() / max(int(keep.sum()), 1)
    if cu_seqlens is None:
        sequences = [slice(b, b + 1) for b in range(l.shape[0])]
    else:
        cu = cu_seqlens.tolist()
        sequences = [slice(a, b) for a, b in zip(cu[:-1], cu[1:])]
    per_sequence = []
    for s in sequences:
        n = int(keep[s].sum())
        if n > 0:
            total = kept[s].sum()
            per_sequence.append(total / n if aggregation == "seq-mean-token-mean" else total)
    if not per_sequence:
        return kept.sum()  # 0, and still a function of l
    return sum(per_sequence) / len(per_sequence)


def _selected(mask, like):
    return torch.ones(like.shape, dtype=torch.bool, device=like.device) if mask is None \
        else mask != 0


def ppo_policy_loss(log_probs, old_log_probs, advantages, mask=None, *, cu_seqlens=None,
                    clip_low=0.2, clip_high=None, dual_clip=None, log_ratio_clamp=20.0,
                    aggregation="token-mean", dtype=torch.float64):
    """(loss, clip_fraction, approx_kl): the clipped surrogate as written, max(-A r, -A clip(r))
    and, with a dual clip c, its min with -A c where A < 0 (torch.maximum's and torch.minimum's
    gradient at a tie: half to each side, as the frameworks')."""
    lp, old, adv = _prep(dtype, log_probs, old_log_probs, advantages)
    keep = _selected(mask, lp)
    lp, old, adv = _decided(keep, lp, old, adv)  # a masked position enters no arithmetic
    high = clip_low if clip_high is None else clip_high
    d = torch.clamp(lp - old, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(d)
    unclipped = -adv * ratio
    clipped_term = -adv * torch.clamp(ratio, 1 - clip_low, 1 + high)
    l = torch.maximum(unclipped, clipped_term)
    if dual_clip is not None:
        l = torch.where(adv < 0, torch.minimum(-adv * dual_clip, l), l)
    clipped = clipped_term > unclipped
    n = max(int(keep.sum()), 1)
    return (_aggregate(l, keep, aggregation, cu_seqlens),
            torch.where(keep, clipped.to(dtype), 0.0).sum() / n,
            torch.where(keep, k3(-d), 0.0).sum() / n)


def value_loss(values, returns, old_values=None, mask=None, *, cu_seqlens=None, clip=None,
               kind="mse", huber_delta=1.0, aggregation="token-mean", dtype=torch.float64):
    v, ret, old = _prep(dtype, values, returns, old_values)
    keep = _selected(mask, v)
    v, ret, old = _decided(keep, v, ret, old)  # a masked position enters no arithmetic

    def error(e):  # 0.5 e^2, or Huber's: quadratic up to |e| = delta, linear beyond
        if kind == "mse":
            return 0.5 * e * e
        # (torch's: f' = clamp(e, +-delta), NaN at a NaN error, +-delta at an infinite one)
        return torch.nn.functional.huber_loss(e, torch.zeros_like(e), reduction="none",
                                              delta=huber_delta)

    l = error(v - ret)
    if clip is not None:
        l = torch.maximum(l, error((old - ret) + torch.clamp(v - old, -clip, clip)))
    return _aggregate(l, keep, aggregation, cu_seqlens)


def kl_bounds(kind, clamp):
    """(low, high): log-ratios d beyond which k(d) is beyond the clamp c, whatever d holds there
    (+-inf included): d is clamped to them first, so that the clamp's zero gradient never
    multiplies an infinite derivative (0 * inf) and exp(-d) stays finite (k3 is above c below
    d = -(c + 1), and so is its exp there up to c = 80)."""
    if kind == "k2":
        return -((2 * clamp) ** 0.5 + 1), (2 * clamp) ** 0.5 + 1
    if kind == "k3":
        return -(min(clamp, 80.0) + 1), clamp + 1
    return -(clamp + 1), clamp + 1


class _StraightThrough(torch.autograd.Function):
    """`value` (no gradient of its own) with the gradient of d^2 / 2, which is d: no arithmetic
    on d forward, so that an infinite d leaves the value as it is (the clamp's)."""

    @staticmethod
    def forward(value, d):
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        return None, g * ctx.saved_tensors[0]


class _Attached(torch.autograd.Function):
    """`x`, with `others` in its graph: each gets a zero gradient."""

    @staticmethod
    def forward(x, *others):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.likes = [(t.shape, t.dtype, t.device) for t in inputs[1:]]

    @staticmethod
    def backward(ctx, g):
        return (g, *[torch.zeros(s, dtype=dt, device=dev) for s, dt, dev in ctx.likes])


def attached(x, *others):
    """`x`, with the tensors of `others` that require grad in its graph (a zero gradient each):
    an input whose gradient a formula stops (gspo's, cispo's old log-probabilities) is not
    silently detached (semantics §6)."""
    others = [t for t in others if isinstance(t, torch.Tensor) and t.requires_grad]
    return _Attached.apply(x, *others) if others and torch.is_grad_enabled() else x


def straight_through(value, d):
    """`value`'s value, with the gradient of d^2 / 2 (d): the "+" kinds of `kl_penalty`."""
    return _StraightThrough.apply(value.detach(), d)


def k3(x):
    """exp(-x) + x - 1, Schulman's k3 of the log-ratio x, to x's precision near 0 as well:
    formed in float64 (in float32, exp(-x) - 1 keeps only ~|x| of its digits there: 4% off
    at |x| = 1e-3; docs/semantics.md §9). Its gradient, 1 - exp(-x), alike."""
    x64 = x.to(torch.float64)
    return ((torch.exp(-x64) - 1) + x64).to(x.dtype)


def kl_estimate(d, kind, clamp=None):
    """The KL estimate `kind` (`kl_penalty`'s) of log-ratios d, clamped to +-clamp where given;
    the torch backends' arithmetic, in d's dtype (k3 in the kernel's order)."""
    base = kind.rstrip("+")
    k = d
    if clamp is not None:
        # beyond these k is clamped (gradient 0) either way; bounding d keeps the derivatives
        # that 0 multiplies finite (an infinite log-ratio's, exp(-d)'s): 0 * inf is NaN
        k = d.clamp(*kl_bounds(base, clamp))  # a NaN stays NaN
    if base == "abs":
        k = k.abs()
    elif base == "k2":
        k = 0.5 * k * k
    elif base == "k3":
        k = k3(k)
    if clamp is not None:
        k = torch.clamp(k, -clamp, clamp)
    return straight_through(k, d) if kind.endswith("+") else k


def kl_penalty(log_probs, ref_log_probs, kind="k3", clamp=None, dtype=torch.float64):
    lp, ref = _prep(dtype, log_probs, ref_log_probs)
    return kl_estimate(lp - ref, kind, clamp)


def sac_targets(rewards, terminated, next_q_values, next_log_probs, *, gamma=0.99, alpha=0.2,
                next_probs=None, dtype=torch.float64):
    """One critic and one action at a time: the smallest of the K target critics, less
    alpha * log pi, at the sampled action (continuous) or in expectation over the A actions
    (discrete, `next_probs` given)."""
    r, q, logp, p = _prep(dtype, rewards, next_q_values, next_log_probs, next_probs)
    (term,) = _flags(terminated)
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(dtype).reshape(())
    # a terminal step's next state, and an action of probability 0, enter no arithmetic (they
    # add 0, whatever they hold: -inf log-probabilities of invalid actions included)
    live = ~term
    if p is not None:
        (p,) = _decided(live, p)
        live = p != 0
    q, logp = _decided(live, q, logp)

    def soft_value(q_a, logp_a):  # q_a [..., K]
        smallest = q_a[..., 0]
        for k in range(1, q_a.shape[-1]):  # the first of tied critics (its gradient), or NaN
            smallest = torch.where((q_a[..., k] < smallest) | q_a[..., k].isnan(), q_a[..., k],
                                   smallest)
        return smallest - alpha * logp_a

    if p is None:
        v = soft_value(q, logp)
    else:
        v = torch.zeros_like(r)
        for a in range(p.shape[-1]):
            v = v + p[..., a] * soft_value(q[..., a, :], logp[..., a])
    return r + torch.where(term, 0.0, gamma * v)


def crr_weights(q_values, sampled_q_values, *, beta=1.0, kind="exp", max_weight=20.0,
                baseline="mean", dtype=torch.float64):
    q, sampled = _prep(dtype, q_values, sampled_q_values)
    base = sampled[..., 0]
    for j in range(1, sampled.shape[-1]):
        base = base + sampled[..., j] if baseline == "mean" else torch.maximum(base,
                                                                              sampled[..., j])
    if baseline == "mean":
        base = base / sampled.shape[-1]
    adv = q - base
    if kind == "exp":
        return torch.clamp(torch.exp(adv / beta), max=max_weight)
    return torch.where(torch.isnan(adv), adv, (adv > 0).to(dtype))  # NaN stays NaN


# ---- the fused loss head (semantics §11): the unfused composition, logits and all ---------------

def token_log_probs(hidden, weight, labels, *, bias=None, temperature=1.0, ignore_index=-100,
                    dtype=torch.float64):
    """(log_probs, entropy) of `labels` under softmax(hidden @ weight.T / temperature + bias),
    the whole [N, V] logits at once; 0 where a label is ignore_index."""
    h, w, b = _prep(dtype, hidden, weight, bias)
    keep = labels != ignore_index
    h = torch.where(keep[..., None], h, 0.0)  # an ignored token's state enters no arithmetic
    logits = h @ w.T / temperature
    if b is not None:
        logits = logits + b
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)  # a -inf logit has p = 0: adds 0
    lp = logp.gather(-1, torch.where(keep, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, lp, 0.0), torch.where(keep, entropy, 0.0)


def linear_policy_loss(hidden, weight, labels, old_log_probs, advantages, keep, *,
                       ref_log_probs=None, kl_coef=0.0, kl_kind="k3", kl_clamp=None,
                       entropy_coef=0.0, temperature=1.0, bias=None, ignore_index=-100,
                       loss_type="vanilla", aggregation="token-mean", cu_seqlens=None,
                       shape=None, selected=None, dtype=torch.float64, **options):
    """(loss, metrics) of `policy_loss`'s `loss_type` (its options in `options`, clip_high
    given; "grpo", "bnpo", "dapo" and "ppo" are "vanilla") on these log-probabilities, plus kl_coef * KL against
    ref_log_probs minus entropy_coef * entropy per token, aggregated over the tokens `keep`
    (bool [N]: mask set and label not ignore_index) by `aggregation` (geo_mean's policy term:
    its own mean over sequences); sequences are the rows of `shape` ([B, T]) or the segments of
    cu_seqlens. Flat [N] per-token inputs; `selected`: clip_cov's / kl_cov's pick, given."""
    lp, ent = token_log_probs(hidden, weight, labels, bias=bias, temperature=temperature,
                              ignore_index=ignore_index, dtype=dtype)
    rows = shape is not None and len(shape) == 2 and cu_seqlens is None

    def shaped(x):
        return None if x is None else x.reshape(shape) if rows else x

    # the clipped surrogate under the frameworks' other names (semantics §11)
    pl_type = "vanilla" if loss_type in ("grpo", "bnpo", "dapo", "ppo") else loss_type
    pg, *flags = policy_loss(
        shaped(lp), shaped(old_log_probs), shaped(advantages), shaped(keep),
        selected=shaped(selected), cu_seqlens=cu_seqlens, loss_type=pl_type,
        aggregation="seq-mean" if pl_type == "geo_mean" else aggregation, dtype=dtype,
        **options)
    n = max(int(keep.sum()), 1)
    old, = _decided(keep, old_log_probs.to(dtype))
    d = lp - old
    if options.get("log_ratio_clamp") is not None:
        d = d.clamp(-options["log_ratio_clamp"], options["log_ratio_clamp"])
    metrics = {"approx_kl": torch.where(keep, k3(-d), 0.0).sum() / n,
               "entropy": torch.where(keep, ent, 0.0).sum() / n}
    if pl_type == "vanilla":
        metrics["clip_fraction"] = flags[0]
        if options.get("dual_clip") is not None:
            metrics["dual_clip_fraction"] = flags[1]
    else:
        metrics.update(zip(("clip_fraction", "clip_fraction_lower", "clip_fraction_negative",
                            "clip_fraction_positive", "ppo_kl"), flags))
    total = -entropy_coef * ent
    if ref_log_probs is not None:
        (ref,) = _decided(keep, ref_log_probs.to(dtype))
        kl = kl_penalty(torch.where(keep, lp, 0.0), ref, kl_kind, kl_clamp, dtype=dtype)
        total = total + kl_coef * kl
        metrics["kl"] = torch.where(keep, kl, 0.0).sum() / n

    def agg(x):
        if rows:
            return _aggregate(x.reshape(shape), keep.reshape(shape), aggregation)
        return _aggregate(x, keep, aggregation, cu_seqlens)

    metrics["pg_loss"] = pg
    return pg + agg(total), metrics


def rollout_divergence(statistic, d, log_probs, rollout_log_probs, log_ratio_clamp):
    """The per-token divergence estimates that `rollout_correction` gates on (semantics §10):
    KL(pi_rollout || pi_trainer) from d = log_probs - rollout_log_probs (clamped), or the
    sampled token's probabilities p (engine) and q (trainer), clamped into (0, 1)."""
    if statistic in ("k1", "k2", "k3"):
        if log_ratio_clamp is not None:
            d = d.clamp(-log_ratio_clamp, log_ratio_clamp)
        return {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - 1 - d}[statistic]
    p = rollout_log_probs.exp().clamp(1e-6, 1 - 1e-6)
    q = log_probs.exp().clamp(1e-6, 1 - 1e-6)
    if statistic == "binary_kl":
        return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    return (p - q).abs()


def rollout_correction(log_probs, rollout_log_probs, mask=None, *, level="token",
                       mode="truncate", low=None, high=2.0, statistic="ratio", weight_level=None,
                       log_ratio_clamp=20.0, cu_seqlens=None, dtype=torch.float64):
    """One sequence and one token at a time: the per-token statistic (the log-ratio, or a
    divergence), aggregated over the sequence (sum, mean or max of its set positions), the ratio
    exp(clamp(.)), then truncated or gated (semantics §10). Returns (weights, kept mask)."""
    import math
    lp, rp = _prep(dtype, log_probs, rollout_log_probs)
    on = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask != 0
    if cu_seqlens is None:
        T = lp.shape[-1]
        bounds = [(i * T, (i + 1) * T) for i in range(lp.numel() // T)] if T else []
    else:
        cu = [int(c) for c in cu_seqlens]
        bounds = list(zip(cu[:-1], cu[1:]))
    lpf, rpf, onf = lp.reshape(-1), rp.reshape(-1), on.reshape(-1)
    w = torch.zeros_like(lpf)
    keep = torch.zeros_like(onf)

    def ratio(s):
        if log_ratio_clamp is not None:
            s = min(max(s, -log_ratio_clamp), log_ratio_clamp)
        return _exp(s)

    def token(t):
        d = lpf[t] - rpf[t]
        if statistic == "ratio":
            return float(d)
        return float(rollout_divergence(statistic, d, lpf[t], rpf[t], log_ratio_clamp))

    for a, b in bounds:
        set_ = [t for t in range(a, b) if onf[t]]
        logr = [float(lpf[t] - rpf[t]) for t in set_]
        stat = [token(t) for t in set_]

        def levels(xs):
            top = (math.nan if any(x != x for x in xs) else max(xs)) if xs else 0.0
            return {"sequence": sum(xs), "geometric": sum(xs) / max(len(xs), 1), "max": top}

        seq_stat, seq_logr = levels(stat), levels(logr)
        for i, t in enumerate(set_):
            s = {"token": stat[i], **seq_stat}[level]
            r = ratio(s) if statistic == "ratio" else s
            if mode == "truncate":
                if low is not None:
                    r = max(r, low)
                if high is not None:
                    r = min(r, high)
                w[t], keep[t] = r, True
            elif (low is None or r >= low) and (high is None or r <= high):
                if weight_level is None:
                    w[t] = r if statistic == "ratio" else 1.0
                else:
                    w[t] = ratio({"token": logr[i], **seq_logr}[weight_level])
                keep[t] = True
    return w.reshape(lp.shape), keep.reshape(lp.shape)


def policy_loss(log_probs, old_log_probs, advantages, mask=None, *, weights=None, selected=None,
                cu_seqlens=None, aggregation="token-mean", loss_type="vanilla",
                ratio_level="token", clip_low=0.2, clip_high=0.2, dual_clip=None, delta=None,
                log_ratio_clamp=20.0, tau_pos=1.0, tau_neg=1.05, truncation=20.0, dro_beta=None,
                kl_cov_coef=1.0, dtype=torch.float64):
    """(loss, clip_fraction, clip_fraction_lower, clip_fraction_negative,
    clip_fraction_positive, kl) of `rl_triton.policy_loss` (docs/semantics.md §10), sequence by
    sequence and position by position; `selected`: clip_cov's / kl_cov's pick, given. The
    global factors of verl's aggregation are not here (a multiplication after)."""
    lp, old, adv, w = _prep(dtype, log_probs, old_log_probs, advantages, weights)
    keep = _selected(mask, lp)
    lp, old, adv, w = _decided(keep, lp, old, adv, w)  # a masked position enters no arithmetic
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        sequences = [slice(a, b) for a, b in zip(cu[:-1], cu[1:])]
    elif lp.ndim == 2:
        sequences = [(b, slice(None)) for b in range(lp.shape[0])]
    else:
        sequences = None
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    clamp = math.inf if log_ratio_clamp is None else log_ratio_clamp

    def bound(x, low=True):  # clamp(x, -clamp, clamp); none without a clamp (its backward
        # would zero a NaN's gradient: torch.clamp passes it only between the bounds)
        return x if clamp == math.inf else torch.clamp(x, -clamp if low else None, clamp)
    flat = [t.reshape(-1) for t in (lp, old, adv, keep)]
    seq_d = {}  # a sequence's log-ratio at each of its positions (flat index)
    if (ratio_level == "sequence" or loss_type == "gspo" or loss_type == "geo_mean") and \
            sequences is not None:
        index = torch.arange(lp.numel(), device=lp.device).view(lp.shape)
        for s in sequences:
            idx = index[s].reshape(-1).tolist()
            n = sum(bool(flat[3][i]) for i in idx)
            total = sum((flat[0][i] - flat[1][i] for i in idx if flat[3][i]),
                        lp.new_zeros(()))
            if loss_type == "gspo":
                mean = total.detach() / max(n, 1)
                for i in idx:
                    seq_d[i] = bound(mean + flat[0][i] - flat[0][i].detach(), low=False)
            elif loss_type != "geo_mean":
                mean = bound(total / max(n, 1))
                for i in idx:
                    seq_d[i] = mean
    if loss_type == "geo_mean":
        return _geo_mean_loop(lp, old, adv, w, keep, sequences, clip_low, clip_high, clamp,
                              aggregation, dtype)
    sel = None if selected is None else selected.reshape(-1)
    wf = None if w is None else w.reshape(-1)
    zero = lp.reshape(-1)[:0].sum()  # 0, a function of lp (no input silently detached)
    ls, flags = [], []
    for i in range(lp.numel()):
        x, o, a = flat[0][i], flat[1][i], flat[2][i]
        raw = x - o
        d = seq_d.get(i, bound(raw))
        r = torch.exp(d)
        rv, av = float(r.detach()), float(a.detach())  # for the branches and flags
        clip = lower = neg = pos = False
        if loss_type == "gpg":
            l = -a * x
        elif loss_type == "dro":
            l = -(x * a - 0.5 * dro_beta * raw * raw)
        elif loss_type in ("dppo_tv", "dppo_kl"):
            p, q = _exp(float(x.detach())), _exp(float(o.detach()))
            if loss_type == "dppo_tv":
                ok = p - q <= clip_high if av > 0 else p - q >= -clip_low
            else:
                xf, of = float(x.detach()), float(o.detach())
                bkl = q * (of - xf) + (1 - q) * _log((1 - q + 1e-8) / (1 - p + 1e-8))
                ok = (bkl <= clip_high or p <= q) if av > 0 else (bkl <= clip_low or p >= q)
            l = -a * min(rv, truncation) * x * float(ok)  # (a product, verl's)
            clip, lower = not ok, ok and rv > truncation
        elif loss_type == "sapo":
            tau = tau_pos if av > 0 else tau_neg
            l = -a * torch.sigmoid(tau * (r - 1)) * 4 / tau
        elif loss_type == "cispo":
            l = -min(max(rv, lo), hi) * a * x
            clip = not lo <= rv <= hi  # (a NaN ratio counts)
        elif loss_type == "kl_cov":
            l = -a * r + (kl_cov_coef * d.abs() if sel[i] else 0.0)
        else:  # the clipped surrogate (TRL's delta bounds the unclipped ratio)
            rr = r if delta is None else torch.clamp(r, max=delta)
            l = torch.maximum(-a * rr, -a * torch.clamp(r, lo, hi))
            clip = bool(-a * torch.clamp(r, lo, hi) > -a * rr)
            if av < 0 and dual_clip is not None and loss_type == "vanilla":
                lower = bool(l > -a * dual_clip)
                l = torch.minimum(l, -a * dual_clip)
            if loss_type == "clip_cov" and sel[i]:
                l, clip = zero, True
            elif loss_type == "clip_cov":
                clip = False
        if loss_type not in ("sapo", "gpg", "dro", "dppo_tv", "dppo_kl", "kl_cov"):
            rr = rv if delta is None or loss_type != "vanilla" else min(rv, delta)
            neg, pos = rv < lo and av < 0, rr > hi and av > 0
        if wf is not None:
            l = l * wf[i]
        kl = raw if i in seq_d else bound(raw)
        ls.append(l if isinstance(l, torch.Tensor) else zero + l)
        flags.append([float(clip), float(lower), float(neg), float(pos),
                      float((kl.abs() if loss_type == "kl_cov" else -kl).detach())])
    l = torch.stack(ls).view(lp.shape) if ls else lp * 0  # (empty: still a function of lp)
    n = max(int(keep.sum()), 1)
    metrics = [sum((f[k] for f, kept in zip(flags, keep.reshape(-1).tolist()) if kept), 0.0) / n
               for k in range(5)]
    return (attached(_aggregate(l, keep, aggregation, cu_seqlens), *(
                old_log_probs, advantages, weights)),
            *(torch.tensor(v, dtype=dtype, device=lp.device) for v in metrics))


def _geo_mean_loop(lp, old, adv, w, keep, sequences, clip_low, clip_high, clamp, aggregation,
                   dtype):
    losses, flags = [], []
    for s in sequences:
        n = float(keep[s].sum()) + 1e-8
        # 0 as functions of the inputs (an empty sequence keeps the graph)
        log_r, a_sum = lp.reshape(-1)[:0].sum(), adv.reshape(-1)[:0].sum()
        log_w = lp.new_zeros(()) if w is None else w.reshape(-1)[:0].sum()
        for x, o, a, k, wi in zip(lp[s].reshape(-1), old[s].reshape(-1), adv[s].reshape(-1),
                                  keep[s].reshape(-1), (w[s].reshape(-1) if w is not None
                                                        else [None] * lp[s].numel())):
            d = x - o if clamp == math.inf else torch.clamp(x - o, -clamp, clamp)
            dc = torch.clamp(d, -clip_low, clip_high)
            # clipped toward 0 on the side the advantage pushes
            dm = torch.minimum(d, dc) if a > 0 else torch.maximum(d, dc) if a < 0 else 0.0 * d
            if k:
                log_r = log_r + dm
                a_sum = a_sum + a
                if wi is not None:
                    log_w = log_w + torch.log(wi + 1e-10)
                clipped = bool(d != dc)
                flags.append([float(clipped and a > 0), float(clipped and a < 0), 0.0, 0.0,
                              float(-d.detach())])
        l = -a_sum / n * torch.exp(log_r / n)
        if w is not None:
            l = l * torch.exp(log_w / n)
        losses.append(l)
    per_seq = torch.stack(losses) if losses else lp.new_zeros(0)
    loss = per_seq if aggregation == "none" else per_seq.sum() / max(len(losses), 1)
    n = max(len(flags), 1)
    return (loss, *(torch.tensor(sum(f[k] for f in flags) / n, dtype=dtype, device=lp.device)
                    for k in range(5)))
