"""The torch backend's engine (any device; the `torch.compile` baseline).

Each op's torch implementation forms its coefficients (alpha, beta) as whole tensors and
evaluates the recurrence with `scan`, a doubling scan: log2(T) vectorized steps over
time-major `[T, ...]` tensors, all arithmetic in the inputs' dtype (float32 as a backend; the
tests also run it in float64 as a fast vectorized check of large shapes). Flags are bool
(`flag != 0`) and every flag is a select, as is a zero beta in the scan: nothing after a cut
reaches the steps before it (0 * inf is NaN). `scan` is differentiated by its adjoint (`Scan`),
whose d beta is the product's derivative also where beta = 0.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

Tensor = torch.Tensor


class Packed(NamedTuple):
    """Packed rows (docs/semantics.md §7) as one long row `[L, *batch]`: each segment's last
    decision step (its window end) and its first (where a forward scan restarts from its
    `initial`). With them the implementations take bootstraps and discounts per step (each
    step's segment's)."""
    ends: Tensor  # bool [L, *batch]
    starts: Tensor  # bool [L, *batch]


def segment_ids(cu: Tensor, L: int) -> Tensor:
    """The segment s of each of `L` packed positions t, cu[s] <= t < cu[s + 1], clamped into
    [0, S - 1] whatever the offsets `cu` [S + 1] hold. It searches the whole of `cu`, not
    `cu[1:]`: Inductor on CUDA (torch 2.11) ignores a sliced view's offset there (pytorch#182343)."""
    t = torch.arange(L, device=cu.device)
    return (torch.searchsorted(cu, t, right=True) - 1).clamp(0, max(cu.shape[0] - 2, 0))


def packed_rows(cu: Tensor, shape: tuple, mask: Optional[Tensor]) -> tuple:
    """(segment of each step [L], `Packed`) of offsets `cu` [S + 1] over steps of `shape`
    `[L, *batch]` with the decision steps `mask` (None: all). No host read, and whatever `cu`
    holds every index stays inside its tensor (unchecked offsets give garbage, not a fault)."""
    L, S = shape[0], cu.shape[0] - 1
    cu = cu.long().clamp(0, L)
    seg = segment_ids(cu, L)
    if mask is None:
        count = torch.arange(L, device=cu.device).view((L,) + (1,) * (len(shape) - 1))
        m, before, after = None, count, count + 1
        at = cu.view((S + 1,) + (1,) * (len(shape) - 1))
    else:
        m = (mask != 0).expand(shape)
        # decision steps before t (exclusive) and up to t (inclusive), and at each offset
        after = m.long().cumsum(0)
        before = after - m.long()
        at = torch.cat([torch.zeros_like(after[:1]), after])[cu]
    ends = after == at[1:][seg]  # no decision step after t in its segment
    starts = before == at[:-1][seg]  # none before t in its segment
    if m is not None:
        ends, starts = ends & m, starts & m
    else:
        ends, starts = ends.expand(shape), starts.expand(shape)
    return seg, Packed(ends, starts)



def _then(a2, b2, a1):
    """a2 + b2 * a1, and exactly a2 where b2 = 0 (a cut: whatever a1 holds, inf and NaN too)."""
    return torch.where(b2 == 0, a2, a2 + b2 * a1)


def _both(b2, b1):
    """b1 * b2, and exactly 0 where either is 0: a map composed with a cut is constant, whatever
    the other holds (0 * inf is NaN: an infinite beta, e.g. V-trace's c with c_clip = inf, would
    otherwise carry NaN across the cut)."""
    return torch.where((b2 == 0) | (b1 == 0), 0.0, b2 * b1)


