"""The vectorized pure-PyTorch backend (any device; the `torch.compile` baseline).

Each estimator forms its coefficients (alpha, beta) as whole tensors and evaluates the
recurrence with a doubling scan: log2(T) vectorized steps over time-major `[T, ...]` tensors, all
arithmetic in `dtype` (float32 as a backend; the tests also run it in float64 as a fast
vectorized check of large shapes).
"""
from __future__ import annotations

import torch

from .reference import _prep


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


def _shift_up(x, last):
    """x[t+1] for t < T-1 and `last` at T-1."""
    return torch.cat([x[1:], last.unsqueeze(0)])


def _successor(values, next_values, last_value, like):
    if next_values is not None:
        return next_values
    last = last_value if last_value is not None else torch.zeros_like(like[0])
    nxt = values if values is not None else torch.zeros_like(like)
    return _shift_up(nxt, last)


def _cut(term, trunc):
    done = term if trunc is None else torch.maximum(term, trunc)
    return torch.cat([done[:-1], torch.ones_like(done[-1:])])


def gae(rewards, values, terminated, truncated=None, *, last_value=None, next_values=None,
        gamma=0.99, lam=0.95, dtype=torch.float32):
    r, v, term, trunc, lv, nv = _prep(dtype, rewards, values, terminated, truncated, last_value,
                                      next_values)
    v_succ = _successor(v, nv, lv, r)
    alpha = r + gamma * (1 - term) * v_succ - v
    beta = gamma * lam * (1 - _cut(term, trunc))
    adv = scan(alpha, beta, reverse=True)
    return adv, adv + v


def lambda_returns(rewards, values, terminated, truncated=None, *, last_value=None,
                   next_values=None, gamma=0.99, lam=0.95, dtype=torch.float32):
    r, v, term, trunc, lv, nv = _prep(dtype, rewards, values, terminated, truncated, last_value,
                                      next_values)
    v_succ = _successor(v, nv, lv, r)
    keep = lam * (1 - _cut(term, trunc))
    alpha = r + gamma * (1 - term) * (1 - keep) * v_succ
    beta = gamma * (1 - term) * keep
    return scan(alpha, beta, reverse=True)


def discounted_returns(rewards, terminated, truncated=None, *, last_value=None, next_values=None,
                       gamma=0.99, dtype=torch.float32):
    r, term, trunc, lv, nv = _prep(dtype, rewards, terminated, truncated, last_value, next_values)
    v_succ = _successor(None, nv, lv, r)
    cut = _cut(term, trunc)
    alpha = r + gamma * (1 - term) * cut * v_succ
    beta = gamma * (1 - term) * (1 - cut)
    return scan(alpha, beta, reverse=True)


def vtrace(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated=None, *,
           last_value=None, next_values=None, gamma=0.99, lam=1.0, rho_clip=1.0, c_clip=1.0,
           pg_rho_clip=1.0, dtype=torch.float32):
    r, v, term, tlp, blp, trunc, lv, nv = _prep(dtype, rewards, values, terminated,
                                                target_log_probs, behavior_log_probs, truncated,
                                                last_value, next_values)
    v_succ = _successor(v, nv, lv, r)
    cut = _cut(term, trunc)
    ratio = torch.exp(tlp - blp)
    target = r + gamma * (1 - term) * v_succ
    alpha = torch.clamp(ratio, max=rho_clip) * (target - v)
    beta = gamma * lam * torch.clamp(ratio, max=c_clip) * (1 - cut)
    d = scan(alpha, beta, reverse=True)
    vs = v + d
    zero = torch.zeros_like(r[0])
    vs_succ = cut * v_succ + (1 - cut) * _shift_up(vs, zero)
    pg = torch.clamp(ratio, max=pg_rho_clip) * (
        r + gamma * (1 - term) * (lam * vs_succ + (1 - lam) * v_succ) - v)
    return vs, pg


def retrace(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated=None,
            *, last_q_values=None, last_target_probs=None, gamma=0.99, lam=1.0, c_clip=1.0,
            dtype=torch.float32):
    r, q, pi, mu, term, trunc, lq, lpi = _prep(dtype, rewards, q_values, target_probs,
                                               behavior_probs, terminated, truncated,
                                               last_q_values, last_target_probs)
    a = actions.long().unsqueeze(-1)
    q_a = q.gather(-1, a).squeeze(-1)
    pi_a = pi.gather(-1, a).squeeze(-1)
    zero = torch.zeros_like(r[0])
    expected = _shift_up((pi * q).sum(-1), (lpi * lq).sum(-1))
    c_next = _shift_up(lam * torch.clamp(pi_a / mu, max=c_clip), zero)
    q_a_next = _shift_up(q_a, zero)
    keep = (1 - _cut(term, trunc)) * c_next
    alpha = r + gamma * (1 - term) * (expected - keep * q_a_next)
    beta = gamma * (1 - term) * keep
    g = scan(alpha, beta, reverse=True)
    return g, g - q_a


def _forward_keep(x, dones, scale):
    """scale * (1 - done[t-1]) with done[-1] = 0, shaped to broadcast over x's feature axes."""
    d = dones.reshape(dones.shape + (1,) * (x.ndim - dones.ndim))
    return scale * (1 - torch.cat([torch.zeros_like(d[:1]), d[:-1]]))


def eligibility_traces(x, dones, *, gamma, lam, initial=None, dtype=torch.float32):
    xs, d, init = _prep(dtype, x, dones, initial)
    return scan(xs, _forward_keep(xs, d, gamma * lam), reverse=False, initial=init)


def episodic_cumsum(x, dones, *, initial=None, dtype=torch.float32):
    xs, d, init = _prep(dtype, x, dones, initial)
    return scan(xs, _forward_keep(xs, d, 1.0), reverse=False, initial=init)


def linear_scan(alpha, beta, *, reverse=True, initial=None, dtype=torch.float32):
    al, be, init = _prep(dtype, alpha, beta, initial)
    return scan(al, be, reverse=reverse, initial=init)
