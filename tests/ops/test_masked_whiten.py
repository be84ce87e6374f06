"""`masked_whiten` (docs/semantics.md §8): against its float64 reference (rl_triton/reference.py),
forward and backward, by hand, NaN isolation, whitening global over a 2-process gloo group; its
large shapes on a CUDA device (marked gpu_large). The checks it shares with other ops
(tests/ops/op_checks) run here for it too."""
from __future__ import annotations
import itertools
import os

import pytest
import torch
import torch.distributed as dist

import rl_triton
from rl_triton._core import plans
from rl_triton.ops import _whiten
from rl_triton.testing import leave_rank, spawn_ranks
import op_checks

OPS = ["masked_whiten"]
DEV = "cuda"  # the gpu_large tests' device


@pytest.fixture(autouse=True)
def triton_on_the_gpu(monkeypatch):
    """These tests build CPU tensors: the Triton path runs them in the interpreter on a CPU
    machine; on a CUDA machine (no interpreter) it runs them on the GPU, moved there and the
    results moved back (the gpu_large tests below have the GPU's own sizes)."""
    if not torch.cuda.is_available():
        return
    real = rl_triton.masked_whiten

    def on_gpu(x, mask=None, **kw):
        if kw.get("backend") != "triton" or not isinstance(x, torch.Tensor) or x.is_cuda:
            return real(x, mask, **kw)
        mask = mask.cuda() if isinstance(mask, torch.Tensor) else mask
        return real(x.cuda(), mask, **kw).cpu()

    monkeypatch.setattr(rl_triton, "masked_whiten", on_gpu)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("with_mask", [True, False])
