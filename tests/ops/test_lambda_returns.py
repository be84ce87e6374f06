"""`lambda_returns` (docs/semantics.md §3): by hand, a Dreamer-style actor trained through it on
every backend, and a meta-gradient that learns lambda. The checks every scan op shares
(tests/ops/op_checks: every backend, layout and dtype against the float64 reference, gradcheck and
the Triton backward, masks, packed rows, non-finite inputs, large shapes) run here for it too."""
import torch

import rl_triton
from by_hand import G, L, LAST, R, V, close, flags
from by_hand import backend  # noqa: F401 (a fixture: every backend)
from cases import make_case
import op_checks

OPS = ["lambda_returns"]


# ---- by hand -------------------------------------------------------------------------------------

def test_lambda_returns_by_hand(backend, device):
    # G2 = 3 + .5*2 = 4; G1 = 2 + .5*(.5*1.5 + .5*4) = 3.375; G0 = 1 + .5*(.5*1 + .5*3.375)
    g = rl_triton.lambda_returns(R.to(device), V.to(device), flags(0, 0, 0).to(device),
                                 last_value=LAST.to(device), gamma=G, lam=L, backend=backend)
    close(g, [1 + 0.5 * (0.5 + 0.5 * 3.375), 3.375, 4.0])
    g = rl_triton.lambda_returns(R.to(device), V.to(device), flags(0, 1, 0).to(device),
                                 last_value=LAST.to(device), gamma=G, lam=L, backend=backend)
    close(g, [1 + 0.5 * (0.5 + 0.5 * 2.0), 2.0, 4.0])


# ---- training through it (semantics §6) ----------------------------------------------------------

def test_dreamer_actor_trains_the_same_on_every_backend(device):
    """A tiny Dreamer-style actor, trained through `-lambda_returns(...).mean()`: the same
    parameters after training on every backend, and a better return than at the start."""
    T, N, D = 16, 8, 3
    g = torch.Generator().manual_seed(0)
    states = torch.randn(T, N, D, generator=g).to(device)
    target = 0.8 * torch.tanh(states @ torch.randn(D, generator=g).to(device))  # reachable
    terminated = (torch.rand(T, N, generator=g) < 0.1).to(device)
    critic = torch.randn(D, generator=g).to(device)

    def train(backend):
        w = torch.zeros(D, device=device, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.5)
        first = None
        for _ in range(40):
            actions = torch.tanh(states @ w)
            rewards = -(actions - target) ** 2
            values = states @ critic + actions  # a critic that sees the action
            G = rl_triton.lambda_returns(rewards, values, terminated, last_value=values[-1],
                                         gamma=0.9, lam=0.8, backend=backend)
            loss = -G.mean()
            first = loss.item() if first is None else first
            opt.zero_grad()
            loss.backward()
            opt.step()
        return w.detach().cpu(), first, loss.item()

    runs = {b: train(b) for b in ("loop", "torch", "triton")}
    w_ref, first, last = runs["loop"]
    assert last < 0.5 * first  # it learned
    for b, (w, _, _) in runs.items():
        torch.testing.assert_close(w, w_ref, atol=1e-4, rtol=1e-4, msg=b)


def test_meta_gradient_learns_lambda(device):
    """A per-row lambda that requires grad gets its gradient: descending it moves the
    lambda-returns towards a target computed with another lambda (semantics §6 example)."""
    case = make_case("lambda_returns", 32, (4,), device=device, seed=9)
    s, e = case.steps, case.extra
    target = rl_triton.lambda_returns(**s, last_value=e["last_value"], gamma=0.97, lam=0.3)
    lam = torch.full((4,), 0.9, device=device, requires_grad=True)
    opt = torch.optim.Adam([lam], lr=0.05)
    for _ in range(60):
        G = rl_triton.lambda_returns(**s, last_value=e["last_value"], gamma=0.97, lam=lam)
        loss = ((G - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            lam.clamp_(0.0, 1.0)
    torch.testing.assert_close(lam.detach().cpu(), torch.full((4,), 0.3), atol=0.05, rtol=0)


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
