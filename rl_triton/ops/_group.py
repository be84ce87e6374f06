"""`group_advantages`' Triton path (semantics §8) for consecutive groups (`group_size`): one launch.

Each program holds a tile of whole groups, [groups, group_size] (the size padded to a power of
two), and computes every group's sum, mean and centered sum of squares in registers (shifted by
the group's first score), then the advantages: no index_add round trips, no host sync.
Arithmetic is float32 (bfloat16 / float16 scores are widened). `scale="batch_std"` divides by
the std of all scores, one torch reduction before the launch, read by the kernel from the
device. Launched as the scans are (`scan.launch.launch`: the compiled kernel after the first
call).
"""
from __future__ import annotations

import torch

from ..scan.jit import cdiv, next_power_of_2, tl, triton
from ..scan.launch import launch

Tensor = torch.Tensor
MAX_GROUP = 1024  # larger groups keep the torch path (one tile holds a whole group)
TILE = 2048  # scores per program
WARPS = 4
SCALES = {"none": 0, "std": 1, "batch_std": 2}
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _group_kernel(s_ptr, stride, denom_ptr, out_ptr, G, n, eps, correction,
                  LOO: tl.constexpr, SCALE: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_N)
    ok = (g[:, None] < G) & (j[None, :] < n)
    i = g[:, None] * n + j[None, :]
    x = tl.load(s_ptr + i * stride, mask=ok, other=0.0).to(tl.float32)
    # shifted by the group's first score (exact differences where scores are within 2x): a
    # float32 mean of scores whose mean is far above their spread keeps their digits
    c = tl.sum(tl.where(j[None, :] == 0, x, 0.0), axis=1)
    c = tl.where(tl.abs(c) <= FLT_MAX, c, 0.0)  # (a non-finite one: no shift)
    y = tl.where(ok, x - c[:, None], 0.0)
    total = tl.sum(y, axis=1)
    d = tl.where(ok, y - (total / n)[:, None], 0.0)
    if LOO:  # the mean of the others: (sum - s) / (n - 1), shifted alike
        a = y - (total[:, None] - y) / (n - 1)
    else:
        a = d
    if SCALE == 1:
        var = tl.sum(d * d, axis=1) / tl.maximum(n - correction, 0)
        a = a / (tl.sqrt(var)[:, None] + eps)
    elif SCALE == 2:
        a = a / tl.load(denom_ptr)
    a = tl.where(n == 1, x, a)  # a group of one: baseline 0, scale 1
    tl.store(out_ptr + i, a, mask=ok)


def batch_std(s: Tensor, correction: int) -> Tensor:
    """The std of all scores `s`, shifted by the first (where finite) as the groups' statistics
    are: the digits of a mean far above the spread stay."""
    c = s[:1].detach()
    return torch.std(s - torch.where(c.isfinite(), c, 0.0), correction=correction)


def usable(s: Tensor, group_size: int) -> bool:
    """Whether the kernel takes these scores: float32 or narrower, groups of at most
    MAX_GROUP (float64 and larger groups keep the torch path)."""
    return s.dtype is not torch.float64 and group_size <= MAX_GROUP


def group_advantages(s: Tensor, group_size: int, *, baseline: str, scale: str, eps: float,
                     std_correction: int, memo=None) -> Tensor:
    """float32 advantages of scores `s` [B] in consecutive groups of `group_size` (`memo`: the
    plan's, `scan.launch.launch`)."""
    B = s.shape[0]
    out = torch.empty(B, dtype=torch.float32, device=s.device)
    if B == 0:
        return out
    denom = out  # not read unless scale="batch_std"
    if scale == "batch_std":
        denom = (batch_std(s.float(), std_correction) + eps).reshape(1)
    G = B // group_size
    block_n = next_power_of_2(group_size)
    block_g = max(1, TILE // block_n)
    launch(_group_kernel, cdiv(G, block_g),
           (s, s.stride(0), denom, out, G, group_size, float(eps), float(std_correction)),
           s.device, memo, LOO=baseline == "leave_one_out", SCALE=SCALES[scale], BLOCK_G=block_g,
           BLOCK_N=block_n, num_warps=WARPS)
    return out
