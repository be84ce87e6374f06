"""Hand-computed boundary cases and identities between estimators, on every backend."""
import pytest
import torch

import rl_triton
from cases import BACKENDS, make_case, rel_err

G, L = 0.5, 0.5


def t(*rows):
    """A [T, 1] float tensor from T numbers."""
    return torch.tensor(rows, dtype=torch.float32)[:, None]


def flags(*rows):
    return torch.tensor(rows, dtype=torch.bool)[:, None]


def close(a, expected):
    assert torch.allclose(a.cpu(), t(*expected), atol=1e-6, rtol=1e-6), (a.flatten(), expected)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


R, V, LAST = t(1.0, 2.0, 3.0), t(0.5, 1.0, 1.5), torch.tensor([2.0])


def _gae(term, trunc, backend, device):
    args = [x.to(device) for x in (R, V, term)]
    return rl_triton.gae(*args, None if trunc is None else trunc.to(device),
                         last_value=LAST.to(device), gamma=G, lam=L, backend=backend)


def test_gae_by_hand(backend, device):
    none = flags(0, 0, 0)
    # delta = [1 + .5*1 - .5, 2 + .5*1.5 - 1, 3 + .5*2 - 1.5] = [1, 1.75, 2.5]; gamma*lam = .25
    adv, ret = _gae(none, None, backend, device)
    close(adv, [1 + 0.25 * (1.75 + 0.25 * 2.5), 1.75 + 0.25 * 2.5, 2.5])
    close(ret, [1 + 0.25 * 2.375 + 0.5, 2.375 + 1.0, 2.5 + 1.5])
    # termination at t=1: no successor value there, trace cut
    adv, _ = _gae(flags(0, 1, 0), None, backend, device)
    close(adv, [1 + 0.25 * 1.0, 2 - 1.0, 2.5])
    # truncation at t=1: successor value V[2] = 1.5 kept, trace cut
    adv, _ = _gae(none, flags(0, 1, 0), backend, device)
    close(adv, [1 + 0.25 * 1.75, 1.75, 2.5])
    # termination at the last step: last_value ignored
    adv, _ = _gae(flags(0, 0, 1), None, backend, device)
    close(adv, [1 + 0.25 * (1.75 + 0.25 * 1.5), 1.75 + 0.25 * 1.5, 3 - 1.5])
    # truncation at the last step: same as the window end
    adv, _ = _gae(none, flags(0, 0, 1), backend, device)
    close(adv, [1 + 0.25 * 2.375, 2.375, 2.5])


def test_lambda_returns_by_hand(backend, device):
    # G2 = 3 + .5*2 = 4; G1 = 2 + .5*(.5*1.5 + .5*4) = 3.375; G0 = 1 + .5*(.5*1 + .5*3.375)
    g = rl_triton.lambda_returns(R.to(device), V.to(device), flags(0, 0, 0).to(device),
                                 last_value=LAST.to(device), gamma=G, lam=L, backend=backend)
    close(g, [1 + 0.5 * (0.5 + 0.5 * 3.375), 3.375, 4.0])
    g = rl_triton.lambda_returns(R.to(device), V.to(device), flags(0, 1, 0).to(device),
                                 last_value=LAST.to(device), gamma=G, lam=L, backend=backend)
    close(g, [1 + 0.5 * (0.5 + 0.5 * 2.0), 2.0, 4.0])


def test_discounted_returns_by_hand(backend, device):
    r, no = R.to(device), flags(0, 0, 0).to(device)
    close(rl_triton.discounted_returns(r, no, gamma=G, backend=backend), [2.75, 3.5, 3.0])
    close(rl_triton.discounted_returns(r, no, last_value=LAST.to(device), gamma=G,
                                       backend=backend), [3.0, 4.0, 4.0])
    close(rl_triton.discounted_returns(r, flags(1, 0, 0).to(device), gamma=G, backend=backend),
          [1.0, 3.5, 3.0])
    # truncation at t=0 without next_values: bootstrap zero, trace cut
    close(rl_triton.discounted_returns(r, no, flags(1, 0, 0).to(device), gamma=G,
                                       backend=backend), [1.0, 3.5, 3.0])
    # with next_values: bootstrap next_values[0] = 10
    close(rl_triton.discounted_returns(r, no, flags(1, 0, 0).to(device),
                                       next_values=t(10.0, 0.0, 0.0).to(device), gamma=G,
                                       backend=backend), [6.0, 3.5, 3.0])


