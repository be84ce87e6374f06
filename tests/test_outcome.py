"""Group advantages and masked whitening (SPEC 8): against the float64 references, by hand, NaN
isolation, gradients, and whitening global over a 2-process gloo group."""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rl_triton

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


def test_group_advantages_nan_stays_in_its_group():
    s = torch.tensor([1.0, float("nan"), 3.0, 4.0, 5.0, 7.0])
    a = rl_triton.group_advantages(s, group_size=3)
    assert a[:3].isnan().all() and a[3:].isfinite().all()
    assert rl_triton.group_advantages(s, group_size=3, scale="batch_std").isnan().all()


def test_group_advantages_broadcast_to_tokens():
    s = torch.tensor([1.0, 2.0, 3.0, 6.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.uint8)
    a = rl_triton.group_advantages(s, group_size=2)
    torch.testing.assert_close(rl_triton.group_advantages(s, group_size=2, mask=mask),
                               a[:, None] * mask)


def test_group_advantages_errors():
    s = torch.randn(6)
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


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("with_mask", [True, False])
def test_masked_whiten_matches_reference(shift_mean, with_mask):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 50, generator=g, dtype=torch.float64) * 3 + 2
    mask = torch.rand(6, 50, generator=g) < 0.6 if with_mask else None
    m = mask if with_mask else torch.ones_like(x, dtype=torch.bool)
    want = rl_triton.reference.masked_whiten(x, m, shift_mean=shift_mean)
    for backend in ("torch", "loop"):
        got = rl_triton.masked_whiten(x, mask, shift_mean=shift_mean, backend=backend,
                                      out_dtype=torch.float64)
        torch.testing.assert_close(got, want)
    kept = rl_triton.masked_whiten(x, mask, out_dtype=torch.float64)[m]
    torch.testing.assert_close(kept.mean(), torch.tensor(0.0, dtype=torch.float64), atol=1e-12,
                               rtol=0)
    torch.testing.assert_close(kept.var(), torch.tensor(1.0, dtype=torch.float64), atol=1e-6,
                               rtol=0)


def test_masked_whiten_ignores_masked_positions():
    x = torch.randn(4, 9)
    mask = torch.rand(4, 9) > 0.5
    dirty = x.masked_fill(~mask, float("nan"))
    out = rl_triton.masked_whiten(dirty, mask.to(torch.float32))
    torch.testing.assert_close(out, rl_triton.masked_whiten(x, mask))
    assert (out[~mask] == 0).all()


def test_masked_whiten_masked_nan_stays_out_of_gradients():
    """A NaN at a masked position reaches neither the output nor any gradient; with nothing
    masked in, every gradient is 0."""
    x = torch.randn(4, 9, dtype=torch.float64)
    mask = torch.rand(4, 9) > 0.5
    dirty = x.masked_fill(~mask, float("nan")).requires_grad_()
    w = torch.randn(4, 9, dtype=torch.float64)
    (rl_triton.masked_whiten(dirty, mask, out_dtype=torch.float64) * w).sum().backward()
    clean = x.clone().requires_grad_()
    (rl_triton.masked_whiten(clean, mask, out_dtype=torch.float64) * w).sum().backward()
    torch.testing.assert_close(dirty.grad, clean.grad)
    assert (dirty.grad[~mask] == 0).all()
    none = x.clone().requires_grad_()
    rl_triton.masked_whiten(none, torch.zeros_like(mask)).sum().backward()
    assert (none.grad == 0).all()


def test_masked_whiten_gradcheck():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 7) > 0.3
    assert torch.autograd.gradcheck(
        lambda y: rl_triton.masked_whiten(y, mask, shift_mean=False, out_dtype=torch.float64),
        (x,))


def test_masked_whiten_errors():
    with pytest.raises(ValueError, match="mask"):
        rl_triton.masked_whiten(torch.randn(3, 4), torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="x"):
        rl_triton.masked_whiten(torch.arange(4))
    with pytest.raises(TypeError, match="shift_mean"):
        rl_triton.masked_whiten(torch.randn(4), shift_mean=1)


def _whiten_rank(rank, world, path, out):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(3 + rank, 11, generator=g, dtype=torch.float64) * (rank + 1))
    mask = torch.rand(x.shape, generator=g) < 0.7
    x.requires_grad_()
    y = rl_triton.masked_whiten(x, mask, group=dist.group.WORLD, out_dtype=torch.float64)
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)
    (y * w).sum().backward()
    torch.save({"x": x.detach(), "mask": mask, "y": y.detach(), "w": w, "grad": x.grad},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_masked_whiten_is_global_over_a_process_group(tmp_path):
    """Two gloo processes: each rank's result (and gradient) equals that of whitening the
    concatenation of both ranks' data in one process."""
    world = 2
    mp.spawn(_whiten_rank, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    x = torch.cat([p["x"] for p in parts]).requires_grad_()
    mask = torch.cat([p["mask"] for p in parts])
    y = rl_triton.masked_whiten(x, mask, out_dtype=torch.float64)
    (y * torch.cat([p["w"] for p in parts])).sum().backward()
    torch.testing.assert_close(torch.cat([p["y"] for p in parts]), y.detach())
    torch.testing.assert_close(torch.cat([p["grad"] for p in parts]), x.grad)