def _doubling(a, b, reverse: bool, initial):
    """The recurrence's values by doubling (no autograd: `Scan` differentiates it). `initial`
    enters the boundary step (T-1, or 0) as the sequential loop reads it, A = alpha + beta *
    initial there (a select where beta = 0), which then starts from a constant map: composed
    maps never apply an infinite product of betas to it (inf * 0 is NaN where the loop's
    step-by-step products give inf)."""
    if initial is not None:
        edge = slice(-1, None) if reverse else slice(0, 1)
        a_edge = _then(a[edge], b[edge], initial.unsqueeze(0))
        b_edge = torch.zeros_like(b[edge])
        a = torch.cat([a[:-1], a_edge]) if reverse else torch.cat([a_edge, a[1:]])
        b = torch.cat([b[:-1], b_edge]) if reverse else torch.cat([b_edge, b[1:]])
    T = a.shape[0]
    k = 1
    while k < T:
        last = 2 * k >= T
        if reverse:
            a = torch.cat([_then(a[:-k], b[:-k], a[k:]), a[-k:]])
            b = b if last else torch.cat([_both(b[:-k], b[k:]), b[-k:]])
        else:
            a = torch.cat([a[:k], _then(a[k:], b[k:], a[:-k])])
            b = b if last else torch.cat([b[:k], _both(b[k:], b[:-k])])
        k *= 2
    return a


def _shift(x, reverse: bool, fill):
    """x one step later in scan order: x[t+1] (reverse) or x[t-1], `fill` past the end."""
    edge = fill.expand_as(x[:1]) if isinstance(fill, Tensor) else torch.full_like(x[:1], fill)
    return torch.cat([x[1:], edge]) if reverse else torch.cat([edge, x[:-1]])


class Scan(torch.autograd.Function):
    """`scan`, differentiated by its adjoint (docs/semantics.md §6), the scan the other way:
    for reverse=True H[t] = dA[t] + beta[t-1] H[t-1], d alpha = H, d beta[t] = H[t] A[t+1]
    (A[T] = initial, default 0), d initial = beta[T-1] H[T-1]; forward=True mirrored. A zero
    beta is a select in the values and in H (the adjoint is cut there too), and d beta is the
    product's derivative there as anywhere: a coefficient that is 0 through its value (gamma
    = 0, lam = 0) gets its gradient. A cut of an estimator (a flag, a window end) is a select in
    its builder (`keep`), which gives that beta no gradient at all. Autograd through the
    doubling steps' selects would drop d beta where beta = 0."""

    @staticmethod
    def forward(ctx, alpha, beta, initial, reverse):
        A = _doubling(alpha, beta, reverse, initial)
        ctx.reverse = reverse
        ctx.save_for_backward(beta, A, initial)
        return A

    @staticmethod
    def backward(ctx, dA):
        beta, A, initial = ctx.saved_tensors
        reverse = ctx.reverse
        n_alpha, n_beta, n_init, _ = ctx.needs_input_grad
        # the adjoint runs the other way; step t reads the step before it in the forward's order
        H = _doubling(dA, _shift(beta, not reverse, 0.0), not reverse, None)
        d_alpha = d_beta = d_init = None
        if n_alpha:
            d_alpha = H
        if n_beta:
            outer = initial if initial is not None else 0.0
            d_beta = (H * _shift(A, reverse, outer)).sum_to_size(beta.shape)
        if n_init:
            edge = -1 if reverse else 0
            d_init = _then(torch.zeros_like(H[edge]), beta[edge], H[edge])
            d_init = d_init.sum_to_size(initial.shape)
        return d_alpha, d_beta, d_init, None


def scan(alpha, beta, *, reverse: bool, initial=None):
    """A[t] = alpha[t] + beta[t] * A[t+1] (reverse) or A[t-1] (forward), along axis 0, where
    beta[t] = 0 gives A[t] = alpha[t] whatever A[t+1] holds (a select, as in every backend).
    With `initial` None nothing is read past the window (the boundary step's beta is not
    applied to a 0 there: the estimators' betas are 0 at it anyway; linear_scan passes 0).

    `beta` may have fewer trailing axes than `alpha` (size 1, broadcast): flags over features.
    """
    if not (torch.is_grad_enabled() and any(
            isinstance(x, Tensor) and x.requires_grad for x in (alpha, beta, initial))):
        return _doubling(alpha, beta, reverse, initial)
    return Scan.apply(alpha, beta, initial, reverse)


