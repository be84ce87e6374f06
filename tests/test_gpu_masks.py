"""Masked calls (SPEC 7) at the benchmark's token shapes on the GPU: the kernels (one tile per
row, look-back over many tiles, walked rows) against the torch backend in float64."""
import pytest
import torch

from cases import make_case, rel_err, to_layout
from rl_triton import testing

NAMES = ["gae", "lambda_returns", "discounted_returns", "vtrace", "eligibility_traces",
         "episodic_cumsum"]


def multi_turn(T, N, seed=0):
    """Right-padded rows of alternating model turns and masked observation spans."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(T)
    turn = (pos // 97 + torch.randint(0, 2, (N, 1), generator=g)) % 2 == 0
    length = torch.randint(T // 2, T + 1, (N, 1), generator=g)
    return (turn & (pos < length)).T.contiguous()  # [T, N]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(512, 4096), (4, 1048576), (16384, 64)])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_large(name, shape, layout):
    N, T = shape
    case = make_case(name, T, (N,), device="cuda", seed=N)
    mask = multi_turn(T, N).cuda()
    got = case.call(layout, mask=to_layout(mask, layout), backend="triton")
    want = testing.vectorized(name, **case.steps, **case.extra, mask=mask)
    for o, w in zip(got, want):
        assert rel_err(o, w) < 1e-5
