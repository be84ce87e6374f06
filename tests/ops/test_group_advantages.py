"""`group_advantages` (docs/semantics.md §8): every backend against its float64 reference
(rl_triton/reference.py) and by hand, gradcheck, NaN isolation, masked tokens, the kernel and its
inputs, errors, and the kernel at large sizes on a CUDA device (marked gpu_large). The checks it
shares with other ops (tests/ops/op_checks: what a mask removes reaches nothing) run here too."""
import itertools

import pytest
import torch

import rl_triton
from cases import rel_err
import op_checks

OPS = ["group_advantages"]
DEV = "cuda"  # the gpu_large tests' device


OPTIONS = list(itertools.product(["mean", "leave_one_out"], ["std", "none", "batch_std"],
                                 [0, 1]))


def scores_and_ids(B=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 9, (B,), generator=g) * 7 - 20  # any ids, any order, some alone
    return s, ids


@pytest.mark.parametrize("baseline,scale,corr", OPTIONS)
@pytest.mark.parametrize("backend", ["torch", "loop", "auto"])
def test_group_advantages_match_reference(baseline, scale, corr, backend):
    s, ids = scores_and_ids()
    kw = dict(baseline=baseline, scale=scale, std_correction=corr, eps=1e-6)
    got = rl_triton.group_advantages(s, ids, **kw, backend=backend, out_dtype=torch.float64)
    _, dense = torch.unique(ids, return_inverse=True)
    want = rl_triton.reference.group_advantages(s, dense, **kw)
    torch.testing.assert_close(got, want)


def test_group_advantages_by_hand():
    s = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 20.0])
    a = rl_triton.group_advantages(s, group_size=3, eps=0.0)  # GRPO: (s - mu) / sigma
    torch.testing.assert_close(a, torch.tensor([-1.0, 0.0, 1.0, -0.9072, -0.1650, 1.0722]),
                               atol=1e-4, rtol=0)
    loo = rl_triton.group_advantages(s, group_size=3, baseline="leave_one_out", scale="none")
    torch.testing.assert_close(loo[:3], torch.tensor([1 - 2.5, 2 - 2.0, 3 - 1.5]))
    one = rl_triton.group_advantages(torch.tensor([5.0, 1.0, 2.0]),
                                     torch.tensor([7, 3, 3]), scale="none")
    torch.testing.assert_close(one, torch.tensor([5.0, -0.5, 0.5]))  # alone: baseline 0


def test_group_index_and_group_size_agree():
    s, _ = scores_and_ids(B=32)
    ids = torch.arange(32) // 4
    perm = torch.randperm(32)
    by_size = rl_triton.group_advantages(s, group_size=4, out_dtype=torch.float64)
    by_index = rl_triton.group_advantages(s[perm], ids[perm] + 100, out_dtype=torch.float64)
    torch.testing.assert_close(by_index, by_size[perm])


@pytest.mark.parametrize("backend", ["triton", "torch", "loop"])
def test_numpy_group_size(backend, device):
    """group_size as a NumPy integer, as every backend's check accepts it (the kernel's launch
    took only a Python int)."""
    import numpy as np
    s = scores_and_ids(B=12)[0].float().to(device)  # (float32: the kernel's)
    want = rl_triton.group_advantages(s, group_size=4, backend=backend)
    for n in (np.int64(4), np.int32(4)):
        torch.testing.assert_close(rl_triton.group_advantages(s, group_size=n, backend=backend),
                                   want)


@pytest.mark.parametrize("backend", ["triton", "torch", "loop"])
def test_scores_far_above_their_spread(backend, device):
    """float32 scores whose mean is 1e3 to 1e5 times their spread: every option within 1e-5 of
    float64 (the statistics shifted by a group's first score), both ways of giving groups."""
    g = torch.Generator().manual_seed(3)
    for level in (1e3, 1e5):
        s = (level + torch.randn(48, generator=g, dtype=torch.float64)).float()
        ids = torch.arange(48) // 6
        for baseline, scale, corr in OPTIONS:
            kw = dict(baseline=baseline, scale=scale, std_correction=corr)
            want = rl_triton.reference.group_advantages(s.double(), ids, **kw)
            for groups in (dict(group_size=6), dict(group_index=ids.to(device))):
                got = rl_triton.group_advantages(s.to(device), **groups, **kw, backend=backend)
                assert rel_err(got, want) < 1e-5, (level, kw, groups)


