"""Generalized advantage estimation, `gae` (docs/semantics.md §3): by hand and its identities with
the other estimators, out_dtype and the caller's layout, masks (by hand, dtypes, gradients, the
mask's checks), packed rows (offsets, gradients, per-row discounts), and on a CUDA device (marked
gpu_large) torch.compile, CUDA graphs and device indices. The checks every scan op shares
(tests/ops/op_checks: every backend, layout and dtype against the float64 reference, gradcheck and
the Triton backward, masks, packed rows, non-finite inputs, large shapes) run here for it too."""
import pytest
import torch

import rl_triton
from by_hand import G, L, LAST, R, V, close, flags, successor
from by_hand import backend  # noqa: F401 (a fixture: every backend)
from cases import BACKENDS, assert_close, make_case, rel_err, to_layout
import op_checks
from op_checks.masks import deleted, mask_rows, packed_inputs

OPS = ["gae"]
DEV = "cuda"  # the gpu_large tests' device


# ---- by hand, and identities with the other estimators -------------------------------------------

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


def test_gae_lambda_one_is_monte_carlo_advantage(backend, device):
    c = make_case("gae", 150, (6,), device=device, seed=41)
    s, lv = c.steps, c.extra["last_value"]
    adv, _ = rl_triton.gae(**s, last_value=lv, gamma=0.97, lam=1.0, backend=backend)
    mc = rl_triton.discounted_returns(s["rewards"], s["terminated"], s["truncated"],
                                      next_values=successor(s["values"], lv), gamma=0.97,
                                      backend=backend)
    assert rel_err(adv, mc - s["values"].float()) < 1e-5


def test_gae_returns_equal_lambda_returns(backend, device):
    c = make_case("gae", 150, (6,), device=device, seed=43)
    _, ret = rl_triton.gae(**c.steps, **c.extra, backend=backend)
    lr = rl_triton.lambda_returns(**c.steps, **c.extra, backend=backend)
    assert rel_err(ret, lr) < 1e-5


# ---- outputs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_dtype(out_dtype, backend, device):
    case = make_case("gae", 21, (4,), device=device)
    outs = case.call(backend=backend, out_dtype=out_dtype)
    assert all(o.dtype == out_dtype for o in outs)
    tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
    assert_close(outs, case.reference(), tol=tol)


def test_outputs_in_caller_layout(device):
    case = make_case("gae", 12, (7,), device=device)
    adv, ret = case.fn(**{k: to_layout(v, "transposed-view") for k, v in case.steps.items()},
                       **case.extra, time_dim=-1, backend="triton")
    assert adv.shape == (7, 12) and adv.is_contiguous() and ret.is_contiguous()


# ---- masks (semantics §7) ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float32])
def test_mask_dtypes_and_masked_inputs_are_ignored(dtype, device):
    """A mask is set wherever nonzero, whatever its dtype; NaN rewards, values and flags at
    masked steps change nothing."""
    T, N = 30, 5
    case = make_case("gae", T, (N,), device=device)
    mask = mask_rows(T, N, seed=1).to(device)
    want = deleted(case, mask)
    dirty = dict(case.steps)
    off = ~mask
    dirty["rewards"] = case.steps["rewards"].masked_fill(off, float("nan"))
    dirty["values"] = case.steps["values"].masked_fill(off, float("inf"))
    dirty["terminated"] = case.steps["terminated"] | off
    m = (mask.to(dtype) * (3 if dtype != torch.bool else 1))
    for backend in ("loop", "torch", "triton"):
        got = rl_triton.gae(**dirty, **case.extra, mask=m, backend=backend)
        assert_close(got, want)


def test_masked_gae_by_hand(device):
    """One row: decisions at t = 0, 2, 5 of 7; the successor of t = 0 is t = 2, and the trace
    decays once per decision step."""
    r = torch.tensor([[1.0], [9.0], [2.0], [9.0], [9.0], [3.0], [9.0]])
    v = torch.tensor([[0.5], [9.0], [0.25], [9.0], [9.0], [0.125], [9.0]])
    mask = torch.tensor([[1], [0], [1], [0], [0], [1], [0]], dtype=torch.bool)
    term = torch.zeros(7, 1, dtype=torch.bool)
    g, lam, last = 0.5, 0.5, torch.tensor([4.0])
    d5 = 3.0 + g * 4.0 - 0.125
    d2 = 2.0 + g * 0.125 - 0.25
    d0 = 1.0 + g * 0.25 - 0.5
    a5, a2 = d5, d2 + g * lam * d5
    a0 = d0 + g * lam * a2
    want = torch.tensor([[a0], [0], [a2], [0], [0], [a5], [0]])
    r, v, mask, term, last, want = (x.to(device) for x in (r, v, mask, term, last, want))
    for backend in ("loop", "torch", "triton"):
        adv, ret = rl_triton.gae(r, v, term, last_value=last, mask=mask, gamma=g, lam=lam,
                                 backend=backend)
        torch.testing.assert_close(adv, want)
        torch.testing.assert_close(ret, torch.where(mask, want + v, 0.0))


