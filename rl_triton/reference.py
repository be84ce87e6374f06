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
"""
from __future__ import annotations

import torch


def _prep(dtype, *xs):
    """Cast values to `dtype` (None stays None)."""
    return [None if x is None else x.to(dtype) for x in xs]


def _flags(*xs):
    """Flags (bool / int / float) as bool: set wherever nonzero (None stays None)."""
    return [None if x is None else x != 0 for x in xs]


def _cut(terminated, truncated, t, T):
    """cut[t] = done[t] or t == T-1 (bool)."""
    if t == T - 1:
        return torch.ones_like(terminated[t])
    return terminated[t] if truncated is None else terminated[t] | truncated[t]


def _trace(cut, coef, later):
    """coef * later where the trace goes on, and 0 where it is cut (`cut` set, or coef 0),
    whatever `later` holds: a select, not a multiplication by zero (0 * inf is NaN), so that
    nothing after a cut reaches the steps before it. `cut`, `coef`: bools / numbers or tensors."""
    stop = cut | (coef == 0)
    if not isinstance(stop, torch.Tensor):
        return torch.zeros_like(later) if stop else coef * later
    return torch.where(stop, 0.0, coef * later)


def _successor(values, next_values, last_value, t, T, like):
    """v'[t]; zero where nothing is given (only discounted_returns allows that)."""
    if next_values is not None:
        return next_values[t]
    if t < T - 1:
        return values[t + 1] if values is not None else torch.zeros_like(like)
    return last_value if last_value is not None else torch.zeros_like(like)


def gae(rewards, values, terminated, truncated=None, *, last_value=None, next_values=None,
        gamma=0.99, lam=0.95, dtype=torch.float64):
    r, v, lv, nv = _prep(dtype, rewards, values, last_value, next_values)
    term, trunc = _flags(terminated, truncated)
    T = r.shape[0]
    adv = torch.zeros_like(r)
    a_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        v_succ = _successor(v, nv, lv, t, T, r[0])
        delta = r[t] + torch.where(term[t], 0.0, gamma * v_succ) - v[t]
        a_next = delta + _trace(_cut(term, trunc, t, T), gamma * lam, a_next)
        adv[t] = a_next
    return adv, adv + v


def lambda_returns(rewards, values, terminated, truncated=None, *, last_value=None,
                   next_values=None, gamma=0.99, lam=0.95, dtype=torch.float64):
    r, v, lv, nv = _prep(dtype, rewards, values, last_value, next_values)
    term, trunc = _flags(terminated, truncated)
    T = r.shape[0]
    ret = torch.zeros_like(r)
    g_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        v_succ = _successor(v, nv, lv, t, T, r[0])
        cut = _cut(term, trunc, t, T)
        # G[t] = r + g (1 - term) (1 - l (1 - cut)) v' + g l (1 - cut) G[t+1]  (cut includes term)
        keep = torch.where(cut, 0.0, lam * torch.ones_like(r[t]))  # lam: a number or per row
        g_next = (r[t] + torch.where(term[t], 0.0, gamma * (1 - keep) * v_succ)
                  + _trace(cut, gamma * lam, g_next))
        ret[t] = g_next
    return ret


def discounted_returns(rewards, terminated, truncated=None, *, last_value=None, next_values=None,
                       gamma=0.99, dtype=torch.float64):
    r, lv, nv = _prep(dtype, rewards, last_value, next_values)
    term, trunc = _flags(terminated, truncated)
    T = r.shape[0]
    ret = torch.zeros_like(r)
    g_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        v_succ = _successor(None, nv, lv, t, T, r[0])
        cut = _cut(term, trunc, t, T)
        # G[t] = r + g (1 - term) cut v' + g (1 - cut) G[t+1]  (cut includes term)
        g_next = (r[t] + torch.where(cut & ~term[t], gamma * v_succ, 0.0)
                  + _trace(cut, gamma, g_next))
        ret[t] = g_next
    return ret


