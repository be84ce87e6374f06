"""Sequential references: the readable definition of every estimator.

Each function is the plain loop of the specification (the recurrences in the docstrings of
`rl_triton.estimators`), written to be checked by eye against the formulas.
They take time-major tensors (`[T, *batch]`, time on axis 0) and compute in `dtype`: float64 in
the tests, float32 as the library's `backend="loop"`. Flags are read as `flag != 0`.

Notation: g = gamma, l = lambda, v'[t] the successor value (`next_values[t]` if given, else
`values[t+1]`, and `last_value` at t = T-1), cut[t] = done[t] or t == T-1.
"""
from __future__ import annotations

import torch


def _prep(dtype, *xs):
    """Cast values to `dtype` and flags (bool / int / float) to 0.0 / 1.0 in `dtype`."""
    out = []
    for x in xs:
        if x is None:
            out.append(None)
        elif x.dtype.is_floating_point:
            out.append(x.to(dtype))
        else:
            out.append((x != 0).to(dtype))
    return out


def _cut(terminated, truncated, t, T):
    """cut[t] = done[t] or t == T-1, as 0.0 / 1.0 (flags already 0.0 / 1.0)."""
    if t == T - 1:
        return torch.ones_like(terminated[t])
    return terminated[t] if truncated is None else torch.maximum(terminated[t], truncated[t])


def _successor(values, next_values, last_value, t, T, like):
    """v'[t]; zero where nothing is given (only discounted_returns allows that)."""
    if next_values is not None:
        return next_values[t]
    if t < T - 1:
        return values[t + 1] if values is not None else torch.zeros_like(like)
    return last_value if last_value is not None else torch.zeros_like(like)


def gae(rewards, values, terminated, truncated=None, *, last_value=None, next_values=None,
        gamma=0.99, lam=0.95, dtype=torch.float64):
    r, v, term, trunc, lv, nv = _prep(dtype, rewards, values, terminated, truncated, last_value,
                                      next_values)
    T = r.shape[0]
    adv = torch.zeros_like(r)
    a_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        v_succ = _successor(v, nv, lv, t, T, r[0])
        delta = r[t] + gamma * (1 - term[t]) * v_succ - v[t]
        a_next = delta + gamma * lam * (1 - _cut(term, trunc, t, T)) * a_next
        adv[t] = a_next
    return adv, adv + v


def lambda_returns(rewards, values, terminated, truncated=None, *, last_value=None,
                   next_values=None, gamma=0.99, lam=0.95, dtype=torch.float64):
    r, v, term, trunc, lv, nv = _prep(dtype, rewards, values, terminated, truncated, last_value,
                                      next_values)
    T = r.shape[0]
    ret = torch.zeros_like(r)
    g_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        v_succ = _successor(v, nv, lv, t, T, r[0])
        keep = lam * (1 - _cut(term, trunc, t, T))
        g_next = r[t] + gamma * (1 - term[t]) * ((1 - keep) * v_succ + keep * g_next)
        ret[t] = g_next
    return ret


def discounted_returns(rewards, terminated, truncated=None, *, last_value=None, next_values=None,
                       gamma=0.99, dtype=torch.float64):
    r, term, trunc, lv, nv = _prep(dtype, rewards, terminated, truncated, last_value, next_values)
    T = r.shape[0]
    ret = torch.zeros_like(r)
    g_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        v_succ = _successor(None, nv, lv, t, T, r[0])
        cut = _cut(term, trunc, t, T)
        g_next = r[t] + gamma * (1 - term[t]) * (cut * v_succ + (1 - cut) * g_next)
        ret[t] = g_next
    return ret


def vtrace(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated=None, *,
           last_value=None, next_values=None, gamma=0.99, lam=1.0, rho_clip=1.0, c_clip=1.0,
           pg_rho_clip=1.0, dtype=torch.float64):
    r, v, term, tlp, blp, trunc, lv, nv = _prep(dtype, rewards, values, terminated,
                                                target_log_probs, behavior_log_probs, truncated,
                                                last_value, next_values)
    T = r.shape[0]
    vs = torch.zeros_like(r)
    pg = torch.zeros_like(r)
    d_next = torch.zeros_like(r[0])
    for t in reversed(range(T)):
        v_succ = _successor(v, nv, lv, t, T, r[0])
        cut = _cut(term, trunc, t, T)
        ratio = torch.exp(tlp[t] - blp[t])
        rho = torch.clamp(ratio, max=rho_clip)
        c = lam * torch.clamp(ratio, max=c_clip)
        # vs'[t]: vs[t+1] inside the episode and window, v'[t] at a cut.
        vs_succ = v_succ if t == T - 1 else cut * v_succ + (1 - cut) * vs[t + 1]
        pg[t] = torch.clamp(ratio, max=pg_rho_clip) * (
            r[t] + gamma * (1 - term[t]) * (lam * vs_succ + (1 - lam) * v_succ) - v[t])
        delta = rho * (r[t] + gamma * (1 - term[t]) * v_succ - v[t])
        d_next = delta + gamma * c * (1 - cut) * d_next
        vs[t] = v[t] + d_next
    return vs, pg


def retrace(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated=None,
            *, last_q_values=None, last_target_probs=None, gamma=0.99, lam=1.0, c_clip=1.0,
            dtype=torch.float64):
    """Returns (G, G - Q(s_t, a_t)). q_values / target_probs: [T, *batch, A]; actions: [T, *batch]."""
    r, q, pi, mu, term, trunc, lq, lpi = _prep(dtype, rewards, q_values, target_probs,
                                               behavior_probs, terminated, truncated,
                                               last_q_values, last_target_probs)
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
        g_next = r[t] + gamma * (1 - term[t]) * (expected + (1 - cut) * c_next * (g_next - q_next_a))
        G[t] = g_next
    return G, G - q.gather(-1, a).squeeze(-1)


def eligibility_traces(x, dones, *, gamma, lam, initial=None, dtype=torch.float64):
    """x: [T, *batch, *features]; dones: [T, *batch], broadcast over the feature axes."""
    xs, d, init = _prep(dtype, x, dones, initial)
    d = d.reshape(d.shape + (1,) * (xs.ndim - d.ndim))
    z = torch.zeros_like(xs)
    z_prev = init if init is not None else torch.zeros_like(xs[0])
    for t in range(xs.shape[0]):
        keep = gamma * lam * (1 - d[t - 1]) if t > 0 else gamma * lam
        z_prev = xs[t] + keep * z_prev
        z[t] = z_prev
    return z


def episodic_cumsum(x, dones, *, initial=None, dtype=torch.float64):
    """x: [T, *batch, *features]; dones: [T, *batch], broadcast over the feature axes."""
    xs, d, init = _prep(dtype, x, dones, initial)
    d = d.reshape(d.shape + (1,) * (xs.ndim - d.ndim))
    c = torch.zeros_like(xs)
    c_prev = init if init is not None else torch.zeros_like(xs[0])
    for t in range(xs.shape[0]):
        keep = (1 - d[t - 1]) if t > 0 else 1.0
        c_prev = xs[t] + keep * c_prev
        c[t] = c_prev
    return c


def linear_scan(alpha, beta, *, reverse=True, initial=None, dtype=torch.float64):
    al, be, init = _prep(dtype, alpha, beta, initial)
    T = al.shape[0]
    out = torch.zeros_like(al)
    acc = init if init is not None else torch.zeros_like(al[0])
    for t in (reversed(range(T)) if reverse else range(T)):
        acc = al[t] + be[t] * acc
        out[t] = acc
    return out