def test_masked_whiten_matches_reference(shift_mean, with_mask):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 50, generator=g, dtype=torch.float64) * 3 + 2
    mask = torch.rand(6, 50, generator=g) < 0.6 if with_mask else None
    m = mask if with_mask else torch.ones_like(x, dtype=torch.bool)
    want = rl_triton.reference.masked_whiten(x, m, shift_mean=shift_mean)
    for backend in ("torch", "loop", "triton"):
        got = rl_triton.masked_whiten(x, mask, shift_mean=shift_mean, backend=backend,
                                      out_dtype=torch.float64)
        torch.testing.assert_close(got, want)
    kept = rl_triton.masked_whiten(x, mask, out_dtype=torch.float64)[m]
    torch.testing.assert_close(kept.mean(), torch.tensor(0.0, dtype=torch.float64), atol=1e-12,
                               rtol=0)
    torch.testing.assert_close(kept.var(), torch.tensor(1.0, dtype=torch.float64), atol=1e-6,
                               rtol=0)


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_masked_whiten_ignores_masked_positions(backend):
    x = torch.randn(4, 9)
    mask = torch.rand(4, 9) > 0.5
    dirty = x.masked_fill(~mask, float("nan"))
    out = rl_triton.masked_whiten(dirty, mask.to(torch.float32), backend=backend)
    torch.testing.assert_close(out, rl_triton.masked_whiten(x, mask, backend=backend))
    assert (out[~mask] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_masked_whiten_masked_nan_stays_out_of_gradients(backend):
    """A NaN at a masked position reaches neither the output nor any gradient; with nothing
    masked in, every gradient is 0."""
    x = torch.randn(4, 9, dtype=torch.float64)
    mask = torch.rand(4, 9) > 0.5
    dirty = x.masked_fill(~mask, float("nan")).requires_grad_()
    w = torch.randn(4, 9, dtype=torch.float64)
    kw = dict(backend=backend, out_dtype=torch.float64)
    (rl_triton.masked_whiten(dirty, mask, **kw) * w).sum().backward()
    clean = x.clone().requires_grad_()
    (rl_triton.masked_whiten(clean, mask, **kw) * w).sum().backward()
    torch.testing.assert_close(dirty.grad, clean.grad)
    assert (dirty.grad[~mask] == 0).all()
    none = x.clone().requires_grad_()
    rl_triton.masked_whiten(none, torch.zeros_like(mask), backend=backend).sum().backward()
    assert (none.grad == 0).all()


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_masked_whiten_nan_masked_in_makes_the_statistics_nan(backend):
    x = torch.randn(4, 9)
    mask = torch.rand(4, 9) > 0.5
    mask[1, 2] = True
    x[1, 2] = float("nan")
    out = rl_triton.masked_whiten(x, mask, backend=backend)
    assert out[mask].isnan().all() and (out[~mask] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_masked_whiten_gradcheck(backend):
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 7) > 0.3
    assert torch.autograd.gradcheck(
        lambda y: rl_triton.masked_whiten(y, mask, shift_mean=False, backend=backend,
                                          out_dtype=torch.float64), (x,))


# ---- masked_whiten's Triton kernels (the interpreter on the CPU) ----------------------------

MASKS = [None, torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32,
         torch.bfloat16]


@pytest.fixture(params=["one block", "many blocks", "many blocks, combining kernel"])
def blocks(request, monkeypatch):
    """The kernels' block sizes, or small ones: several programs per pass (a partial last
    one), and partials combined in several steps by the reduction's last program or (past
    LAST_MAX partials) by the combining kernel."""
    if request.param != "one block":
        monkeypatch.setattr(_whiten, "BLOCK", 16)
        monkeypatch.setattr(_whiten, "APPLY_BLOCK", 8)
        monkeypatch.setattr(_whiten, "COMBINE_BLOCK", 4)
        monkeypatch.setattr(_whiten, "LAST_BLOCK", 4)
        monkeypatch.setattr(_whiten, "LAST_MAX", 0 if "kernel" in request.param else 2**30)
    # a plan keeps the compiled kernels of its block sizes (scan.launch.launch's memo): fresh
    # plans for these sizes, and none of them left for the next test
    plans.clear_plans()
    yield request.param
    plans.clear_plans()


def whiten_inputs(shape, mask_dtype, dtype=torch.float32, seed=0, scale=3.0, shift=2.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)
    if mask_dtype is None:
        return x, None, torch.ones(shape, dtype=torch.bool)
    # 0/1, and other nonzero values (set, as 1): 2, -3 and for floats 0.5
    code = torch.randint(0, 5, shape, generator=g)
    values = torch.tensor([0, 1, 2, -3 if mask_dtype != torch.uint8 else 3, 0]).to(mask_dtype)
    if mask_dtype.is_floating_point:
        values[4] = 0.5
    mask = values[code]
    return x, mask, mask != 0


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("shape", [(1,), (37,), (333,), (5, 50), (3, 7, 11)])
@pytest.mark.parametrize("mask_dtype", MASKS, ids=str)
def test_masked_whiten_triton_matches_reference(shape, mask_dtype, blocks):
    x, mask, m = whiten_inputs(shape, mask_dtype)
    for shift_mean, corr in itertools.product([True, False], [0, 1]):
        kw = dict(shift_mean=shift_mean, std_correction=corr)
        got = rl_triton.masked_whiten(x, mask, **kw, backend="triton")
        want = rl_triton.reference.masked_whiten(x, m, **kw)
        if want.isnan().any():  # one element, std_correction=1: var = 0 / 0
            assert m.sum() == 1 and corr == 1
            assert torch.equal(got.isnan(), want.isnan()) and (got[~m] == 0).all()
        else:
            assert rel_err(got, want) < 1e-6, kw
        assert got.dtype == torch.float32 and got.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_masked_whiten_triton_dtypes(dtype, out_dtype, blocks):
    """bf16 / fp16 inputs in float32 arithmetic, float64 in float64; eps large enough to
    matter."""
    x, mask, m = whiten_inputs((6, 41), torch.bool, dtype=dtype)
    for eps in (1e-8, 0.3):
        kw = dict(eps=eps, shift_mean=eps > 1e-3)
        got = rl_triton.masked_whiten(x, mask, **kw, backend="triton", out_dtype=out_dtype)
        want = rl_triton.reference.masked_whiten(x, m, **kw)
        assert got.dtype == out_dtype
        tol = {torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-6}[out_dtype]
        if dtype == torch.float64 and out_dtype == torch.float64:
            tol = 1e-13
        assert rel_err(got, want) < tol, (eps, rel_err(got, want))


def test_masked_whiten_triton_far_from_zero_mean(blocks):
    """|mean| >> std: the centered statistics and x - mean in two parts keep float32 results
    at float32 rounding."""
    x, mask, m = whiten_inputs((7, 300), torch.bool, scale=1.0, shift=1e4)
    for shift_mean in (True, False):
        got = rl_triton.masked_whiten(x, mask, shift_mean=shift_mean, backend="triton")
        want = rl_triton.reference.masked_whiten(x, m, shift_mean=shift_mean)
        assert rel_err(got, want) < 1e-6


def whiten_grads(x, mask, backend, w, **kw):
    x = x.detach().clone().requires_grad_()
    y = rl_triton.masked_whiten(x, mask, backend=backend, out_dtype=x.dtype, **kw)
    (y * w).sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_dtype", [None, torch.bool, torch.float32], ids=str)
def test_masked_whiten_triton_gradients_match_torch(dtype, mask_dtype, blocks):
    x, mask, m = whiten_inputs((3, 23), mask_dtype, dtype=dtype, seed=4)
    w = torch.randn(x.shape, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for shift_mean, corr, eps in itertools.product([True, False], [0, 1, 2], [1e-8, 0.5]):
        kw = dict(shift_mean=shift_mean, std_correction=corr, eps=eps)
        y, dx = whiten_grads(x, mask, "triton", w, **kw)
        y_ref, dx_ref = whiten_grads(x, mask, "torch", w, **kw)
        assert rel_err(dx, dx_ref.double()) < tol, kw
        assert (dx[~m] == 0).all()


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_triton_gradcheck(shift_mean, blocks):
    x, mask, _ = whiten_inputs((2, 13), torch.int8, dtype=torch.float64, seed=5)
    x.requires_grad_()
    for corr, eps in ((1, 1e-8), (0, 0.7), (2, 1e-8)):
        assert torch.autograd.gradcheck(
            lambda y: rl_triton.masked_whiten(y, mask, shift_mean=shift_mean,
                                              std_correction=corr, eps=eps, backend="triton",
                                              out_dtype=torch.float64), (x,))


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_masked_whiten_edge_cases(backend):
    """Nothing masked in: zeros, zero gradients; one element; an empty tensor; a 0-d one."""
    x = torch.randn(3, 5, requires_grad=True)
    y = rl_triton.masked_whiten(x, torch.zeros(3, 5), backend=backend)
    y.sum().backward()
    assert (y == 0).all() and (x.grad == 0).all()
    one = torch.tensor([3.0])
    assert rl_triton.masked_whiten(one, backend=backend).isnan().all()  # var = 0 / 0
    assert rl_triton.masked_whiten(one, std_correction=0, backend=backend).eq(0).all()
    assert rl_triton.masked_whiten(one, shift_mean=False, std_correction=0,
                                   backend=backend).eq(3.0).all()
    assert rl_triton.masked_whiten(torch.empty(0, 4), backend=backend).shape == (0, 4)
    point = rl_triton.masked_whiten(torch.tensor(2.0), shift_mean=False, std_correction=0,
                                    backend=backend)
    assert point.shape == () and point == 2.0


def test_masked_whiten_triton_reads_any_layout_and_writes_nothing():
    """A column-major x (read in place: the output and gradient keep its layout), a mask laid
    out otherwise, a strided slice and a lazily negated view give the values and gradients of
    the contiguous call; no input, nor the output's gradient, is modified."""
    x, mask, _ = whiten_inputs((9, 40), torch.bool, seed=6)
    w = torch.randn(9, 40)
    want, want_dx = whiten_grads(x, mask, "torch", w)
    big = torch.zeros(9, 80)
    big[:, ::2] = x
    cases = [(x.t().contiguous().t(), mask), (x.clone(), mask.t().contiguous().t()),
             (big, mask)]
    for base, mv in cases:
        leaf = base.clone().requires_grad_() if base is not big else base.requires_grad_()
        xv = leaf[:, ::2] if base is big else leaf
        before = (leaf.detach().clone(), mv.clone(), w.clone())
        y = rl_triton.masked_whiten(xv, mv, backend="triton")
        (y * w).sum().backward()
        dx = leaf.grad[:, ::2] if base is big else leaf.grad
        torch.testing.assert_close(y, want)
        torch.testing.assert_close(dx, want_dx)
        if base is not big:
            assert y.stride() == xv.stride() and dx.stride() == xv.stride()
        assert all(torch.equal(a, b) for a, b in zip(before, (leaf.detach(), mv, w)))
    neg = torch._neg_view(-x)
    torch.testing.assert_close(rl_triton.masked_whiten(neg, mask, backend="triton"), want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_masked_whiten_fullgraph_compile(backend):
    """Inside torch.compile the torch backend's ops are traced, the Triton backend's kernels are
    the custom ops `torch.ops.rl_triton.masked_whiten` and `masked_whiten_backward`: one graph,
    the eager call's values and gradients."""
    x, mask, _ = whiten_inputs((4, 33), torch.bool, seed=7)
    w = torch.randn(4, 33)

    def step(x, mask):
        return rl_triton.masked_whiten(x * 2.0, mask, shift_mean=False, backend=backend) + 1.0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        leaf = x.clone().requires_grad_()
        y = fn(leaf, mask)
        (y * w).sum().backward()
        results.append((y.detach(), leaf.grad))
    (want, want_dx), (got, got_dx) = results
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_dx, want_dx)
    assert want_dx.abs().max() > 0.1


def test_outcome_ops_compile_to_their_custom_ops(device):
    """On the Triton backend inside torch.compile, group_advantages' kernel (group_size, no
    gradient) and masked_whiten are their custom ops (docs/semantics.md §1, Composability)."""
    x, mask, _ = whiten_inputs((4, 33), torch.bool, seed=3)
    x, mask, scores = x.to(device), mask.to(device), torch.randn(24, device=device)
    targets = []

    def backend(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    def step(x, mask, scores):
        return (rl_triton.masked_whiten(x, mask, backend="triton"),
                rl_triton.group_advantages(scores, group_size=4, backend="triton"))

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend=backend)(x, mask, scores)
    assert any("rl_triton.masked_whiten" in t for t in targets), targets
    assert any("rl_triton.group_advantages" in t for t in targets), targets
    for a, b in zip(got, step(x, mask, scores)):
        torch.testing.assert_close(a, b)


def test_masked_whiten_triton_refuses_second_order():
    x = torch.randn(10, dtype=torch.float64, requires_grad=True)
    y = rl_triton.masked_whiten(x, backend="triton", out_dtype=torch.float64)
    with pytest.raises(RuntimeError, match="second-order"):
        torch.autograd.grad((y * y.detach()).sum(), x, create_graph=True)


BACKENDS = ["torch", "loop", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [1e2, 1e4, -1e4])
def test_masked_whiten_far_from_zero_mean(offset, backend):
    """Float32 data whose mean is up to 1e4 times its spread: every backend matches the float64
    whitening of the same float32 values to 1e-5 (a float32 sum of squares: 0.1 at 1e4)."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(5, 37, generator=g, dtype=torch.float64) * 0.7 + offset).float()
    for mask in (None, torch.rand(5, 37, generator=g) < 0.6):
        m = torch.ones(5, 37, dtype=torch.bool) if mask is None else mask
        for shift_mean in (True, False):
            want = rl_triton.reference.masked_whiten(x.double(), m, shift_mean=shift_mean)
            got = rl_triton.masked_whiten(x, mask, shift_mean=shift_mean, backend=backend)
            assert rel_err(got, want) < 1e-5, (shift_mean, rel_err(got, want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_whiten_too_few_positions_is_nan(backend):
    """Fewer than 1 + std_correction positions set: the variance is undefined, NaN at the set
    positions (equal values or not), 0 elsewhere; enough of them: finite."""
    x = torch.tensor([1.5, 1.5, -2.0, 4.0, 0.25])
    for correction, n in itertools.product(range(4), range(5)):
        mask = torch.arange(5) < n
        y = rl_triton.masked_whiten(x, mask, std_correction=correction, backend=backend)
        assert (y[~mask] == 0).all(), (correction, n, y)
        if n <= correction:
            assert y[mask].isnan().all(), (correction, n, y)
        else:
            assert y.isfinite().all(), (correction, n, y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", ["WORLD", object(), 0], ids=["str", "object", "int"])
def test_masked_whiten_group_must_be_a_process_group(group, backend, monkeypatch):
    """A `group` that is not a process group: TypeError naming it, before any kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(_whiten, "_forward", refuse)
    with pytest.raises(TypeError, match="group must be a torch.distributed process group"):
        rl_triton.masked_whiten(torch.randn(4, 5, requires_grad=True), group=group,
                                backend=backend)


def test_masked_whiten_errors():
    with pytest.raises(RuntimeError, match="mask requires grad"):  # never a silent detach
        rl_triton.masked_whiten(torch.randn(3, 4), torch.ones(3, 4, requires_grad=True))
    with pytest.raises(ValueError, match="mask"):
        rl_triton.masked_whiten(torch.randn(3, 4), torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="x"):
        rl_triton.masked_whiten(torch.arange(4))
    with pytest.raises(TypeError, match="shift_mean"):
        rl_triton.masked_whiten(torch.randn(4), shift_mean=1)


def _whiten_rank(rank, world, path, out, backend):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(3 + rank, 11, generator=g, dtype=torch.float64) * (rank + 1))
    mask = torch.rand(x.shape, generator=g) < 0.7
    x.requires_grad_()
    # the Triton path: in the interpreter on a CPU machine, on the GPU where there is one
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    y = rl_triton.masked_whiten(x.to(dev), mask.to(dev), group=dist.group.WORLD,
                                backend=backend, out_dtype=torch.float64).cpu()
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)
    (y * w).sum().backward()
    # float32 data whose mean is 1e4 times its spread: the sums are centered first
    far = (torch.randn(4 + rank, 9, generator=g, dtype=torch.float64) + 1e4).float()
    y_far = rl_triton.masked_whiten(far.to(dev), group=dist.group.WORLD, backend=backend).cpu()
    # a rank without data still takes part in both all-reduces
    alone = x.detach()[:0 if rank else None].clone().requires_grad_()
    y_alone = rl_triton.masked_whiten(alone.to(dev), mask[:alone.shape[0]].to(dev),
                                      group=dist.group.WORLD, backend=backend,
                                      out_dtype=torch.float64).cpu()
    (y_alone * w[:alone.shape[0]]).sum().backward()
    torch.save({"x": x.detach(), "mask": mask, "y": y.detach(), "w": w, "grad": x.grad,
                "y_alone": y_alone.detach(), "grad_alone": alone.grad, "far": far,
                "y_far": y_far},
               os.path.join(out, f"rank{rank}.pt"))
    # both ranks done before either tears down (a rank whose peer left first aborted once on
    # the H200 machine: "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_masked_whiten_is_global_over_a_process_group(tmp_path, backend):
    """Two gloo processes: each rank's result (and gradient) equals that of whitening the
    concatenation of both ranks' data in one process (the Triton path: in the interpreter)."""
    world = 2
    stores = iter(range(2))  # a new file store for a second spawn (testing.spawn_ranks)
    spawn_ranks(_whiten_rank, lambda: (world, str(tmp_path / f"store{next(stores)}"),
                                       str(tmp_path), backend), world)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    x = torch.cat([p["x"] for p in parts]).requires_grad_()
    mask = torch.cat([p["mask"] for p in parts])
    y = rl_triton.masked_whiten(x, mask, out_dtype=torch.float64)
    (y * torch.cat([p["w"] for p in parts])).sum().backward()
    torch.testing.assert_close(torch.cat([p["y"] for p in parts]), y.detach())
    torch.testing.assert_close(torch.cat([p["grad"] for p in parts]), x.grad)
    first = parts[0]["x"].requires_grad_()
    y = rl_triton.masked_whiten(first, parts[0]["mask"], out_dtype=torch.float64)
    (y * parts[0]["w"]).sum().backward()
    torch.testing.assert_close(parts[0]["y_alone"], y.detach())
    torch.testing.assert_close(parts[0]["grad_alone"], first.grad)
    assert parts[1]["y_alone"].shape == (0, 11)
    far = torch.cat([p["far"] for p in parts]).double()
    want = rl_triton.reference.masked_whiten(far, torch.ones_like(far, dtype=torch.bool))
    assert rel_err(torch.cat([p["y_far"] for p in parts]), want) < 1e-5


