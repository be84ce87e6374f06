"""On a CUDA device only: long rows, many rows, 64-bit indexing, memory traffic, composability.

Large shapes are checked against the vectorized torch backend run in float64 (itself checked
against the sequential references at small shapes), since a Python loop over 2^20 steps is slow.
"""
import pytest
import torch

import rl_triton
from rl_triton.testing import vectorized
from cases import ESTIMATORS, assert_close, make_case

DEV = "cuda"


def float64_vectorized(case):
    return vectorized(case.name, **case.steps, **case.extra)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("T,batch", [(2**20, (1,)), (16, (2**20,)), (3 * 2**17 + 5, (3,))])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_large_shapes(name, T, batch, layout):
    n_act = 18
    case = make_case(name, T, batch, device=DEV, seed=T % 97, n_act=n_act, p_term=0.001,
                     p_trunc=0.001)
    assert_close(case.call(layout, backend="triton"), float64_vectorized(case))


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("T,batch", [(128, (256,)), (1000, (130,)), (4096, (300,)), (77, (1000,))])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_many_row_tiles_and_segments(name, T, batch, layout):
    """Several row tiles, each cut into several tiles along time (the default tile rule), with
    one program per tile (look-back) and one per row tile (walking the row)."""
    case = make_case(name, T, batch, device=DEV, seed=T + batch[0])
    assert_close(case.call(layout, backend="triton"), float64_vectorized(case))


@pytest.mark.parametrize("name", ["gae", "vtrace", "episodic_cumsum", "linear_scan_reverse"])
def test_one_row_of_2_pow_24_steps(name):
    case = make_case(name, 2**24, (1,), device=DEV, seed=1, p_term=1e-5, p_trunc=1e-5)
    assert_close(case.call("batch-major", backend="triton"), float64_vectorized(case))


@pytest.mark.parametrize("name,T,n,layout,full", [
    ("gae", 1024, 16384, "time-major", True),  # Triton 3.6: 64 -> 56 registers without masks
    ("vtrace", 2**20, 4, "batch-major", True),  # one-warp look-back tiles, 80 registers (capped)
    ("gae", 1000, 16384, "time-major", False),  # T not a multiple of the tile
])
def test_full_tiles_drop_their_masks_where_that_keeps_the_warps(name, T, n, layout, full,
                                                                monkeypatch):
    """A plan whose tiles divide the problem compiles its kernel with and without masks at its
    first launch and runs the one `launch.even_keeps_occupancy` picks (its rule: test_config.py);
    other plans keep their masks. Either way the results are exact."""
    from rl_triton._core import plans as _plans
    from rl_triton.scan import launch
    picked = []
    rule = launch.even_keeps_occupancy
    monkeypatch.setattr(launch, "even_keeps_occupancy",
                        lambda *a, **k: picked.append(rule(*a, **k)) or picked[-1])
    _plans._PLANS.clear()
    case = make_case(name, T, (n,), device=DEV, seed=3)
    assert_close(case.call(layout, backend="triton"), float64_vectorized(case))
    (plan,) = _plans._PLANS.values()
    assert picked == ([plan.meta["EVEN"]] if full else [])
    assert full or not plan.meta["EVEN"]


@pytest.mark.parametrize("beta,tol", [(0.999, 1e-5), (0.9999, 5e-5)])
def test_long_reverse_scan_without_boundaries(beta, tol):
    """A reverse scan whose carry crosses every tile (no cut anywhere).

    With beta = 0.9999 (a 10^4-step horizon) float32 rounding adds up: measured on 2^20 steps,
    the sequential float32 loop reaches 2.3e-6, the doubling scan 2.0e-5 (docs/benchmarks.md)
    and the earlier two-pass kernels 2.3e-5 (docs/dev/kernel-decisions.md); at realistic
    horizons the usual 1e-5 holds.
    """
    T = 2**20
    alpha = torch.randn(1, T, device=DEV)
    beta_t = torch.full((1, T), beta, device=DEV)
    out = rl_triton.linear_scan(alpha, beta_t, time_dim=1)
    (ref,) = vectorized("linear_scan", alpha=alpha.T, beta=beta_t.T, reverse=True)
    ref = ref.T
    assert_close((out,), (ref,), tol=tol)


