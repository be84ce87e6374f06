"""On a CUDA device only: masked_whiten's kernels at large and odd sizes, their gradients,
64-bit indexing, launches, memory, CUDA graphs and device indices (semantics §8).

Large sizes are checked against the float64 reference (torch ops on the device) and gradients
against autograd through the torch backend in float64.
"""
import pytest
import torch

import rl_triton

DEV = "cuda"


def inputs(shape, mask_dtype=torch.bool, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=g, device=device) * 3 + 2).to(dtype)
    if mask_dtype is None:
        return x, None, torch.ones(shape, dtype=torch.bool, device=device)
    m = torch.rand(shape, generator=g, device=device) < 0.7
    return x, m.to(mask_dtype), m


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("shape", [(2**25,), (3 * 2**20 + 7,), (512, 4095), (16, 131072)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.bool, None, torch.float32], ids=str)
def test_masked_whiten_matches_float64_reference(shape, dtype, mask_dtype):
    x, mask, m = inputs(shape, mask_dtype, dtype)
    for shift_mean in (True, False):
        got = rl_triton.masked_whiten(x, mask, shift_mean=shift_mean)  # auto: the kernels
        want = rl_triton.reference.masked_whiten(x, m, shift_mean=shift_mean)
        assert rel_err(got, want) < 1e-5


def test_masked_whiten_far_from_zero_mean():
    x, mask, m = inputs((2**22 + 3,))
    x = x + 1e4
    assert rel_err(rl_triton.masked_whiten(x, mask), rl_triton.reference.masked_whiten(x, m)) < 1e-5


@pytest.mark.parametrize("shape", [(2**24,), (1000, 1001)])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_gradients(shape, shift_mean):
    x, mask, m = inputs(shape, seed=1)
    w = torch.randn(shape, device=DEV)
    leaf = x.clone().requires_grad_()
    (rl_triton.masked_whiten(leaf, mask, shift_mean=shift_mean) * w).sum().backward()
    ref = x.double().requires_grad_()
    (rl_triton.masked_whiten(ref, mask, shift_mean=shift_mean, backend="torch",
                             out_dtype=torch.float64) * w).sum().backward()
    assert rel_err(leaf.grad, ref.grad) < 1e-5
    assert (leaf.grad[~m] == 0).all()


def test_masked_whiten_64bit_indexing():
    """More than 2^31 elements (bfloat16 +-1, alternating): offsets in 64 bits, and 2^18
    partials for the combining program."""
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


def test_masked_whiten_launches():
    """Three Triton launches forward; two backward (with the float64 sum of the partials)."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata)

    x, mask, _ = inputs((4096, 33))
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
    assert forward == 3 and len(seen) == 5


@pytest.mark.parametrize("layout", ["contiguous", "transposed-view"])
def test_masked_whiten_no_hidden_copies(layout):
    """Device memory grows by the output and the partials (a few kB) alone."""
    x, mask, _ = inputs((4096, 1024))
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


def test_masked_whiten_cuda_graph_replay():
    x, mask, _ = inputs((1000, 77), seed=2)
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
        x, mask, m = inputs((1000, 77), seed=seed)
        static_x.copy_(x)
        static_m.copy_(mask)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, rl_triton.reference.masked_whiten(x, m)) < 1e-5


def test_masked_whiten_torch_compile_fullgraph():
    """Inside torch.compile (Inductor) the kernels are the custom op: no graph break."""
    x, mask, m = inputs((64, 300), seed=5)

    def step(x, mask):
        return rl_triton.masked_whiten(x * 2.0, mask) + 1.0

    got = torch.compile(step, fullgraph=True)(x, mask)
    assert rel_err(got - 1.0, rl_triton.reference.masked_whiten(x * 2.0, m)) < 1e-5


def test_masked_whiten_other_device_index():
    idx = torch.cuda.device_count() - 1
    x, mask, m = inputs((300, 41), device=f"cuda:{idx}", seed=6)
    leaf = x.clone().requires_grad_()
    y = rl_triton.masked_whiten(leaf, mask)
    y.sum().backward()
    assert y.device == x.device and leaf.grad.device == x.device
    assert rel_err(y, rl_triton.reference.masked_whiten(x, m)) < 1e-5


@pytest.mark.parametrize("B,n", [(65536, 8), (65536 * 3, 3), (1024 * 1024, 1024), (5, 1)])
@pytest.mark.parametrize("scale", ["std", "none", "batch_std"])
@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
def test_group_advantages_kernel(B, n, scale, baseline):
    """group_advantages' kernel (group_size) at large sizes against the float64 torch ops, in
    one launch."""
    from triton import knobs

    g = torch.Generator(device=DEV).manual_seed(B + n)
    s = torch.randint(0, 4, (B,), generator=g, device=DEV).float() + torch.randn(
        B, generator=g, device=DEV)
    kw = dict(group_size=n, scale=scale, baseline=baseline)
    rl_triton.group_advantages(s, **kw)  # compile first
    seen = []
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(seen.append)
    else:
        knobs.runtime.launch_enter_hook = seen.append
    try:
        got = rl_triton.group_advantages(s, **kw)
    finally:
        if hasattr(chain, "add"):
            chain.remove(seen.append)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 1
    want = rl_triton.group_advantages(s.double(), **kw, backend="torch", out_dtype=torch.float64)
    assert rel_err(got, want) < 1e-5


def test_group_advantages_kernel_specializations():
    """The kernel's compiled launch (`scan.launch.launch`) keys on what Triton specializes:
    strided and misaligned scores, groups of one and of 16, group counts of 1 and of 16, in
    turns (a kernel replayed on arguments it was not compiled for would give wrong results)."""
    g = torch.Generator(device=DEV).manual_seed(7)
    base = torch.randn(4 * 4096 + 64, generator=g, device=DEV)
    cases = [(base[:4096], 8), (base[1:4097], 8), (base[::2][:4096], 8), (base[::16][:64], 4),
             (base[:51], 3), (base[:16], 1), (base[:16], 16), (base[3:3 + 16 * 16], 16),
             (base[:2 ** 12 * 3], 3)]
    for _ in range(2):
        for s, n in cases:
            for scale in ("std", "batch_std"):
                kw = dict(group_size=n, scale=scale, baseline="leave_one_out" if n > 1 else "mean")
                got = rl_triton.group_advantages(s, **kw)
                want = rl_triton.group_advantages(s.double(), **kw, backend="torch",
                                                  out_dtype=torch.float64)
                assert rel_err(got, want) < 1e-5, (s.stride(), s.storage_offset(), n, scale)