def vtrace(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated=None, *,
           last_value=None, next_values=None, gamma=0.99, lam=1.0, rho_clip=1.0, c_clip=1.0,
           pg_rho_clip=1.0, dtype=torch.float64):
    r, v, tlp, blp, lv, nv = _prep(dtype, rewards, values, target_log_probs, behavior_log_probs,
                                   last_value, next_values)
    term, trunc = _flags(terminated, truncated)
    T = r.shape[0]
    vs = torch.zeros_like(r)
    pg = torch.zeros_like(r)
    d_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        v_succ = _successor(v, nv, lv, t, T, r[0])
        cut = _cut(term, trunc, t, T)
        ratio = torch.exp(tlp[t] - blp[t])
        rho = torch.clamp(ratio, max=rho_clip)  # a NaN ratio stays NaN
        c = lam * torch.clamp(ratio, max=c_clip)
        # vs'[t]: vs[t+1] inside the episode and window, v'[t] at a cut.
        vs_succ = v_succ if t == T - 1 else torch.where(cut, v_succ, vs[t + 1])
        boot = lam * vs_succ + (1 - lam) * v_succ
        pg[t] = torch.clamp(ratio, max=pg_rho_clip) * (
            r[t] + torch.where(term[t], 0.0, gamma * boot) - v[t])
        delta = rho * (r[t] + torch.where(term[t], 0.0, gamma * v_succ) - v[t])
        d_next = delta + _trace(cut, gamma * c, d_next)
        vs[t] = v[t] + d_next
    return vs, pg


def retrace(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated=None,
            *, last_q_values=None, last_target_probs=None, gamma=0.99, lam=1.0, c_clip=1.0,
            dtype=torch.float64):
    """Returns (G, G - Q(s_t, a_t)). q_values / target_probs: [T, *batch, A]; actions: [T, *batch]."""
    r, q, pi, mu, lq, lpi = _prep(dtype, rewards, q_values, target_probs, behavior_probs,
                                  last_q_values, last_target_probs)
    term, trunc = _flags(terminated, truncated)
    a = actions.long().unsqueeze(-1)
    T = r.shape[0]
    G = torch.zeros_like(r)
    g_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        if t == T - 1:
            expected = (lpi * lq).sum(-1)  # E[t] from the bootstrap state s_T
            c_next = q_next_a = torch.zeros_like(r[0])
        else:
            expected = (pi[t + 1] * q[t + 1]).sum(-1)  # E[t] from slot t+1
            pi_next_a = pi[t + 1].gather(-1, a[t + 1]).squeeze(-1)
            c_next = lam * torch.clamp(pi_next_a / mu[t + 1], max=c_clip)
            q_next_a = q[t + 1].gather(-1, a[t + 1]).squeeze(-1)
        cut = _cut(term, trunc, t, T)
        # G[t] = r + g (1 - term) (E - (1 - cut) c Q') + g (1 - cut) c G[t+1]  (cut includes term)
        boot = expected - torch.where(cut, 0.0, c_next * q_next_a)
        g_next = r[t] + torch.where(term[t], 0.0, gamma * boot) + _trace(cut, gamma * c_next, g_next)
        G[t] = g_next
    return G, G - q.gather(-1, a).squeeze(-1)


def eligibility_traces(x, dones, *, gamma, lam, initial=None, dtype=torch.float64):
    """x: [T, *batch, *features]; dones: [T, *batch], broadcast over the feature axes."""
    xs, init = _prep(dtype, x, initial)
    (d,) = _flags(dones)
    d = d.reshape(d.shape + (1,) * (xs.ndim - d.ndim))
    z = torch.zeros_like(xs)
    z_prev = init if init is not None else torch.zeros_like(xs[0])
    for t in range(xs.shape[0]):
        z_prev = xs[t] + _trace(d[t - 1] if t > 0 else False, gamma * lam, z_prev)
        z[t] = z_prev
    return z


def episodic_cumsum(x, dones, *, initial=None, dtype=torch.float64):
    """x: [T, *batch, *features]; dones: [T, *batch], broadcast over the feature axes."""
    xs, init = _prep(dtype, x, initial)
    (d,) = _flags(dones)
    d = d.reshape(d.shape + (1,) * (xs.ndim - d.ndim))
    c = torch.zeros_like(xs)
    c_prev = init if init is not None else torch.zeros_like(xs[0])
    for t in range(xs.shape[0]):
        c_prev = xs[t] + _trace(d[t - 1] if t > 0 else False, 1.0, c_prev)
        c[t] = c_prev
    return c


def linear_scan(alpha, beta, *, reverse=True, initial=None, dtype=torch.float64):
    al, be, init = _prep(dtype, alpha, beta, initial)
    T = al.shape[0]
    out = torch.zeros_like(al)
    acc = init if init is not None else torch.zeros_like(al[0])
    for t in (reversed(range(T)) if reverse else range(T)):
        acc = al[t] + _trace(False, be[t], acc)  # beta = 0: A[t] = alpha[t], whatever follows
        out[t] = acc
    return out
