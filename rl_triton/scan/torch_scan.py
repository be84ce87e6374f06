"""The torch backend's engine (any device; the `torch.compile` baseline).

Each op's torch implementation forms its coefficients (alpha, beta) as whole tensors and
evaluates the recurrence with `scan`, a doubling scan: log2(T) vectorized steps over
time-major `[T, ...]` tensors, all arithmetic in the inputs' dtype (float32 as a backend; the
tests also run it in float64 as a fast vectorized check of large shapes).
"""
from __future__ import annotations

import torch



def scan(alpha, beta, *, reverse: bool, initial=None):
    """A[t] = alpha[t] + beta[t] * A[t+1] (reverse) or A[t-1] (forward), along axis 0.

    `beta` may have fewer trailing axes than `alpha` (size 1, broadcast): flags over features.
    """
    a, b = alpha, beta
    T = a.shape[0]
    k = 1
    while k < T:
        if reverse:
            a = torch.cat([a[:-k] + b[:-k] * a[k:], a[-k:]])
            b = torch.cat([b[:-k] * b[k:], b[-k:]]) if 2 * k < T or initial is not None else b
        else:
            a = torch.cat([a[:k], a[k:] + b[k:] * a[:-k]])
            b = torch.cat([b[:k], b[k:] * b[:-k]]) if 2 * k < T or initial is not None else b
        k *= 2
    if initial is not None:
        a = a + b * initial
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
    done = term if trunc is None else torch.maximum(term, trunc)
    return torch.cat([done[:-1], torch.ones_like(done[-1:])])