@pytest.mark.parametrize("backend", ["triton", "torch", "loop"])
def test_empty_scores_keep_their_gradient(backend, device):
    """No response at all: an empty result in the graph of the scores (a zero gradient)."""
    dev = device if backend == "triton" else "cpu"
    s = torch.zeros(0, requires_grad=True, device=dev)
    for groups in (dict(group_size=4),
                   dict(group_index=torch.zeros(0, dtype=torch.long, device=dev))):
        a = rl_triton.group_advantages(s, **groups, backend=backend)
        assert a.shape == (0,) and a.requires_grad
        assert torch.autograd.grad(a.sum(), s)[0].shape == (0,)


def test_group_advantages_nan_stays_in_its_group():
    s = torch.tensor([1.0, float("nan"), 3.0, 4.0, 5.0, 7.0])
    a = rl_triton.group_advantages(s, group_size=3)
    assert a[:3].isnan().all() and a[3:].isfinite().all()
    assert rl_triton.group_advantages(s, group_size=3, scale="batch_std").isnan().all()


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_group_advantages_masked_tokens_stay_zero(bad, backend, device):
    """A non-finite score makes its group's set tokens non-finite (the formula uses it), and
    leaves its masked-out tokens 0 (a select, not NaN * 0), by group_size (the kernel) and by
    group ids alike."""
    dev = device if backend == "triton" else "cpu"  # the kernel on the GPU where there is one
    s = torch.tensor([1.0, bad, 3.0, 4.0, 5.0, 7.0], device=dev)
    mask = torch.tensor([[1, 0], [0, 0], [1, 1], [1, 0], [0, 1], [1, 1]], dtype=torch.uint8,
                        device=dev)
    for kw in (dict(group_size=3), dict(group_index=torch.tensor([0, 0, 0, 1, 1, 1], device=dev))):
        a = rl_triton.group_advantages(s, **kw, mask=mask, backend=backend)
        assert (a[mask == 0] == 0).all(), a
        assert not a[:3][mask[:3] != 0].isfinite().any() and a[3:].isfinite().all(), a


