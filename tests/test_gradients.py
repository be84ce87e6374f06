"""Gradients (semantics §6): every op is differentiable with respect to every floating input on
every backend, gamma and lam may be per-row tensors, second-order gradients raise, nothing is ever
silently detached.

The torch and loop backends are checked by `torch.autograd.gradcheck` in float64; the Triton
backward (its own kernels) against the float64 autograd gradient of the sequential references.
"""
import pytest
import torch

import rl_triton
from cases import ESTIMATORS, make_case, rel_err, to_layout
from rl_triton._core.plans import clear_plans
from rl_triton.scan import tiles

FLAGS = ("terminated", "truncated", "dones")
# (bootstrap, truncations, per-row discounts): every optional input, both bootstraps
PATTERNS = [("last_value", True, True), ("next_values", False, False)]


def differentiable(name, T, batch, *, dtype=torch.float64, per_row=False, **kw):
    """A case whose floating inputs (flags aside) are leaves that require grad, with gamma and
    lam per row where asked: (case, {name: leaf})."""
    case = make_case(name, T, batch, dtype=dtype, **{"p_term": 0.2, "p_trunc": 0.2, **kw})

    def leaf(t):
        return t.detach().to(dtype).requires_grad_()

    case.steps = {k: v if v is None or k in FLAGS or not v.is_floating_point() else leaf(v)
                  for k, v in case.steps.items()}
    case.extra = {k: leaf(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in case.extra.items()}
    if per_row:
        g = torch.Generator().manual_seed(5)
        for k in ("gamma", "lam"):
            if k in case.extra:  # one per row, around the scalar
                per = case.extra[k] - 0.1 * torch.rand(batch, generator=g, dtype=torch.float64)
                case.extra[k] = leaf(per.to(kw.get("device", "cpu")))
    leaves = {k: v for k, v in {**case.steps, **case.extra}.items()
              if isinstance(v, torch.Tensor) and v.requires_grad}
    return case, leaves


def call(case, leaves, values, layout, **kw):
    """The case's outputs (time-major) with `values` in place of its leaves."""
    sub = dict(zip(leaves, values))
    steps = {k: to_layout(sub.get(k, v), layout) for k, v in case.steps.items()}
    extra = {k: sub.get(k, v) for k, v in case.extra.items()}
    out = case.fn(**steps, **extra, time_dim=0 if layout == "time-major" else 1, **kw)
    out = out if isinstance(out, tuple) else (out,)
    return tuple(o if layout == "time-major" else o.movedim(1, 0) for o in out)


def reference_grads(case, leaves, weights):
    """d (sum_i weights[i] * out_i) / d leaves, through the float64 reference."""
    extra = {k: v for k, v in case.extra.items() if k != "return_advantages"}
    x = case.steps.get("x")
    if x is not None:  # per-row discounts over trailing feature axes
        tail = (1,) * (x.ndim - case.steps["dones"].ndim)
        extra = {k: v.reshape(v.shape + tail) if k in ("gamma", "lam") and
                 isinstance(v, torch.Tensor) else v for k, v in extra.items()}
    out = case.ref(**case.steps, **extra)
    out = out if isinstance(out, tuple) else (out,)
    return grads(out, weights, leaves)


def grads(outs, weights, leaves):
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), got)}


def weights_like(outs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device) for o in outs]


def assert_grads_close(got, want, tol):
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert got[k].dtype == want[k].dtype, (k, got[k].dtype, want[k].dtype)
        err = rel_err(got[k], want[k])
        assert err < tol, f"d {k}: relative error {err:.3g} >= {tol}"


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.parametrize("bootstrap,trunc,per_row", PATTERNS)
@pytest.mark.parametrize("name", ESTIMATORS)
def test_gradcheck(name, bootstrap, trunc, per_row, layout, backend):
    """float64 gradcheck of every input that requires grad, per-row gamma / lam included."""
    case, leaves = differentiable(name, 5, (2,), bootstrap=bootstrap, trunc=trunc,
                                  per_row=per_row)

    def fn(*values):
        return call(case, leaves, values, layout, backend=backend, out_dtype=torch.float64)

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()))


