"""Masked calls (semantics §7) at the benchmark's token shapes on the GPU: the kernels (one tile per
row, look-back over many tiles, walked rows) against the torch backend in float64."""
import pytest
import torch

import rl_triton
from cases import make_case, rel_err, to_layout
from rl_triton import testing
from rl_triton.scan import tiles

NAMES = ["gae", "lambda_returns", "discounted_returns", "vtrace", "retrace",
         "eligibility_traces", "episodic_cumsum"]


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


def refuse(*args, **kwargs):
    raise AssertionError("not the kernel")


@pytest.mark.parametrize("shape", [(512, 4096), (4, 1048576), (16384, 64)])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_vtrace_next_values_large(shape, layout, monkeypatch):
    """V-trace with a mask and next_values: its kernel (the torch backend refused) against
    float64."""
    from rl_triton.ops import vtrace
    N, T = shape
    case = make_case("vtrace", T, (N,), device="cuda", seed=N, bootstrap="next_values")
    mask = multi_turn(T, N).cuda()
    want = testing.vectorized("vtrace", **case.steps, **case.extra, mask=mask)
    monkeypatch.setattr(vtrace.OP, "torch", refuse)
    got = case.call(layout, mask=to_layout(mask, layout), backend="triton")
    for o, w in zip(got, want):
        assert rel_err(o, w) < 1e-5


def test_packed_vtrace_next_values_large(monkeypatch):
    """Packed V-trace with a mask and next_values, in place (padded rows refused): 512
    segments summing to 512 x 4096 tokens (every 37th empty) against float64."""
    monkeypatch.setattr(rl_triton._core.scan.ScanOp, "_padded", refuse)
    lengths = random_lengths(512, 512 * 4096, seed=7, empty_every=37)
    assert all(e < 1e-5 for e in packed_against_float64("vtrace", lengths, True,
                                                        bootstrap="next_values"))


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


def random_lengths(S, total, seed, empty_every=0):
    """S segment lengths of random sizes summing to `total` (every `empty_every`-th empty)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(S, generator=g) ** 3 + 0.01
    if empty_every:
        w[::empty_every] = 0
    lengths = (w / w.sum() * total).floor().long()
    lengths[torch.argmax(w)] += total - lengths.sum()
    return lengths


def packed_against_float64(name, lengths, masked, dtype=torch.float32, features=(), **kw):
    """The in-place packed call against the float64 torch implementation on the same rows
    padded and masked; returns the relative errors."""
    steps, extra, cu = testing.make_packed_inputs(name, lengths, device="cuda", dtype=dtype,
                                                  features=features, seed=5, **kw)
    L, S = int(cu[-1]), len(lengths)
    g = torch.Generator().manual_seed(6)
    user = (torch.rand(L, generator=g) < 0.7).cuda() if masked else None
    got = getattr(rl_triton, name)(**steps, **extra, mask=user, cu_seqlens=cu, backend="triton")
    got = got if isinstance(got, tuple) else (got,)
    longest = int(lengths.max())
    seg = torch.repeat_interleave(torch.arange(S), lengths).cuda()
    pos = torch.arange(L).cuda() - cu[:-1][seg]
    rows = {}
    for k, v in steps.items():
        if v is not None:
            rows[k] = v.new_zeros((longest, S) + v.shape[1:])
            rows[k][pos, seg] = v
    valid = torch.zeros(longest, S, dtype=torch.bool, device="cuda")
    valid[pos, seg] = True if user is None else user
    want = testing.vectorized(name, **rows, **extra, mask=valid)
    return [rel_err(o, w[pos, seg]) for o, w in zip(got, want)]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_packed_in_place_large(name, masked):
    """512 segments of random lengths summing to 512 x 4096 tokens (every 37th empty), one
    stream of look-back tiles, against float64."""
    lengths = random_lengths(512, 512 * 4096, seed=2, empty_every=37)
    assert all(e < 1e-5 for e in packed_against_float64(name, lengths, masked))


@pytest.mark.parametrize("name", ["gae", "episodic_cumsum"])
def test_packed_in_place_many_short_segments(name):
    """2^17 segments of 0 to 31 tokens (the offsets' search in three rounds, many segments per
    tile), with a mask."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 32, (2**17,), generator=g)
    assert all(e < 1e-5 for e in packed_against_float64(name, lengths, True))


def test_packed_in_place_bf16_features_and_walk():
    """bf16 GAE with next_values; eligibility traces of 16-vectors (time-major tiles); episodic
    sums walked (tiles forced to walk one row)."""
    lengths = random_lengths(64, 2**20, seed=4, empty_every=9)
    assert all(e < 1e-5 for e in packed_against_float64(
        "gae", lengths, True, dtype=torch.bfloat16, bootstrap="next_values"))
    assert all(e < 1e-5 for e in packed_against_float64("eligibility_traces", lengths[:16],
                                                        True, features=(16,)))
    with tiles.override(walk=True):
        assert all(e < 1e-5 for e in packed_against_float64("episodic_cumsum", lengths, True))