def decisions(mask, like, packed=None):
    """(m, end) for a mask (semantics §7): the decision steps, broadcast to `like`'s shape, and each
    row's window end, its last decision step; (None, None) without a mask. With `packed`
    rows the window ends are the segments' (m None without a mask)."""
    if mask is None:
        return None, None if packed is None else packed.ends
    m = mask != 0
    m = m.reshape(m.shape + (1,) * (like.ndim - m.ndim)).expand(like.shape)
    return m, m & (m.flip(0).cumsum(0).flip(0) == 1) if packed is None else packed.ends


def next_decision(x, m, last):
    """x at each step's next decision step (strictly later), `last` where there is none: the
    successor across masked steps, as a gather (differentiable in x and last)."""
    T = x.shape[0]
    pos = torch.arange(T, device=x.device).view((T,) + (1,) * (x.ndim - 1)).expand(x.shape)
    at = torch.where(m, pos, T)
    # the first decision step after t: a running minimum from the end, shifted by one
    after = torch.cat([at[1:], torch.full_like(at[:1], T)]).flip(0).cummin(0).values.flip(0)
    return torch.cat([x, last.unsqueeze(0).expand_as(x[:1])]).gather(0, after)


def shift_down(x, first, m=None):
    """x[t-1] for t > 0 and `first` at t = 0; with a mask `m`, x at the previous decision
    step."""
    if m is not None:
        return next_decision(x.flip(0), m.flip(0), first).flip(0)
    return torch.cat([first.unsqueeze(0), x[:-1]])


def masked(alpha, beta, m):
    """The identity map (alpha 0, beta 1) at masked steps: the scan carries its state through
    them unchanged."""
    if m is None:
        return alpha, beta
    return torch.where(m, alpha, 0.0), torch.where(m, beta, 1.0)


def zero_masked(x, m):
    """Outputs are 0 at masked steps."""
    return x if m is None else torch.where(m, x, 0.0)


def shift_up(x, last, m=None):
    """x[t+1] for t < T-1 and `last` at T-1; with a mask `m`, x at the next decision step."""
    if m is not None:
        return next_decision(x, m, last)
    return torch.cat([x[1:], last.unsqueeze(0)])


def successor(values, next_values, last_value, like, m=None, packed=None):
    """v'[t]: next_values, else values at the next step (the next decision step with a mask
    `m`) and last_value past the last one; zeros for what is not given. With `packed` rows,
    last_value is per step (its segment's), read at each segment's end."""
    if next_values is not None:
        return next_values
    nxt = values if values is not None else torch.zeros_like(like)
    if packed is not None:
        last = last_value if last_value is not None else torch.zeros_like(like)
        return torch.where(packed.ends, last, shift_up(nxt, torch.zeros_like(like[0]), m))
    last = last_value if last_value is not None else torch.zeros_like(like[0])
    return shift_up(nxt, last, m)


def cut(term, trunc, end=None):
    """cut[t] = done[t] or t is the window end: t == T-1, or `end` (bool flags)."""
    done = term if trunc is None else term | trunc
    if end is not None:
        return done | end
    return torch.cat([done[:-1], torch.ones_like(done[-1:])])


def keep(cut, scale, dtype):
    """scale where the trace goes on, 0 at a cut: a select, so that a cut's beta gets no
    gradient at all (a product with 0 would pass on 0 * d beta, NaN where the step after the
    cut holds an inf or NaN)."""
    if isinstance(scale, Tensor):  # in the compute dtype at least, as a product with it
        scale = scale.to(torch.promote_types(dtype, scale.dtype))
    return torch.where(cut, torch.zeros((), dtype=dtype, device=cut.device), scale)