def test_64bit_indexing():
    """More than 2^31 elements: offsets need 64 bits."""
    n, T, k = 2**21 + 5, 1024, 7
    x = torch.ones(n, T, device=DEV)
    t = torch.arange(T, device=DEV)
    dones = ((t % k) == k - 1).expand(n, T)  # a stride-0 view: read in place
    out = rl_triton.episodic_cumsum(x, dones, time_dim=1)
    expected = ((t % k) + 1).float()
    assert out.numel() > 2**31
    assert torch.equal(out[0], expected) and torch.equal(out[-1], expected)
    assert torch.equal(out[n // 2 + 3], expected)
    del x, out


@pytest.mark.parametrize("layout", ["time-major", "transposed-view", "batch-major"])
def test_no_hidden_copies(layout):
    """Device memory grows by the outputs alone (plus a few kB of carries)."""
    case = make_case("vtrace", 4096, (1024,), device=DEV)
    steps = {k: v if layout == "time-major" else (
        v.movedim(0, 1) if layout == "transposed-view" else v.movedim(0, 1).contiguous())
             for k, v in case.steps.items()}
    td = 0 if layout == "time-major" else 1
    rl_triton.vtrace(**steps, **case.extra, time_dim=td)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    outs = rl_triton.vtrace(**steps, **case.extra, time_dim=td)
    torch.cuda.synchronize()
    out_bytes = sum(o.numel() * o.element_size() for o in outs)
    assert torch.cuda.max_memory_allocated() - base <= out_bytes + 2**20


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


def test_other_device_index():
    """Tensors on the current device only are assumed nowhere: works on any visible index."""
    idx = torch.cuda.device_count() - 1
    case = make_case("gae", 64, (8,), device=f"cuda:{idx}")
    assert_close(case.call(backend="triton"), case.reference())


def test_one_signature_on_two_streams():
    """Look-back scratch is kept per stream: concurrent launches of one plan do not mix."""
    case = make_case("gae", 8192, (4,), device=DEV, seed=9)
    ref = case.reference()
    streams = [torch.cuda.Stream() for _ in range(2)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(4):
        for s in streams:
            with torch.cuda.stream(s):
                outs.append(case.call(backend="triton"))
    torch.cuda.synchronize()
    for out in outs:
        assert_close(out, ref)


@pytest.mark.parametrize("T,n,layout,rows", [
    (2**20, 4, "time-major", (1, 4)), (2**17, 32, "time-major", (2, 8, 32)),
    (2**17, 16, "batch-major", (1,)), (2**20, 4, "batch-major", (1,))])
def test_look_back_on_cold_launches(T, n, layout, rows):
    """Fresh plans, first launches: with look-back windows that replicated words across threads,
    replicas read at different moments gave relative errors of 1e-3 to 2e-2 on exactly these
    launches (docs/dev/kernel-decisions.md#the-window-no-word-held-by-two-threads). Every
    launch is checked, for tiles of one to 32 rows (the rule's window for each: one warp's worth
    for several rows, one word per thread for one)."""
    from rl_triton._core import plans as _plans
    from rl_triton.scan import tiles

    case = make_case("gae", T, (n,), device=DEV, seed=11, p_term=0.01, p_trunc=0.01)
    ref = float64_vectorized(case)
    for block_b in rows:
        for _ in range(3):
            _plans._PLANS.clear()
            with tiles.override(block_b=block_b, block_t=2048 // block_b, walk=False):
                for _ in range(3):
                    assert_close(case.call(layout, backend="triton"), ref)


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_look_back_without_cuts(layout):
    """beta close to 1 and no cut: every tile's carry depends on every tile before it, so the
    look-back must reach back to published values or to the start (fresh plans, cold launches)."""
    from rl_triton._core import plans as _plans

    T, n, td = 2**20, 4, 0 if layout == "time-major" else 1
    g = torch.Generator(device=DEV).manual_seed(3)
    shape = (T, n) if td == 0 else (n, T)
    a = torch.randn(shape, generator=g, device=DEV)
    b = 0.999 + 0.001 * torch.rand(shape, generator=g, device=DEV)
    for reverse in (True, False):
        (ref,) = vectorized("linear_scan", alpha=a.movedim(td, 0), beta=b.movedim(td, 0),
                            reverse=reverse)
        for _ in range(3):
            _plans._PLANS.clear()
            for _ in range(3):
                out = rl_triton.linear_scan(a, b, reverse=reverse, time_dim=td).movedim(td, 0)
                assert_close((out,), (ref,))


def test_launch_hooks_see_every_launch():
    """Profilers install Triton launch hooks; plans launch the compiled kernel directly and must
    call them as Triton's own launch path does."""
    from triton import knobs

    from rl_triton._core import plans as _plans

    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a chain of hooks (newer Triton)
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        _plans._PLANS.clear()
        case = make_case("gae", 4096, (4,), device=DEV)
        for _ in range(3):
            case.call(backend="triton")
    finally:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 3
    case.call(backend="triton")
    assert len(seen) == 3  # removed: not called
