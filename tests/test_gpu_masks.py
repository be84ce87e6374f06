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


@pytest.mark.parametrize("name", NAMES)
def test_packed_large(name):
    """512 packed responses of 1 to 4096 tokens against the same rows padded and masked."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 4097, (512,), generator=g)
    lengths[::37] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
    S, T = 512, int(lengths.max())
    case = make_case(name, T, (S,), device="cuda", seed=3)
    valid = (torch.arange(T)[:, None] < lengths[None, :]).cuda()
    padded = case.call("time-major", mask=valid, backend="triton")
    seg = torch.repeat_interleave(torch.arange(S), lengths).cuda()
    pos = torch.arange(int(lengths.sum())).cuda() - cu[:-1][seg]
    packed = {k: None if v is None else v[pos, seg] for k, v in case.steps.items()}
    got = case.fn(**packed, **case.extra, cu_seqlens=cu, backend="triton")
    got = got if isinstance(got, tuple) else (got,)
    for o, p in zip(got, padded):
        assert rel_err(o, p[pos, seg]) < 1e-6