def large_inputs(shape, mask_dtype=torch.bool, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=g, device=device) * 3 + 2).to(dtype)
    if mask_dtype is None:
        return x, None, torch.ones(shape, dtype=torch.bool, device=device)
    m = torch.rand(shape, generator=g, device=device) < 0.7
    return x, m.to(mask_dtype), m


@pytest.mark.parametrize("shape", [(2**25,), (3 * 2**20 + 7,), (512, 4095), (16, 131072)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.bool, None, torch.float32], ids=str)
@pytest.mark.gpu_large
def test_masked_whiten_matches_float64_reference(shape, dtype, mask_dtype):
    x, mask, m = large_inputs(shape, mask_dtype, dtype)
    for shift_mean in (True, False):
        got = rl_triton.masked_whiten(x, mask, shift_mean=shift_mean)  # auto: the kernels
        want = rl_triton.reference.masked_whiten(x, m, shift_mean=shift_mean)
        assert rel_err(got, want) < 1e-5


@pytest.mark.gpu_large
def test_masked_whiten_far_from_zero_mean_large():
    x, mask, m = large_inputs((2**22 + 3,))
    x = x + 1e4
    assert rel_err(rl_triton.masked_whiten(x, mask), rl_triton.reference.masked_whiten(x, m)) < 1e-5