def _triton_vs_reference(name, T, batch, layout, *, dtype=torch.float32, tol=1e-4,
                         per_row=False, **kw):
    case, leaves = differentiable(name, T, batch, dtype=dtype, per_row=per_row, **kw)
    out = call(case, leaves, list(leaves.values()), layout, backend="triton")
    for o in out:
        assert o.requires_grad
    weights = weights_like(out)
    got = grads(out, weights, leaves)
    ref_case, ref_leaves = differentiable(name, T, batch, dtype=torch.float64, per_row=per_row,
                                          **kw)
    if dtype != torch.float64:  # the same (rounded) inputs in float64
        for k, v in ref_leaves.items():
            v.data.copy_(leaves[k].detach().double())
    want = reference_grads(ref_case, ref_leaves, weights)
    assert_grads_close(got, {k: want[k].to(leaves[k].dtype) for k in want}, tol)


SHAPES = [(37, (5,), "time-major"), (37, (5,), "batch-major"), (1, (3,), "time-major"),
          (333, (2,), "batch-major"), (41, (1,), "transposed-view")]


@pytest.mark.parametrize("T,batch,layout", SHAPES)
@pytest.mark.parametrize("name", ESTIMATORS)
def test_triton_backward_matches_reference(name, T, batch, layout, device):
    _triton_vs_reference(name, T, batch, layout, device=device)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_triton_backward_every_option(name, device):
    """next_values, no truncations, per-row gamma and lam."""
    _triton_vs_reference(name, 29, (3,), "batch-major", bootstrap="next_values", trunc=False,
                         per_row=True, device=device)
    _triton_vs_reference(name, 29, (3,), "time-major", per_row=True, device=device)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_triton_backward_bf16(name, device):
    """bf16 inputs: gradients in bf16, computed in float32."""
    _triton_vs_reference(name, 37, (4,), "batch-major", dtype=torch.bfloat16, tol=2e-2,
                         device=device)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_triton_backward_long_rows(name, layout, device):
    """Rows of six tiles: the backward scan's carries found by look-back and by walking."""
    for walk in (False, True):
        with tiles.override(block_t=16, block_b=2, window=16, walk=walk):
            _triton_vs_reference(name, 5 * 16 + 7, (3,), layout, per_row=True, device=device)


def test_vtrace_backward_sub_tiles(device):
    """V-trace's backward holds many values per step (`tiles.choose`'s `heavy`): its time-major
    tiles run one sub-tile per step a thread holds (2 at 8 values per thread: 512x4096 on an
    H200). Here 37 steps x 5 rows take 8 values per thread, so 2 sub-tiles (default: 1)."""
    with tiles.rule(ELEMENTS_PER_THREAD_HEAVY_TIME_MAJOR=8):
        cfg = tiles.choose(37, 5, time_contiguous=False, device=torch.device(device),
                           exclusive=True, aux=True, heavy=True)
        assert cfg.sub == 2, cfg
        clear_plans()  # plans keep the tiles of the rule they were built under
        try:
            _triton_vs_reference("vtrace", 37, (5,), "time-major", per_row=True, device=device)
        finally:
            clear_plans()


@pytest.mark.parametrize("n_act,storage,layout", [
    (8, "contiguous", "time-major"), (18, "offset", "time-major"), (18, "padded", "time-major"),
    (18, "contiguous", "batch-major"), (37, "contiguous", "batch-major")])
def test_retrace_backward_action_axis(n_act, storage, layout, device):
    """Retrace's backward reads Q and pi along their action axis in blocks in its writer and
    writes their gradients there: rows of 8 and 18 actions loaded 4 and 2 at a time
    (`launch.action_vector`), one at a time where they start 4 bytes into their storage or are
    padded to n_act + 1 values, and 37 actions in several blocks."""
    case, leaves = differentiable("retrace", 37, (5,), dtype=torch.float32, n_act=n_act,
                                  device=device)
    for k in ("q_values", "target_probs"):
        x = leaves[k].detach()
        if storage == "offset":
            y = torch.empty(x.numel() + 1, device=x.device)[1:].view(x.shape)
        elif storage == "padded":
            y = torch.empty(*x.shape[:-1], n_act + 1, device=x.device)[..., :n_act]
        else:
            y = torch.empty_like(x)
        leaves[k] = case.steps[k] = y.copy_(x).detach().requires_grad_()
    out = call(case, leaves, list(leaves.values()), layout, backend="triton")
    weights = weights_like(out)
    got = grads(out, weights, leaves)
    ref_case, ref_leaves = differentiable("retrace", 37, (5,), n_act=n_act, device=device)
    for k, v in ref_leaves.items():
        v.data.copy_(leaves[k].detach().double())
    want = reference_grads(ref_case, ref_leaves, weights)
    assert_grads_close(got, {k: v.float() for k, v in want.items()}, 1e-4)