def test_vtrace_by_hand(backend, device):
    r, v, no = t(1.0, 1.0).to(device), t(0.0, 0.0).to(device), flags(0, 0).to(device)
    lv = torch.zeros(1, device=device)
    zero = t(0.0, 0.0).to(device)
    vs, pg = rl_triton.vtrace(r, v, no, zero, zero, last_value=lv, gamma=1.0, backend=backend)
    close(vs, [2.0, 1.0])
    close(pg, [2.0, 1.0])
    # target twice as likely at t=0: rho_0 clipped to 1, c_0 clipped to 1; pg clipped to 1
    tlp = t(float(torch.log(torch.tensor(2.0))), 0.0).to(device)
    vs, pg = rl_triton.vtrace(r, v, no, tlp, zero, last_value=lv, gamma=1.0, backend=backend)
    close(vs, [2.0, 1.0])
    # without clipping: delta_0 = 2 * 1, c_0 = 2 -> vs_0 = 2 + 2 * 1 = 4; pg_0 = 2 * (1 + 1)
    vs, pg = rl_triton.vtrace(r, v, no, tlp, zero, last_value=lv, gamma=1.0, rho_clip=5.0,
                              c_clip=5.0, pg_rho_clip=5.0, backend=backend)
    close(vs, [4.0, 1.0])
    close(pg, [4.0, 1.0])
    # half the target probability at t=1: vs_1 = .5, vs_0 = 1 + .5 * 1 ... with lam = 1
    tlp = t(0.0, float(torch.log(torch.tensor(0.5)))).to(device)
    vs, pg = rl_triton.vtrace(r, v, no, tlp, zero, last_value=lv, gamma=1.0, backend=backend)
    close(vs, [1.0 + 0.5, 0.5])
    close(pg, [1.0 + 0.5, 0.5])


def test_retrace_by_hand(backend, device):
    # two steps, two actions; pi uniform, mu(a_t) = 1 -> c = lam * min(1, .5) = .5
    r = t(1.0, 1.0).to(device)
    q = torch.tensor([[[1.0, 3.0]], [[2.0, 4.0]]], device=device)
    pi = torch.full((2, 1, 2), 0.5, device=device)
    actions = torch.tensor([[0], [1]], device=device)
    mu = torch.ones(2, 1, device=device)
    lq, lpi = torch.tensor([[6.0, 2.0]], device=device), torch.tensor([[0.25, 0.75]],
                                                                          device=device)
    no = flags(0, 0).to(device)
    g, adv = rl_triton.retrace(r, q, actions, pi, mu, no, last_q_values=lq,
                               last_target_probs=lpi, gamma=1.0, lam=1.0, backend=backend,
                               return_advantages=True)
    # G1 = 1 + E_last = 1 + (1.5 + 1.5) = 4
    # G0 = 1 + E_1 + c_1 * (G1 - Q(s1, a1)) = 1 + 3 + .5 * (4 - 4) = 4
    close(g, [4.0, 4.0])
    close(adv, [4.0 - 1.0, 4.0 - 4.0])
    g = rl_triton.retrace(r, q, actions, pi, mu, flags(1, 0).to(device), last_q_values=lq,
                          last_target_probs=lpi, gamma=1.0, backend=backend)
    close(g, [1.0, 4.0])


def test_forward_scans_by_hand(backend, device):
    dones = flags(0, 1, 0, 0).to(device)
    z = rl_triton.eligibility_traces(t(1.0, 1.0, 1.0, 1.0).to(device), dones, gamma=1.0, lam=0.5,
                                     backend=backend)
    close(z, [1.0, 1.5, 1.0, 1.5])
    c = rl_triton.episodic_cumsum(t(1.0, 2.0, 3.0, 4.0).to(device), dones, backend=backend)
    close(c, [1.0, 3.0, 3.0, 7.0])
    c = rl_triton.episodic_cumsum(t(1.0, 2.0, 3.0, 4.0).to(device), dones,
                                  initial=torch.tensor([10.0], device=device), backend=backend)
    close(c, [11.0, 13.0, 3.0, 7.0])


