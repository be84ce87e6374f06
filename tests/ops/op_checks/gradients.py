"""Gradients (semantics §6), checks shared by the scan ops (run in each op's module): every op is
differentiable with respect to every floating input on every backend, gamma and lam may be
per-row tensors, second-order gradients raise, nothing is ever silently detached.

The torch and loop backends are checked by `torch.autograd.gradcheck` in float64; the Triton
backward (its own kernels) against the float64 autograd gradient of the sequential references.
"""
import pytest
import torch

from cases import ESTIMATORS, make_case, per_op, rel_err, to_layout
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
@per_op("name", ESTIMATORS)
def test_gradcheck(name, bootstrap, trunc, per_row, layout, backend):
    """float64 gradcheck of every input that requires grad, per-row gamma / lam included."""
    case, leaves = differentiable(name, 5, (2,), bootstrap=bootstrap, trunc=trunc,
                                  per_row=per_row)

    def fn(*values):
        return call(case, leaves, values, layout, backend=backend, out_dtype=torch.float64)

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()))


def triton_vs_reference(name, T, batch, layout, *, dtype=torch.float32, tol=1e-4,
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
@per_op("name", ESTIMATORS)
def test_triton_backward_matches_reference(name, T, batch, layout, device):
    triton_vs_reference(name, T, batch, layout, device=device)


@per_op("name", ESTIMATORS)
def test_triton_backward_every_option(name, device):
    """next_values, no truncations, per-row gamma and lam."""
    triton_vs_reference(name, 29, (3,), "batch-major", bootstrap="next_values", trunc=False,
                         per_row=True, device=device)
    triton_vs_reference(name, 29, (3,), "time-major", per_row=True, device=device)


@per_op("name", ESTIMATORS)
def test_triton_backward_bf16(name, device):
    """bf16 inputs: gradients in bf16, computed in float32."""
    triton_vs_reference(name, 37, (4,), "batch-major", dtype=torch.bfloat16, tol=2e-2,
                         device=device)


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_triton_backward_long_rows(name, layout, device):
    """Rows of six tiles: the backward scan's carries found by look-back and by walking."""
    for walk in (False, True):
        with tiles.override(block_t=16, block_b=2, window=16, walk=walk):
            triton_vs_reference(name, 5 * 16 + 7, (3,), layout, per_row=True, device=device)


@per_op("name", ["eligibility_traces", "episodic_cumsum"])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_triton_backward_trailing_features(name, layout, device):
    triton_vs_reference(name, 23, (3,), layout, features=(2, 3), per_row=True, device=device)


@per_op("name", ESTIMATORS)
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
@per_op("name", ESTIMATORS)
def test_second_order_raises(name, backend, device):
    case, leaves = differentiable(name, 6, (2,), dtype=torch.float32, device=device)
    out = call(case, leaves, list(leaves.values()), "time-major", backend=backend)
    first = next(iter(leaves.values()))
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        torch.autograd.grad(sum(o.sum() for o in out), first, create_graph=True)


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("bootstrap,trunc,per_row", PATTERNS)
@per_op("name", ESTIMATORS)
def test_every_input_gets_a_gradient(name, bootstrap, trunc, per_row, T, backend, device):
    """Every input that requires grad gets a gradient, zero where the formula does not read it
    (values beside next_values, a one-step Retrace's Q-values), never None: the same inputs on
    every backend (semantics §6)."""
    case, leaves = differentiable(name, T, (2,), bootstrap=bootstrap, trunc=trunc,
                                  per_row=per_row, dtype=torch.float32, device=device)
    out = call(case, leaves, list(leaves.values()), "time-major", backend=backend)
    got = torch.autograd.grad(sum(o.sum() for o in out), list(leaves.values()),
                              allow_unused=True)
    assert [k for k, g in zip(leaves, got) if g is None] == []


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
@per_op("name", ESTIMATORS)
def test_undefined_output_gradients(name, backend, device):
    """An output whose gradient is undefined (autograd's None, as gradcheck's
    check_undefined_grad passes) counts as a zero gradient: with every output's undefined, no
    input gets a nonzero gradient; with one output's, the others' gradients are those of the
    defined outputs alone."""
    undefined = torch._C._functions.UndefinedGrad()
    case, leaves = differentiable(name, 6, (2,), dtype=torch.float32, device=device)
    out = call(case, leaves, list(leaves.values()), "time-major", backend=backend)
    got = torch.autograd.grad([undefined(o) for o in out], list(leaves.values()),
                              [torch.ones_like(o) for o in out], allow_unused=True,
                              retain_graph=True)
    assert all(g is None or not g.any() for g in got)
    if len(out) == 2:
        want = torch.autograd.grad(out[0].sum(), list(leaves.values()), allow_unused=True,
                                   retain_graph=True)
        got = torch.autograd.grad(out[0].sum() + undefined(out[1]).sum(),
                                  list(leaves.values()), allow_unused=True)
        for g, w in zip(got, want):
            assert (g is None or not g.any()) if w is None else torch.equal(g, w)


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
@per_op("name", ESTIMATORS)
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


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
@per_op("name", ESTIMATORS)
def test_empty_inputs_get_zero_gradients(name, backend, device):
    """An empty time axis or batch: every input that requires grad (the bootstrap and per-row
    discounts, which are not empty, included) gets a zero gradient of its shape."""
    for T, batch in [(0, (3,)), (4, (0,))]:
        case, leaves = differentiable(name, T, batch, dtype=torch.float32, per_row=True,
                                      device=device)
        out = call(case, leaves, list(leaves.values()), "time-major", backend=backend)
        assert all(o.requires_grad and o.numel() == 0 for o in out)
        grads = torch.autograd.grad(sum(o.sum() for o in out), list(leaves.values()))
        for (k, v), g in zip(leaves.items(), grads):
            assert g.shape == v.shape and (g == 0).all(), k


@per_op("name", ESTIMATORS)
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