@pytest.mark.parametrize("name", ["eligibility_traces", "episodic_cumsum"])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_triton_backward_trailing_features(name, layout, device):
    _triton_vs_reference(name, 23, (3,), layout, features=(2, 3), per_row=True, device=device)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_triton_backward_one_output_used(name, device):
    """Only one output carries a gradient (the other's is None in backward), and Retrace without
    return_advantages has one output."""
    case, leaves = differentiable(name, 19, (3,), dtype=torch.float32, device=device)
    ref_case, ref_leaves = differentiable(name, 19, (3,), dtype=torch.float64, device=device)
    out = call(case, leaves, list(leaves.values()), "time-major", backend="triton")
    weights = weights_like(out)
    for i in range(len(out)):
        w = [x if j == i else torch.zeros_like(x) for j, x in enumerate(weights)]
        out = call(case, leaves, list(leaves.values()), "time-major", backend="triton")
        got = grads(out[i:i + 1], w[i:i + 1], leaves)
        assert_grads_close(got, {k: v.float() for k, v in
                                 reference_grads(ref_case, ref_leaves, w).items()}, 1e-4)
    if "return_advantages" in case.extra:
        case.extra["return_advantages"] = False
        (ret,) = call(case, leaves, list(leaves.values()), "time-major", backend="triton")
        w = [weights[0]] + [torch.zeros_like(x) for x in weights[1:]]
        assert_grads_close(grads((ret,), w[:1], leaves),
                           {k: v.float() for k, v in
                            reference_grads(ref_case, ref_leaves, w).items()}, 1e-4)


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_second_order_raises(name, backend, device):
    case, leaves = differentiable(name, 6, (2,), dtype=torch.float32, device=device)
    out = call(case, leaves, list(leaves.values()), "time-major", backend=backend)
    first = next(iter(leaves.values()))
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        torch.autograd.grad(sum(o.sum() for o in out), first, create_graph=True)


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_never_detached(name, backend, device):
    """An input that requires grad gives outputs in the graph; a flag that requires grad is
    refused (flags are not differentiable); without grad nothing is recorded."""
    case, leaves = differentiable(name, 6, (2,), dtype=torch.float32, device=device)
    for k in leaves:
        values = [v if j == k else v.detach() for j, v in leaves.items()]
        out = call(case, leaves, values, "time-major", backend=backend)
        assert all(o.requires_grad for o in out), k
    with torch.no_grad():
        assert all(o.grad_fn is None for o in call(case, leaves, list(leaves.values()),
                                                    "time-major", backend=backend))
    flag = next((k for k in FLAGS if case.steps.get(k) is not None), None)
    if flag is None:  # linear_scan: no flags
        return
    case.steps[flag] = case.steps[flag].float().requires_grad_()
    with pytest.raises(RuntimeError, match=f"{flag} requires grad.*not differentiable"):
        call(case, leaves, list(leaves.values()), "time-major", backend=backend)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_fullgraph_compile_backward(name, device):
    """Forward and backward traced by torch.compile(fullgraph=True): the backward is registered
    on the custom op (no graph break), and gives the eager gradients."""
    case, leaves = differentiable(name, 23, (4,), dtype=torch.float32, per_row=True,
                                  device=device)
    weights = [w.float() for w in weights_like(call(case, leaves, list(leaves.values()),
                                                    "time-major", backend="triton"))]

    def loss(*values):
        out = call(case, leaves, values, "time-major", backend="triton")
        return sum((o * w).sum() for o, w in zip(out, weights))

    eager = torch.autograd.grad(loss(*leaves.values()), list(leaves.values()), allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*leaves.values()), list(leaves.values()),
                              allow_unused=True)
    for k, e, g in zip(leaves, eager, got):
        assert (e is None) == (g is None), k
        if e is not None:
            torch.testing.assert_close(g, e, msg=k)


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