def test_linear_scan_by_hand(backend, device):
    a, b = t(1.0, 2.0, 3.0).to(device), t(0.5, 2.0, -1.0).to(device)
    close(rl_triton.linear_scan(a, b, backend=backend), [1 + 0.5 * (2 + 2 * 3), 8.0, 3.0])
    close(rl_triton.linear_scan(a, b, initial=torch.tensor([1.0], device=device),
                                backend=backend), [1 + 0.5 * (2 + 2 * 2), 6.0, 2.0])
    close(rl_triton.linear_scan(a, b, reverse=False, backend=backend), [1.0, 4.0, -1.0])


# ---- identities ------------------------------------------------------------------------------

def _successor(values, last_value):
    return torch.cat([values[1:], last_value[None]])


def test_gae_lambda_one_is_monte_carlo_advantage(backend, device):
    c = make_case("gae", 150, (6,), device=device, seed=41)
    s, lv = c.steps, c.extra["last_value"]
    adv, _ = rl_triton.gae(**s, last_value=lv, gamma=0.97, lam=1.0, backend=backend)
    mc = rl_triton.discounted_returns(s["rewards"], s["terminated"], s["truncated"],
                                      next_values=_successor(s["values"], lv), gamma=0.97,
                                      backend=backend)
    assert rel_err(adv, mc - s["values"].float()) < 1e-5


def test_gae_returns_equal_lambda_returns(backend, device):
    c = make_case("gae", 150, (6,), device=device, seed=43)
    _, ret = rl_triton.gae(**c.steps, **c.extra, backend=backend)
    lr = rl_triton.lambda_returns(**c.steps, **c.extra, backend=backend)
    assert rel_err(ret, lr) < 1e-5


def test_onpolicy_vtrace_lambda_one_is_lambda_return(backend, device):
    c = make_case("gae", 150, (6,), device=device, seed=47)
    lp = torch.randn(c.steps["rewards"].shape, device=device)
    vs, _ = rl_triton.vtrace(**c.steps, target_log_probs=lp, behavior_log_probs=lp,
                             last_value=c.extra["last_value"], gamma=0.97, lam=1.0,
                             backend=backend)
    lr = rl_triton.lambda_returns(**c.steps, last_value=c.extra["last_value"], gamma=0.97,
                                  lam=1.0, backend=backend)
    assert rel_err(vs, lr) < 1e-5


def test_retrace_lambda_zero_is_expected_sarsa(backend, device):
    c = make_case("retrace", 80, (4,), device=device, seed=53)
    s, e = c.steps, c.extra
    g = rl_triton.retrace(**s, last_q_values=e["last_q_values"],
                          last_target_probs=e["last_target_probs"], gamma=0.9, lam=0.0,
                          backend=backend)
    expected = (s["target_probs"] * s["q_values"]).sum(-1)
    expected = torch.cat([expected[1:], (e["last_target_probs"] * e["last_q_values"]).sum(-1)[None]])
    target = s["rewards"] + 0.9 * (~s["terminated"]) * expected
    assert rel_err(g, target) < 1e-5


def test_retrace_onpolicy_state_values_is_bootstrapped_return(backend, device):
    c = make_case("retrace", 80, (4,), device=device, seed=59)
    s, e = c.steps, c.extra
    state_v = torch.randn(s["rewards"].shape, device=device)
    q = state_v[..., None].expand_as(s["q_values"])  # Q(s, a) = V(s) for every a
    pi_taken = s["target_probs"].gather(-1, s["actions"][..., None]).squeeze(-1)
    last_v = torch.randn(s["rewards"].shape[1:], device=device)
    g = rl_triton.retrace(s["rewards"], q, s["actions"], s["target_probs"], pi_taken,
                          s["terminated"], s["truncated"],
                          last_q_values=last_v[..., None].expand_as(e["last_q_values"]),
                          last_target_probs=e["last_target_probs"], gamma=0.9, lam=1.0,
                          backend=backend)
    ret = rl_triton.discounted_returns(s["rewards"], s["terminated"], s["truncated"],
                                       next_values=_successor(state_v, last_v), gamma=0.9,
                                       backend=backend)
    assert rel_err(g, ret) < 1e-5
