"""The torch backend's engine (any device; the `torch.compile` baseline).

Each op's torch implementation forms its coefficients (alpha, beta) as whole tensors and
evaluates the recurrence with `scan`, a doubling scan: log2(T) vectorized steps over
time-major `[T, ...]` tensors, all arithmetic in the inputs' dtype (float32 as a backend; the
tests also run it in float64 as a fast vectorized check of large shapes). Flags are bool
(`flag != 0`) and every flag is a select, as is a zero beta in the scan: nothing after a cut
reaches the steps before it (0 * inf is NaN).
"""
from __future__ import annotations

import torch



def _then(a2, b2, a1):
    """a2 + b2 * a1, and exactly a2 where b2 = 0 (a cut: whatever a1 holds, inf and NaN too)."""
    return torch.where(b2 == 0, a2, a2 + b2 * a1)


def _both(b2, b1):
    """b1 * b2, and exactly 0 where b2 = 0."""
    return torch.where(b2 == 0, 0.0, b2 * b1)


def scan(alpha, beta, *, reverse: bool, initial=None):
    """A[t] = alpha[t] + beta[t] * A[t+1] (reverse) or A[t-1] (forward), along axis 0, where
    beta[t] = 0 gives A[t] = alpha[t] whatever A[t+1] holds (a select, as in every backend).

    `beta` may have fewer trailing axes than `alpha` (size 1, broadcast): flags over features.
    """
    a, b = alpha, beta
    T = a.shape[0]
    k = 1
    while k < T:
        last = not (2 * k < T or initial is not None)
        if reverse:
            a = torch.cat([_then(a[:-k], b[:-k], a[k:]), a[-k:]])
            b = b if last else torch.cat([_both(b[:-k], b[k:]), b[-k:]])
        else:
            a = torch.cat([a[:k], _then(a[k:], b[k:], a[:-k])])
            b = b if last else torch.cat([b[:k], _both(b[k:], b[:-k])])
        k *= 2
    if initial is not None:
        a = _then(a, b, initial)
    return a


def shift_up(x, last):
    """x[t+1] for t < T-1 and `last` at T-1."""
    return torch.cat([x[1:], last.unsqueeze(0)])


def successor(values, next_values, last_value, like):
    if next_values is not None:
        return next_values
    last = last_value if last_value is not None else torch.zeros_like(like[0])
    nxt = values if values is not None else torch.zeros_like(like)
    return shift_up(nxt, last)


def cut(term, trunc):
    """cut[t] = done[t] or t == T-1 (bool flags)."""
    done = term if trunc is None else term | trunc
    return torch.cat([done[:-1], torch.ones_like(done[-1:])])


def keep(cut, scale, dtype):
    """scale where the trace goes on, 0 at a cut."""
    return scale * (~cut).to(dtype)