def test_group_advantages_broadcast_to_tokens():
    s = torch.tensor([1.0, 2.0, 3.0, 6.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.uint8)
    a = rl_triton.group_advantages(s, group_size=2)
    torch.testing.assert_close(rl_triton.group_advantages(s, group_size=2, mask=mask),
                               a[:, None] * mask)


def group_rows(B, n, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 4, (B,), generator=g).double() + 0.3 * torch.randn(B, generator=g)
    return s.to(device=device, dtype=dtype), torch.arange(B, device=device) // n


def kernel_calls(monkeypatch):
    """Counts the calls that reach group_advantages' kernel (so that a test of the Triton
    backend cannot pass on the torch ops)."""
    from rl_triton.ops import _group
    calls = []
    real = _group.group_advantages
    monkeypatch.setattr(_group, "group_advantages", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("B,n", [(1, 1), (5, 5), (5, 1), (50, 5), (333, 3), (48, 16), (37, 37),
                                 (2 * 1024, 1024)])
@pytest.mark.parametrize("baseline,scale,corr", OPTIONS)
def test_group_kernel_matches_reference(B, n, baseline, scale, corr, monkeypatch, device):
    """The Triton kernel of consecutive groups against the float64 reference; float32
    cancellation within a tight group bounds both backends alike, so the kernel is held to
    the torch backend's float32 error."""
    calls = kernel_calls(monkeypatch)
    s, ids = group_rows(B, n, seed=B + n)
    kw = dict(baseline=baseline, scale=scale, std_correction=corr, eps=1e-6)
    got = rl_triton.group_advantages(s.to(device), group_size=n, **kw, backend="triton").cpu()
    assert calls == [1]
    want = rl_triton.reference.group_advantages(s.double(), ids, **kw)
    ours = rl_triton.group_advantages(s, group_size=n, **kw, backend="torch").double()
    torch.testing.assert_close(got.double(), ours, rtol=1e-5, atol=1e-5, equal_nan=True)
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite())
    err = (got.double() - want)[finite].abs()
    assert (err <= 2 * (ours - want)[finite].abs() + 1e-5 * (1 + want[finite].abs())).all()


def test_group_kernel_inputs(monkeypatch, device):
    """bfloat16 and strided scores, NaN confined to its group, groups of one, an empty batch,
    and the calls it leaves to the torch ops: scores needing gradients (which get them),
    float64, groups by index, groups beyond one tile."""
    from rl_triton.ops import _group
    calls = kernel_calls(monkeypatch)
    s, ids = group_rows(60, 6, device=device)
    half = rl_triton.group_advantages(s.bfloat16(), group_size=6, backend="triton")
    torch.testing.assert_close(half, rl_triton.reference.group_advantages(
        s.bfloat16().double(), ids).float(), rtol=1e-4, atol=1e-5)
    wide = torch.stack([s, torch.full_like(s, float("nan"))], 1)
    torch.testing.assert_close(rl_triton.group_advantages(wide[:, 0], group_size=6, backend="triton"),
                               rl_triton.group_advantages(s, group_size=6, backend="torch"))
    s[7] = float("nan")
    a = rl_triton.group_advantages(s, group_size=6, backend="triton")
    assert a[6:12].isnan().all() and a[:6].isfinite().all() and a[12:].isfinite().all()
    torch.testing.assert_close(rl_triton.group_advantages(s, group_size=1, backend="triton"), s,
                               equal_nan=True)
    assert rl_triton.group_advantages(s[:0], group_size=2, backend="triton").shape == (0,)
    assert len(calls) == 5
    leaf = s.clone().nan_to_num_().requires_grad_()
    rl_triton.group_advantages(leaf, group_size=6, backend="triton").pow(2).sum().backward()
    assert leaf.grad is not None and leaf.grad.isfinite().all()
    rl_triton.group_advantages(s.double(), group_size=6, backend="triton")
    rl_triton.group_advantages(s, ids, backend="triton")
    big = torch.randn(2 * (_group.MAX_GROUP + 1), device=device)
    rl_triton.group_advantages(big, group_size=_group.MAX_GROUP + 1, backend="triton")
    assert len(calls) == 5


def test_group_advantages_errors():
    s = torch.randn(6)
    with pytest.raises(RuntimeError, match="mask requires grad"):  # never a silent detach
        rl_triton.group_advantages(s, group_size=2, mask=torch.ones(6, 3, requires_grad=True))
    with pytest.raises(ValueError, match="exactly one"):
        rl_triton.group_advantages(s)
    with pytest.raises(ValueError, match="group_size"):
        rl_triton.group_advantages(s, group_size=4)
    with pytest.raises(ValueError, match="baseline"):
        rl_triton.group_advantages(s, group_size=2, baseline="median")
    with pytest.raises(ValueError, match="scale"):
        rl_triton.group_advantages(s, group_size=2, scale="mad")
    with pytest.raises(ValueError, match="group_index"):
        rl_triton.group_advantages(s, torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="group_index"):
        rl_triton.group_advantages(s, torch.zeros(6))
    with pytest.raises(ValueError, match="mask"):
        rl_triton.group_advantages(s, group_size=2, mask=torch.ones(5, 3))
    with pytest.raises(ValueError, match="scores"):
        rl_triton.group_advantages(s[None], group_size=2)
    with pytest.raises(TypeError, match="scores"):
        rl_triton.group_advantages(torch.arange(6), group_size=2)


def test_group_advantages_gradcheck():
    s, ids = scores_and_ids(B=12)
    s.requires_grad_()
    for baseline, scale, corr in OPTIONS:
        assert torch.autograd.gradcheck(
            lambda x: rl_triton.group_advantages(x, ids, baseline=baseline, scale=scale,
                                                 std_correction=corr,
                                                 out_dtype=torch.float64), (s,))


def rel_err(got, want):
    return ((got.double().to(want.device) - want).norm() / want.norm()).item()


@pytest.mark.parametrize("B,n", [(65536, 8), (65536 * 3, 3), (1024 * 1024, 1024), (5, 1)])
@pytest.mark.parametrize("scale", ["std", "none", "batch_std"])
@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.gpu_large
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


@pytest.mark.gpu_large
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


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