@pytest.mark.parametrize("shape", [(2**24,), (1000, 1001)])
@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.gpu_large
def test_masked_whiten_gradients(shape, shift_mean):
    x, mask, m = large_inputs(shape, seed=1)
    w = torch.randn(shape, device=DEV)
    leaf = x.clone().requires_grad_()
    (rl_triton.masked_whiten(leaf, mask, shift_mean=shift_mean) * w).sum().backward()
    ref = x.double().requires_grad_()
    (rl_triton.masked_whiten(ref, mask, shift_mean=shift_mean, backend="torch",
                             out_dtype=torch.float64) * w).sum().backward()
    assert rel_err(leaf.grad, ref.grad) < 1e-5
    assert (leaf.grad[~m] == 0).all()


@pytest.mark.gpu_large
def test_masked_whiten_64bit_indexing():
    """More than 2^31 elements (bfloat16 +-1, alternating): offsets in 64 bits, and 2^18
    partials for the last program to combine."""
    n = 2**31 + 5
    x = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    x[1::2] = -1
    y = rl_triton.masked_whiten(x, out_dtype=torch.float32)
    mean = 1 / n  # one more +1 than -1
    rstd = ((n - n * mean * mean) / (n - 1) + 1e-8) ** -0.5
    for i in (0, 1, n // 2 + 1, n - 2, n - 1):
        want = ((1.0 if i % 2 == 0 else -1.0) - mean) * rstd
        assert abs(y[i].item() - want) < 1e-6, i
    del x, y


@pytest.mark.gpu_large
def test_masked_whiten_launches():
    """Two Triton launches forward (the reduction's last program combines the blocks); two backward
    (with the float64 sum of the partials)."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata)

    x, mask, _ = large_inputs((4096, 33))
    rl_triton.masked_whiten(x.requires_grad_(), mask).sum().backward()  # compile first
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        y = rl_triton.masked_whiten(x, mask)
        forward = len(seen)
        y.sum().backward()
    finally:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert forward == 2 and len(seen) == 4


@pytest.mark.parametrize("layout", ["contiguous", "transposed-view"])
@pytest.mark.gpu_large
def test_masked_whiten_no_hidden_copies(layout):
    """Device memory grows by the output and the partials (a few kB) alone."""
    x, mask, _ = large_inputs((4096, 1024))
    if layout == "transposed-view":
        x, mask = x.t().contiguous().t(), mask.t().contiguous().t()
    rl_triton.masked_whiten(x, mask)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = rl_triton.masked_whiten(x, mask)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= y.numel() * 4 + 2**20
    assert y.stride() == x.stride()


@pytest.mark.gpu_large
def test_masked_whiten_cuda_graph_replay():
    x, mask, _ = large_inputs((1000, 77), seed=2)
    static_x, static_m = x.clone(), mask.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rl_triton.masked_whiten(static_x, static_m)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rl_triton.masked_whiten(static_x, static_m)
    for seed in (3, 4):
        x, mask, m = large_inputs((1000, 77), seed=seed)
        static_x.copy_(x)
        static_m.copy_(mask)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, rl_triton.reference.masked_whiten(x, m)) < 1e-5


@pytest.mark.gpu_large
def test_masked_whiten_torch_compile_fullgraph():
    """Inside torch.compile (Inductor) the kernels are the custom op: no graph break."""
    x, mask, m = large_inputs((64, 300), seed=5)

    def step(x, mask):
        return rl_triton.masked_whiten(x * 2.0, mask) + 1.0

    got = torch.compile(step, fullgraph=True)(x, mask)
    assert rel_err(got - 1.0, rl_triton.reference.masked_whiten(x * 2.0, m)) < 1e-5


@pytest.mark.gpu_large
def test_masked_whiten_other_device_index():
    idx = torch.cuda.device_count() - 1
    x, mask, m = large_inputs((300, 41), device=f"cuda:{idx}", seed=6)
    leaf = x.clone().requires_grad_()
    y = rl_triton.masked_whiten(leaf, mask)
    y.sum().backward()
    assert y.device == x.device and leaf.grad.device == x.device
    assert rel_err(y, rl_triton.reference.masked_whiten(x, m)) < 1e-5


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