def test_mask_shape_is_checked():
    case = make_case("gae", 10, (4,))
    with pytest.raises(ValueError, match="mask"):
        case.call(mask=torch.ones(10, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        case.call(mask=[1, 0])


def test_masked_gradients_match_deletion(device):
    """Gradients through a masked call agree on every backend; masked rewards get none."""
    T, N = 21, 5
    case = make_case("gae", T, (N,), dtype=torch.float64, device=device)
    mask = mask_rows(T, N, seed=5).to(device)
    leaves = {k: case.steps[k].clone().requires_grad_() for k in ("rewards", "values")}
    lv = case.extra["last_value"].clone().requires_grad_()
    w = torch.randn(T, N, dtype=torch.float64, device=device)
    want = None
    for backend in ("loop", "torch", "triton"):
        steps = dict(case.steps, **leaves)
        adv, _ = rl_triton.gae(**steps, last_value=lv, mask=mask, gamma=0.97, lam=0.9,
                               backend=backend)
        got = torch.autograd.grad((adv * w).sum(), [*leaves.values(), lv])
        if want is None:
            want = got
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert torch.all(want[0][~mask] == 0)  # masked rewards do not matter


# ---- packed rows (semantics §7) ------------------------------------------------------------------

def test_packed_offsets_are_checked():
    r, v = torch.randn(6), torch.randn(6)
    term = torch.zeros(6, dtype=torch.bool)
    lv = torch.zeros(2)
    for bad in ([1, 3, 6], [0, 3, 5], [0, 4, 3, 6]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            rl_triton.gae(r, v, term, last_value=lv[:len(bad) - 1], cu_seqlens=torch.tensor(bad))
    with pytest.raises(TypeError, match="cu_seqlens"):
        rl_triton.gae(r, v, term, last_value=lv, cu_seqlens=torch.tensor([0.0, 3.0, 6.0]))
    with pytest.raises(ValueError, match="time_dim"):
        rl_triton.gae(r, v, term, last_value=lv, cu_seqlens=torch.tensor([0, 3, 6]),
                      time_dim=1)
    with pytest.raises(ValueError, match="last_value"):
        rl_triton.gae(r, v, term, last_value=torch.zeros(3), cu_seqlens=torch.tensor([0, 3, 6]))


def test_packed_gradients_flow(device):
    """Gradients through packed rows reach the packed inputs (and the per-segment bootstrap)
    as through each segment called alone."""
    lengths = [4, 0, 7, 2]
    cu = torch.tensor([0] + lengths).cumsum(0).to(device)
    L = sum(lengths)
    g = torch.Generator().manual_seed(0)
    r = torch.randn(L, generator=g, dtype=torch.float64).to(device).requires_grad_()
    v = torch.randn(L, generator=g, dtype=torch.float64).to(device).requires_grad_()
    lv = torch.randn(4, generator=g, dtype=torch.float64).to(device).requires_grad_()
    term = torch.zeros(L, dtype=torch.bool, device=device)
    adv, _ = rl_triton.gae(r, v, term, last_value=lv, cu_seqlens=cu, gamma=0.9, lam=0.8)
    got = torch.autograd.grad(adv.square().sum(), (r, v, lv))
    total = 0
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e > s:
            a, _ = rl_triton.gae(r[s:e, None], v[s:e, None], term[s:e, None],
                                 last_value=lv[i:i + 1], gamma=0.9, lam=0.8, backend="torch")
            total = total + a.square().sum()
    want = torch.autograd.grad(total, (r, v, lv))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_packed_kernel_offsets_are_checked(device, in_place):
    """Bad offsets raise ValueError naming cu_seqlens on the in-place path too, before any
    kernel; offsets of any integer dtype are read."""
    steps, extra, cu = packed_inputs("gae", [3, 3], False, device=device)
    for bad in ([1, 3, 6], [0, 3, 5], [0, 4, 3, 6]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            rl_triton.gae(**steps, last_value=torch.zeros(len(bad) - 1, device=device),
                          cu_seqlens=torch.tensor(bad), backend="triton")
    with pytest.raises(TypeError, match="cu_seqlens"):
        rl_triton.gae(**steps, **extra, cu_seqlens=cu.float(), backend="triton")
    with pytest.raises(ValueError, match="last_value"):
        rl_triton.gae(**{**steps, "truncated": None}, last_value=torch.zeros(3, device=device),
                      cu_seqlens=cu, backend="triton")
    want = rl_triton.gae(**steps, **extra, cu_seqlens=cu, backend="triton")
    for dtype in (torch.int16, torch.int32, torch.uint8):
        for a, b in zip(rl_triton.gae(**steps, **extra, cu_seqlens=cu.to(dtype),
                                      backend="triton"), want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_packed_gradients_run_the_torch_route(device):
    """A packed call that needs gradients runs the torch implementation on the packed row (the
    kernels' backward does not take segments yet): gradients reach the packed inputs on the
    Triton backend as on torch."""
    steps, extra, cu = packed_inputs("gae", [4, 0, 7, 2], True, device=device)
    steps = dict(steps, rewards=steps["rewards"].double().requires_grad_())
    grads = []
    for backend in ("triton", "torch"):
        adv, _ = rl_triton.gae(**steps, **extra, cu_seqlens=cu, backend=backend)
        grads.append(torch.autograd.grad(adv.square().sum(), steps["rewards"])[0])
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_packed_per_row_discounts_keep_the_padded_route(device):
    """gamma per segment (a tensor) runs as padded rows, as each segment alone."""
    steps, extra, cu = packed_inputs("gae", [4, 0, 7, 2], False, device=device)
    gamma = torch.tensor([0.9, 0.8, 0.7, 0.6], device=device)
    got = rl_triton.gae(**steps, **{**extra, "gamma": gamma}, cu_seqlens=cu, backend="triton")
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e > s:
            row = {k: None if v is None else v[s:e, None] for k, v in steps.items()}
            want = rl_triton.gae(**row, last_value=extra["last_value"][i:i + 1],
                                 gamma=gamma[i].item(), lam=extra["lam"], backend="torch")
            for a, b in zip(got, want):
                torch.testing.assert_close(a[s:e], b[:, 0])


# ---- on a CUDA device only (gpu_large) -----------------------------------------------------------

@pytest.mark.gpu_large
def test_torch_compile_fullgraph():
    case = make_case("gae", 128, (64,), device=DEV, seed=3)

    def step(r, v, term, trunc, lv):
        adv, ret = rl_triton.gae(r, v, term, trunc, last_value=lv)
        return (adv - adv.mean()) / (adv.std() + 1e-8), ret

    s = case.steps
    args = (s["rewards"], s["values"], s["terminated"], s["truncated"], case.extra["last_value"])
    compiled = torch.compile(step, fullgraph=True)
    for a, b in zip(compiled(*args), step(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,n", [(128, 256), (8192, 4)])  # one tile per row; look-back
@pytest.mark.gpu_large
def test_cuda_graph_replay(T, n):
    case = make_case("gae", T, (n,), device=DEV, seed=5)
    static = {k: v.clone() for k, v in case.steps.items()}
    lv = case.extra["last_value"].clone()
    params = dict(gamma=case.extra["gamma"], lam=case.extra["lam"])  # as the reference uses
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rl_triton.gae(**static, last_value=lv, **params)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        adv, ret = rl_triton.gae(**static, last_value=lv, **params)
    for seed in (6, 7, 8):
        new = make_case("gae", T, (n,), device=DEV, seed=seed)
        for k, v in new.steps.items():
            static[k].copy_(v)
        lv.copy_(new.extra["last_value"])
        graph.replay()
        torch.cuda.synchronize()
        assert_close((adv, ret), new.reference())


@pytest.mark.gpu_large
def test_other_device_index():
    """Tensors on the current device only are assumed nowhere: works on any visible index."""
    idx = torch.cuda.device_count() - 1
    case = make_case("gae", 64, (8,), device=f"cuda:{idx}")
    assert_close(case.call(backend="triton"), case.reference())


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
