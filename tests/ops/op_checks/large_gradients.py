"""On a CUDA device only (marked gpu_large; shared checks, run in each op's module): gradients at
long rows and many rows, inside torch.compile with Inductor, and in a captured CUDA graph of
forward plus backward (semantics §5 and 6).

Large shapes are checked against autograd through the vectorized torch backend in float64.
"""
import pytest
import torch

from cases import ESTIMATORS, per_op, rel_err
from op_checks.gradients import call, differentiable, grads, weights_like

DEV = "cuda"


def _against_torch64(name, T, batch, layout, tol=5e-4, **kw):
    case, leaves = differentiable(name, T, batch, dtype=torch.float32, device=DEV, **kw)
    out = call(case, leaves, list(leaves.values()), layout, backend="triton")
    weights = weights_like(out)
    got = grads(out, weights, leaves)
    ref_case, ref_leaves = differentiable(name, T, batch, dtype=torch.float64, device=DEV, **kw)
    ref = call(ref_case, ref_leaves, list(ref_leaves.values()), "time-major", backend="torch",
               out_dtype=torch.float64)
    want = grads(ref, weights, ref_leaves)
    for k in want:
        err = rel_err(got[k], want[k])
        assert err < tol, f"d {k}: relative error {err:.3g}"


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("T,batch", [(2**20, (1,)), (16, (2**20,)), (3 * 2**15 + 5, (3,))])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.gpu_large
def test_backward_large_shapes(name, T, batch, layout):
    # V-trace's and Retrace's clipped ratios: among 2^24 steps some ratios lie within float32
    # rounding of a clip, where the float32 and float64 sides of the derivative's jump differ
    # (measured: V-trace d target_log_probs 7.8e-4 at 16 x 2^20)
    tol = 2e-3 if name in ("vtrace", "retrace") else 5e-4
    _against_torch64(name, T, batch, layout, tol=tol, per_row=True, p_term=0.001,
                     p_trunc=0.001)


@per_op("name", ["gae", "vtrace", "linear_scan_reverse"])
@pytest.mark.gpu_large
def test_backward_one_row_of_2_pow_24_steps(name):
    _against_torch64(name, 2**24, (1,), "batch-major", p_term=1e-4, p_trunc=1e-4)


@per_op("name", ESTIMATORS)
@pytest.mark.gpu_large
def test_backward_inductor_fullgraph(name):
    case, leaves = differentiable(name, 256, (64,), dtype=torch.float32, device=DEV,
                                  per_row=True)
    weights = [w.float() for w in weights_like(call(case, leaves, list(leaves.values()),
                                                    "batch-major", backend="triton"))]

    def loss(*values):
        out = call(case, leaves, values, "batch-major", backend="triton")
        return sum((o * w).sum() for o, w in zip(out, weights))

    eager = torch.autograd.grad(loss(*leaves.values()), list(leaves.values()), allow_unused=True)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*leaves.values()),
                              list(leaves.values()), allow_unused=True)
    for k, e, g in zip(leaves, eager, got):
        if e is not None:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=k)


@per_op("name", ["gae", "vtrace", "retrace", "eligibility_traces"])
@pytest.mark.parametrize("T,n", [(128, 256), (8192, 4)])  # one tile per row; look-back
@pytest.mark.gpu_large
def test_cuda_graph_forward_and_backward(name, T, n):
    """Forward and backward captured in one CUDA graph, replayed on new inputs copied in."""
    case, leaves = differentiable(name, T, (n,), dtype=torch.float32, device=DEV)
    if name == "retrace":
        case.extra["check_actions"] = False  # no sync inside the capture
    static = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    weights = [w.float() for w in weights_like(call(case, leaves, list(leaves.values()),
                                                    "time-major", backend="triton"))]

    def step():
        out = call(case, static, list(static.values()), "time-major", backend="triton")
        return torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)),
                                   list(static.values()))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and plan outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (6, 7):
        new, new_leaves = differentiable(name, T, (n,), dtype=torch.float32, device=DEV,
                                         seed=seed)
        if name == "retrace":
            new.extra["check_actions"] = False
        for k, v in new_leaves.items():
            static[k].data.copy_(v.detach())
        for k, v in new.steps.items():  # flags and actions
            if k not in new_leaves and v is not None:
                case.steps[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = grads(call(new, new_leaves, list(new_leaves.values()), "time-major",
                          backend="triton"), weights, new_leaves)
        for k, g in zip(static, captured):
            torch.testing.assert_close(g, want[k].float(), rtol=1e-5, atol=1e-5, msg=k)


@per_op("name", ESTIMATORS)
@pytest.mark.gpu_large
def test_no_grad_forward_records_nothing(name):
    """Without an input requiring grad the call is the forward of today: the plan's own
    launch, no custom-op dispatch, no graph, nothing saved."""
    case, leaves = differentiable(name, 128, (64,), dtype=torch.float32, device=DEV)
    values = [v.detach() for v in leaves.values()]
    before = torch.cuda.memory_allocated()
    out = call(case, leaves, values, "time-major", backend="triton")
    assert all(o.grad_fn is None for o in out)
    assert torch.cuda.memory_allocated() - before <= sum(
        o.numel() * o.element_size() for o in out) + 2**20
