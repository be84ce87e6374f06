"""Masks (semantics §7): every estimator as if the masked steps were deleted from each row.

The reference here literally deletes them: for each row it keeps the decision steps, runs the
plain float64 reference (no mask) on that shorter row, and scatters the result back, zeros
elsewhere. Every backend, both layouts, bf16, and masks in the middle, at the start, at the end,
all masked and none masked.
"""
from __future__ import annotations

import pytest
import torch

import rl_triton
from rl_triton.scan import tiles
from cases import assert_close, make_case, to_layout
from conftest import DEVICE

NAMES = ["gae", "lambda_returns", "discounted_returns", "vtrace", "retrace",
         "eligibility_traces", "episodic_cumsum"]
BOOTS = ("last_value", "last_q_values", "last_target_probs", "initial")


def mask_rows(T, N, seed=0):
    """[T, N] masks: random spans, then rows masked at the start, at the end, in the middle
    (one long span), all masked, none masked, and a single decision step."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(T, N, generator=g) < 0.6
    patterns = [lambda c: c.fill_(True), lambda c: c.fill_(False)]
    if T > 3:
        patterns += [lambda c: c[:T // 3].fill_(False), lambda c: c[-(T // 3):].fill_(False),
                     lambda c: c[T // 3:2 * T // 3].fill_(False),
                     lambda c: (c.fill_(False), c[T // 2].fill_(True))]
    for n, p in zip(range(1, N), patterns):
        col = m[:, n].clone()
        p(col)
        m[:, n] = col
    return m


def deleted(case, mask):
    """The outputs of `case` by deleting the masked steps of every row (time-major [T, N])."""
    T, N = mask.shape
    extra = {k: v for k, v in case.extra.items() if k != "return_advantages"}
    shape = case.steps[next(iter(case.steps))].shape
    outs = [torch.zeros(shape, dtype=torch.float64) for _ in case.reference()]
    mask = mask.cpu()
    for n in range(N):
        keep = mask[:, n].nonzero().squeeze(1)
        row_steps = {k: None if v is None else v.cpu()[keep, n:n + 1]
                     for k, v in case.steps.items()}
        row_extra = {k: v.cpu()[n:n + 1] if k in BOOTS or isinstance(v, torch.Tensor) else v
                     for k, v in extra.items()}
        if len(keep):
            res = case.ref(**row_steps, **row_extra)
            res = res if isinstance(res, tuple) else (res,)
            for o, r in zip(outs, res):
                o[keep, n] = r[:, 0]
    return tuple(outs)


@pytest.mark.parametrize("name", NAMES)
def test_reference_mask_is_deletion(name):
    """The float64 reference's own mask against the deletion of the masked steps."""
    T, N = 37, 9
    features = (3,) if name == "eligibility_traces" else ()
    case = make_case(name, T, (N,), dtype=torch.float64, features=features)
    mask = mask_rows(T, N)
    extra = {k: v for k, v in case.extra.items() if k != "return_advantages"}
    got = case.ref(**case.steps, **extra, mask=mask)
    got = got if isinstance(got, tuple) else (got,)
    assert_close(got, deleted(case, mask), tol=1e-12)


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 37])
def test_mask_matches_deletion(name, layout, backend, T, device):
    N = 9
    features = (3,) if name == "eligibility_traces" else ()
    case = make_case(name, T, (N,), features=features, device=device)
    mask = mask_rows(T, N, seed=T).to(device)
    got = case.call(layout, mask=to_layout(mask, layout), backend=backend)
    assert_close(got, deleted(case, mask))


@pytest.mark.parametrize("name", NAMES)
def test_mask_bf16_and_next_values(name, device):
    """bf16 inputs (float32 math) and `next_values` with a mask, on every backend."""
    T, N = 33, 7
    kw = {"bootstrap": "next_values"} if name in ("gae", "lambda_returns", "vtrace",
                                                  "discounted_returns") else {}
    case = make_case(name, T, (N,), dtype=torch.bfloat16, device=device, **kw)
    mask = mask_rows(T, N, seed=3).to(device)
    want = deleted(case, mask)
    for backend in ("loop", "torch", "triton"):
        assert_close(case.call("batch-major", mask=to_layout(mask, "batch-major"),
                               backend=backend), want, tol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_mask_of_ones_is_no_mask(name, device):
    T, N = 40, 6
    case = make_case(name, T, (N,), device=device)
    mask = torch.ones(T, N, dtype=torch.uint8, device=device)
    for backend in ("torch", "triton"):
        plain = case.call(backend=backend)
        masked = case.call(mask=mask, backend=backend)
        for a, b in zip(plain, masked):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


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


def long_masks(T, N, seed):
    """Masks for rows split into tiles of 16: random, plus spans of masked steps that cover
    whole tiles (a tile of no decision step passes both carries through) and a row whose
    only decision step is its first."""
    m = mask_rows(T, N, seed=seed)
    m[20:70, 0] = False
    m[:, 1] = False
    m[0, 1] = True
    m[-40:, 2] = False
    return m


def assert_split_rows(case, mask, layout, want):
    """The masked call in tiles of 16 steps x 2 rows: carries (and the successor's value across
    masked tiles) by look-back with windows of 1 and 16 tiles, or by walking; time-major
    sub-tiles; the first run launched twice, on the same scratch."""
    runs = [dict(window=1, depth=0, walk=False), dict(window=16, depth=3, walk=False),
            dict(window=16, depth=0, walk=True)]
    if layout == "time-major":
        runs += [dict(sub=4, walk=False)]
    for i, run in enumerate(runs):
        with tiles.override(block_t=16, block_b=2, **run):
            for _ in range(1 + (i == 0)):
                assert_close(case.call(layout, mask=to_layout(mask, layout), backend="triton"),
                             want)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_rows_split_across_programs(name, layout, device):
    """Six tiles per row: carries (and the successor's value across masked tiles) found by
    look-back with windows of 1, 2 and 16 tiles, or by walking; time-major sub-tiles."""
    T, N = 5 * 16 + 7, 5
    features = (3,) if name == "eligibility_traces" else ()
    case = make_case(name, T, (N,), seed=13, features=features, device=device)
    mask = long_masks(T, N, seed=7).to(device)
    assert_split_rows(case, mask, layout, deleted(case, mask))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_packed_rows_match_their_rows(name, backend, device):
    """cu_seqlens (semantics §7): each segment of the packed [L] tensors is a row of its own (empty
    segments included), with and without a mask."""
    lengths = [5, 0, 1, 17, 3, 0, 9]
    cu = torch.tensor([0] + lengths).cumsum(0)
    S, L = len(lengths), int(cu[-1])
    features = (3,) if name == "eligibility_traces" else ()
    case = make_case(name, L, (S,), features=features, device=device, seed=2)
    boots = {k: v for k, v in case.extra.items() if k in BOOTS}
    scalars = {k: v for k, v in case.extra.items() if k not in BOOTS}
    seg = torch.repeat_interleave(torch.arange(S), torch.tensor(lengths))
    pos = torch.arange(L)
    packed = {k: None if v is None else v[pos, seg.to(v.device)] for k, v in case.steps.items()}
    user = torch.rand(L, generator=torch.Generator().manual_seed(4)) < 0.7
    for mask in (None, user.to(device)):
        got = case.fn(**packed, **boots, **scalars, cu_seqlens=cu.to(device), mask=mask,
                      backend=backend)
        got = got if isinstance(got, tuple) else (got,)
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if e == s:
                continue
            row = {k: None if v is None else v[s:e, None].cpu() for k, v in packed.items()}
            want = case.ref(**row, **{k: v[i:i + 1].cpu() for k, v in boots.items()},
                            **{k: v for k, v in scalars.items() if k != "return_advantages"},
                            mask=None if mask is None else mask[s:e, None].cpu())
            want = want if isinstance(want, tuple) else (want,)
            assert_close([o[s:e] for o in got], [w[:, 0] for w in want])


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


# ---- packed rows in place (the Triton kernels, semantics §7): segment ends as window ends --------

PACKED = ["gae", "lambda_returns", "discounted_returns", "vtrace", "retrace",
          "eligibility_traces", "episodic_cumsum"]
TWO_OUTPUTS = ("gae", "vtrace", "retrace")  # retrace: with return_advantages (make_inputs)
# empty segments first, last and consecutive; one segment; segments of one step; L = 1
LENGTHS = {"empties": [0, 5, 0, 0, 1, 17, 3, 0], "one": [37], "ones": [1] * 37, "L=1": [1],
           "long": [150, 0, 1, 182]}
# one stream of 333 steps cut into tiles of 16: segments across tiles, on tile edges, short
SPLIT = [0, 40, 1, 1, 0, 0, 30, 3, 0, 150, 16, 16, 76]


@pytest.fixture
def in_place(monkeypatch):
    """Packed calls must not fall back to padded rows."""
    def refuse(*args, **kwargs):
        raise AssertionError("packed rows ran as padded rows")
    monkeypatch.setattr(rl_triton._core.scan.ScanOp, "_padded", refuse)


def packed_inputs(name, lengths, masked, seed=2, **kw):
    """(steps [L, ...] with the mask, bootstraps and scalars, cu) of a packed call."""
    from rl_triton.testing import make_packed_inputs
    features = (3,) if name == "eligibility_traces" else ()
    steps, extra, cu = make_packed_inputs(name, lengths, features=features, seed=seed, **kw)
    L = int(cu[-1])
    steps["mask"] = ((torch.rand(L, generator=torch.Generator().manual_seed(seed + 1)) < 0.7)
                     .to(cu.device) if masked else None)
    return steps, extra, cu


def per_segment(name, steps, extra, cu):
    """Each segment called alone on the float64 reference (zeros where it is empty)."""
    fn = getattr(rl_triton.reference, name)
    boots = {k: v for k, v in extra.items() if k in BOOTS}
    scalars = {k: v for k, v in extra.items() if k not in BOOTS and k != "return_advantages"}
    ref = steps["rewards" if "rewards" in steps else "x"]
    outs = [torch.zeros(ref.shape, dtype=torch.float64)
            for _ in range(2 if name in TWO_OUTPUTS else 1)]
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == s:
            continue
        row = {k: None if v is None else v[s:e, None].cpu() for k, v in steps.items()}
        res = fn(**row, **{k: v[i:i + 1].cpu() for k, v in boots.items()}, **scalars)
        for o, r in zip(outs, res if isinstance(res, tuple) else (res,)):
            o[s:e] = r[:, 0]
    return tuple(outs)


def padded(name, steps, extra, cu, **kw):
    """The same rows padded to [longest, S, ...] and masked (the unpacked masked kernels),
    packed back."""
    lengths = (cu[1:] - cu[:-1]).cpu()
    S, L, longest = len(lengths), int(cu[-1]), int(lengths.max())
    seg = torch.repeat_interleave(torch.arange(S), lengths)
    pos = torch.arange(L) - cu[:-1].cpu()[seg]
    rows = {}
    for k, v in steps.items():
        if v is not None and k != "mask":
            rows[k] = v.new_zeros((longest, S) + v.shape[1:])
            rows[k][pos, seg] = v
    valid = torch.zeros(longest, S, dtype=torch.bool)
    valid[pos, seg] = True if steps["mask"] is None else steps["mask"].cpu()
    out = getattr(rl_triton, name)(**rows, **extra, mask=valid.to(cu.device), **kw)
    return tuple(o[pos, seg] for o in (out if isinstance(out, tuple) else (out,)))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("name", PACKED)
def test_packed_kernel_matches_segments_and_padding(name, lengths, masked, device, in_place):
    """The in-place kernels on packed rows against each segment alone (float64) and against
    the same rows padded and masked (the unpacked kernels)."""
    steps, extra, cu = packed_inputs(name, LENGTHS[lengths], masked, device=device)
    got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="triton")
    got = got if isinstance(got, tuple) else (got,)
    assert_close(got, per_segment(name, steps, extra, cu))
    assert_close(got, padded(name, steps, extra, cu, backend="triton"), tol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", PACKED)
def test_packed_rows_split_across_programs(name, masked, device, in_place):
    """A stream of 333 steps in tiles of 16: segment carries by look-back (windows of 1 and
    16 tiles, read 1 or 3 deep), by walking, and on time-major sub-tiles (feature axes); the
    same plan launched twice (its look-back scratch reused)."""
    steps, extra, cu = packed_inputs(name, SPLIT, masked, device=device)
    want = per_segment(name, steps, extra, cu)
    runs = [dict(window=1, depth=0, walk=False), dict(window=16, depth=3, walk=False),
            dict(window=16, depth=0, walk=True)]
    if name == "eligibility_traces":  # [L, 3]: time-major tiles
        runs += [dict(sub=4, walk=False)]
    for i, run in enumerate(runs):
        with tiles.override(block_t=16, block_b=2 if name == "eligibility_traces" else 1, **run):
            for _ in range(1 + (i == 0)):
                got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="triton")
                assert_close(got if isinstance(got, tuple) else (got,), want)


@pytest.mark.parametrize("name", PACKED)
def test_packed_kernel_bf16_and_next_values(name, device, in_place):
    """bf16 inputs (float32 math), `next_values`, int32 offsets, with and without a mask."""
    kw = {"bootstrap": "next_values"} if name in ("gae", "lambda_returns", "discounted_returns",
                                                  "vtrace") else {}
    for masked in (False, True):
        steps, extra, cu = packed_inputs(name, SPLIT, masked, device=device,
                                         dtype=torch.bfloat16, **kw)
        got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu.int(), backend="triton")
        got = got if isinstance(got, tuple) else (got,)
        assert_close(got, per_segment(name, steps, extra, cu), tol=1e-5)


def test_packed_discounted_returns_without_bootstrap(device, in_place):
    """A missing bootstrap is zero at every segment end (discounted returns only)."""
    for masked in (False, True):
        steps, extra, cu = packed_inputs("discounted_returns", SPLIT, masked, device=device,
                                         bootstrap=None)
        got = rl_triton.discounted_returns(**steps, **extra, cu_seqlens=cu, backend="triton")
        assert_close((got,), per_segment("discounted_returns", steps, extra, cu))


def nan_in_a_segment(name, device):
    """(steps, extra, cu, outside): packed rows of SPLIT with a NaN at a decision step inside
    the long segment 9, and the steps outside that segment."""
    steps, extra, cu = packed_inputs(name, SPLIT, True, device=device)
    key = "rewards" if "rewards" in steps else "x"
    bad = cu[9].item() + 70  # inside the long segment 9
    steps[key] = steps[key].clone()
    steps[key][bad] = float("nan")
    steps["mask"][bad] = True
    outside = torch.ones(int(cu[-1]), dtype=torch.bool)
    outside[cu[9].item():cu[10].item()] = False
    return steps, extra, cu, outside


def assert_exact_outside(got, want, outside):
    """Every other segment's outputs finite and as each segment alone."""
    for o, w in zip(got if isinstance(got, tuple) else (got,), want):
        assert torch.isfinite(o[outside.to(o.device)]).all()
        assert_close([o[outside.to(o.device)]], [w[outside]])


@pytest.mark.parametrize("name", PACKED)
def test_packed_nan_stays_in_its_segment(name, device, in_place):
    """A NaN input in one segment leaves every other segment's outputs exact."""
    steps, extra, cu, outside = nan_in_a_segment(name, device)
    with tiles.override(block_t=16, block_b=2 if name == "eligibility_traces" else 1):
        got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="triton")
    assert_exact_outside(got, per_segment(name, steps, extra, cu), outside)


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


def packed_call(name, lengths, masked, cu, backend, **kw):
    """`rl_triton.<name>` on packed rows of `lengths` with the offsets `cu` (possibly bad;
    on the CPU, where a NumPy view can edit them); the Triton backend's rows on the GPU where
    there is one."""
    steps, extra, _ = packed_inputs(name, lengths, masked,
                                    device=DEVICE if backend == "triton" else "cpu")
    S = cu.shape[0] - 1  # bootstraps: one per segment of `cu`
    extra = {k: v.repeat_interleave(S, 0)[:S] if k in BOOTS else v for k, v in extra.items()}
    return getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
@pytest.mark.parametrize("name", PACKED)
def test_packed_offsets_checked_on_every_call(name, backend):
    """Offsets edited after a good call, through `.data` or a NumPy view (which no version
    counter sees) or in place, are read and refused again on every call, on every backend."""
    cu = torch.tensor([0, 3, 7])
    packed_call(name, [3, 4], True, cu, backend)
    for edit in (lambda: cu.numpy().__setitem__(1, 9), lambda: cu.data.__setitem__(1, 9),
                 lambda: cu.__setitem__(1, 9)):
        edit()
        for _ in range(2):
            with pytest.raises(ValueError, match=r"cu_seqlens .* decreases"):
                packed_call(name, [3, 4], True, cu, backend)
        cu[1] = 3
        packed_call(name, [3, 4], True, cu, backend)  # good again: no stale refusal either
    for bad in ([0, 3, 6], [1, 3, 7], [0, 3, 8]):  # edited ends
        cu.numpy()[:] = bad
        with pytest.raises(ValueError, match="cu_seqlens must start at 0, end at L = 7"):
            packed_call(name, [3, 4], True, cu, backend)


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_check_offsets_false_reads_nothing(backend, monkeypatch):
    """check_offsets=True reads the offsets' values on every call, check_offsets=False on none
    (their type and shape still checked); it must be a bool. Whatever unchecked offsets hold,
    the call stays inside its tensors and returns outputs of the packed shape."""
    reads = []
    real = rl_triton._args.check_offsets

    def spy(*args, data=True, **kwargs):
        reads.append(data)
        return real(*args, data=data, **kwargs)

    monkeypatch.setattr(rl_triton._core.scan, "check_offsets", spy)
    cu = torch.tensor([0, 3, 7])
    want = packed_call("gae", [3, 4], True, cu, backend)
    for _ in range(2):
        packed_call("gae", [3, 4], True, cu, backend)
    got = packed_call("gae", [3, 4], True, cu, backend, check_offsets=False)
    assert reads == [True, True, True, False]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for bad in ([0, 9, 7], [0, 5, 2, 7], [3, 1, 2], [0, -4, 7], [0, 2, 3], [0, 99, 200],
                [0, 10**12, 7]):
        for name in PACKED:
            outs = packed_call(name, [3, 4], True, torch.tensor(bad), backend,
                               check_offsets=False)
            for o in outs if isinstance(outs, tuple) else (outs,):
                assert o.shape[0] == 7
    for flag in ("yes", 1, None):
        with pytest.raises(TypeError, match="check_offsets must be a bool"):
            packed_call("gae", [3, 4], True, cu, backend, check_offsets=flag)
        with pytest.raises(TypeError, match="check_offsets must be a bool"):
            z = torch.zeros(3, device=DEVICE if backend == "triton" else "cpu")
            rl_triton.gae(z, z, z, last_value=z[0], backend=backend, check_offsets=flag)
    with pytest.raises(ValueError, match="no segment"):
        packed_call("gae", [3, 4], True, torch.tensor([0]), backend, check_offsets=False)


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_loss_offsets_checked_on_every_call(backend):
    """The losses that take cu_seqlens read their offsets on every call too (edits through a
    NumPy view included); check_offsets=False skips the read, and must be a bool."""
    g = torch.Generator().manual_seed(0)
    dev = DEVICE if backend == "triton" else "cpu"  # offsets on the CPU (a NumPy view edits them)
    lp, old, adv, v, ret = (torch.randn(7, generator=g).to(dev) for _ in range(5))
    cu = torch.tensor([0, 3, 7])
    calls = [lambda **kw: rl_triton.ppo_policy_loss(lp, old, adv, cu_seqlens=cu,
                                                    aggregation="seq-mean-token-mean",
                                                    backend=backend, **kw)[0],
             lambda **kw: rl_triton.value_loss(v, ret, cu_seqlens=cu,
                                               aggregation="seq-mean-token-sum",
                                               backend=backend, **kw)]
    for call in calls:
        want = call()
        cu.numpy()[1] = 9
        for _ in range(2):
            with pytest.raises(ValueError, match="cu_seqlens"):
                call()
        assert call(check_offsets=False).isfinite()  # unread: no error, inside the tensors
        cu.numpy()[1] = 3
        torch.testing.assert_close(call(check_offsets=False), want)
        with pytest.raises(TypeError, match="check_offsets must be a bool"):
            call(check_offsets="no")


def packed_batch_inputs(name, lengths, N, seed=5):
    """Packed rows with a batch axis: per-step tensors `[L, N, ...]`, bootstraps `[S, N, ...]`."""
    from rl_triton.testing import make_inputs
    features = (2,) if name == "eligibility_traces" else ()
    lengths = torch.tensor(lengths)
    S, L = len(lengths), int(lengths.sum())
    steps, extra = make_inputs(name, int(lengths.max()), (S, N), features=features, seed=seed)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    seg = torch.repeat_interleave(torch.arange(S), lengths)
    pos = torch.arange(L) - cu[:-1][seg]
    steps = {k: None if v is None else v[pos, seg] for k, v in steps.items()}
    return steps, extra, cu


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
@pytest.mark.parametrize("name", PACKED)
def test_packed_batch_axes_and_segment_discounts(name, backend):
    """Per-step tensors `[L, N]` (bootstraps `[S, N]`), with and without a mask, and tensor
    discounts one per segment (`[S]`, `[S, N]`), on every backend alike: each segment's column
    against that column of the segment alone, with its own discounts."""
    lengths, N = [3, 0, 5, 1], 2
    steps, extra, cu = packed_batch_inputs(name, lengths, N)
    S, L = len(lengths), int(cu[-1])
    dev = DEVICE if backend == "triton" else "cpu"  # the kernels on the GPU where there is one
    fn, ref = getattr(rl_triton, name), getattr(rl_triton.reference, name)
    boots = {k: v for k, v in extra.items() if k in BOOTS}
    scalars = {k: v for k, v in extra.items() if k not in BOOTS}
    g = torch.Generator().manual_seed(3)
    discounts = [{}]
    names = [k for k in ("gamma", "lam") if k in scalars]
    if names:
        discounts += [{k: 0.5 + 0.5 * torch.rand(S, generator=g) for k in names},
                      {k: 0.5 + 0.5 * torch.rand(S, N, generator=g) for k in names[:1]},
                      {names[-1]: torch.tensor([0.8])}]  # one for every segment
    masks = [None, torch.rand(L, N, generator=g) < 0.7]
    for mask in masks:
        for disc in discounts:
            on = {k: v.to(dev) if isinstance(v, torch.Tensor) else v
                  for k, v in {**steps, **scalars, **disc, **boots}.items()}
            got = fn(**on, mask=None if mask is None else mask.to(dev), cu_seqlens=cu.to(dev),
                     backend=backend)
            got = tuple(o.cpu() for o in (got if isinstance(got, tuple) else (got,)))
            want = [torch.zeros(o.shape, dtype=torch.float64) for o in got]
            for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                for n in range(N):
                    if e == s:
                        continue
                    own = {k: float(v[i % len(v)] if v.ndim == 1 else v[i, n])
                           for k, v in disc.items()}
                    res = ref(**{k: None if v is None else v[s:e, n:n + 1]
                                 for k, v in steps.items()},
                              **{k: v[i, n:n + 1] for k, v in boots.items()},
                              **{k: v for k, v in {**scalars, **own}.items()
                                 if k != "return_advantages"},
                              mask=None if mask is None else mask[s:e, n:n + 1])
                    for w, r in zip(want, res if isinstance(res, tuple) else (res,)):
                        w[s:e, n] = r[:, 0]
            assert_close(got, want)


@pytest.mark.parametrize("name", PACKED)
def test_packed_torch_rows(name, device):
    """The torch backend runs packed rows as one long row (no padding): bf16 and float32,
    last_value, next_values or no bootstrap, with and without a mask, against each segment
    alone; a NaN in one segment leaves the others exact; gradients as each segment alone."""
    boots = ["last_value"] + (["next_values"] if name in TWO_OUTPUTS[:2] + (
        "lambda_returns", "discounted_returns") else []) + (
        [None] if name == "discounted_returns" else [])
    for masked in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            for boot in boots:
                steps, extra, cu = packed_inputs(name, SPLIT, masked, device=device,
                                                 dtype=dtype, bootstrap=boot)
                got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="torch")
                got = got if isinstance(got, tuple) else (got,)
                assert_close(got, per_segment(name, steps, extra, cu), tol=1e-5)
    steps, extra, cu, outside = nan_in_a_segment(name, device)
    got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="torch")
    assert_exact_outside(got, per_segment(name, steps, extra, cu), outside)
    # gradients of every floating input (bootstraps per segment included)
    steps, extra, cu = packed_inputs(name, [4, 0, 7, 1, 3], True, device=device,
                                     dtype=torch.float64)
    leaves = {k: v.requires_grad_() for k, v in {**steps, **extra}.items()
              if isinstance(v, torch.Tensor) and v.is_floating_point()}
    # float64 outputs: float32 ones would round the output gradients (up to 2.6e-6 relative
    # in the inputs' gradients, beyond the float64 tolerance)
    got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="torch",
                                   out_dtype=torch.float64)
    want = per_segment(name, steps, extra, cu)
    weights = [torch.randn(w.shape, generator=torch.Generator().manual_seed(i), dtype=w.dtype)
               for i, w in enumerate(want)]
    got = got if isinstance(got, tuple) else (got,)
    grads = torch.autograd.grad(sum((o * w.to(o.device)).sum() for o, w in zip(got, weights)),
                                list(leaves.values()))
    wants = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want, weights)),
                                list(leaves.values()), allow_unused=True)
    for k, a, b in zip(leaves, grads, wants):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b,
                                   msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name", PACKED)
def test_packed_kernel_empty_stream(name, device, in_place):
    """No step at all (every segment empty): empty outputs, no launch."""
    steps, extra, cu = packed_inputs(name, [2, 1], True, device=device)
    steps = {k: None if v is None else v[:0] for k, v in steps.items()}
    cu = torch.zeros(4, dtype=torch.int64, device=device)
    extra = {k: (torch.cat([v, v[:1]]) if k in BOOTS else v) for k, v in extra.items()}
    got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="triton")
    for o in got if isinstance(got, tuple) else (got,):
        assert o.shape[0] == 0


@pytest.mark.parametrize("name", ["gae", "lambda_returns", "discounted_returns", "vtrace",
                                  "retrace"])
def test_packed_kernel_feature_axes(name, device, in_place):
    """Per-step tensors [L, D] (time-major tiles, rows along D; bootstraps [S, D]), with a mask
    [L, D] and without, split over tiles of 16 steps, against each segment alone."""
    from rl_triton.testing import make_inputs
    lengths = torch.tensor(SPLIT)
    S, D, L = len(SPLIT), 3, int(sum(SPLIT))
    steps, extra = make_inputs(name, int(lengths.max()), (S, D), device=device, seed=8)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device)
    seg = torch.repeat_interleave(torch.arange(S), lengths).to(device)
    pos = torch.arange(L, device=device) - cu[:-1][seg]
    steps = {k: None if v is None else v[pos, seg] for k, v in steps.items()}
    fn, ref = getattr(rl_triton, name), getattr(rl_triton.reference, name)
    boots = {k: v for k, v in extra.items() if k in BOOTS}
    scalars = {k: v for k, v in extra.items() if k not in BOOTS and k != "return_advantages"}
    for mask in (None, torch.rand(L, D, generator=torch.Generator().manual_seed(1)) < 0.7):
        mask = None if mask is None else mask.to(device)
        with tiles.override(block_t=16, sub=4):
            got = fn(**steps, **extra, mask=mask, cu_seqlens=cu, backend="triton")
        got = got if isinstance(got, tuple) else (got,)
        want = [torch.zeros(L, D, dtype=torch.float64) for _ in got]
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if e > s:
                row = {k: None if v is None else v[s:e].cpu() for k, v in steps.items()}
                res = ref(**row, **{k: v[i].cpu() for k, v in boots.items()}, **scalars,
                          mask=None if mask is None else mask[s:e].cpu())
                for w, r in zip(want, res if isinstance(res, tuple) else (res,)):
                    w[s:e] = r
        assert_close(got, want)


# ---- V-trace with a mask and next_values: vs' is next_values at the last decision step --------

def refuse_vtrace_torch(monkeypatch):
    """V-trace's torch backend raises from here on: masked calls must run the kernel."""
    from rl_triton.ops import vtrace

    def refuse(*args, **kwargs):
        raise AssertionError("masked V-trace ran on the torch backend")
    monkeypatch.setattr(vtrace.OP, "torch", refuse)


@pytest.fixture
def vtrace_kernel(monkeypatch):
    refuse_vtrace_torch(monkeypatch)


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.parametrize("T, N", [(1, 5), (37, 1), (37, 9), (333, 50)])
def test_masked_vtrace_next_values_kernel(T, N, layout, device, vtrace_kernel):
    """The kernel against deletion: masks in the middle, at the start, at the end, all masked,
    none masked, one decision step (its own window end, then vs' = next_values)."""
    case = make_case("vtrace", T, (N,), bootstrap="next_values", device=device, seed=T + N)
    mask = mask_rows(T, max(N, 2), seed=T)[:, -N:].to(device)  # N = 1: a mask with spans
    got = case.call(layout, mask=to_layout(mask, layout), backend="triton")
    assert_close(got, deleted(case, mask))


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_vtrace_next_values_split_across_programs(layout, device, vtrace_kernel):
    """Six tiles per row: whether a decision step follows (the W carry's NaN) crosses tiles by
    look-back (windows of 1 and 16) and by walking, and through tiles of no decision step."""
    T, N = 5 * 16 + 7, 5
    case = make_case("vtrace", T, (N,), seed=13, bootstrap="next_values", device=device)
    mask = long_masks(T, N, seed=7).to(device)
    assert_split_rows(case, mask, layout, deleted(case, mask))


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_vtrace_next_values_nan(layout, device, monkeypatch):
    """Non-finite values at decision steps (NaN and inf, also past tile ends and where no
    decision step follows) and next_values give the torch backend's outputs, NaN and inf
    included, and the deletion's NaN pattern and values wherever it is finite."""
    T, N = 5 * 16 + 7, 5
    case = make_case("vtrace", T, (N,), seed=21, bootstrap="next_values", device=device)
    mask = long_masks(T, N, seed=9).to(device)
    values, nv = case.steps["values"].clone(), case.steps["next_values"].clone()
    for n in range(N):  # a decision step's value NaN, another's inf, one next_value NaN
        steps = mask[:, n].nonzero().squeeze(1).tolist()
        if len(steps) > 2:
            values[steps[len(steps) // 2], n] = float("nan")
            values[steps[1], n] = float("inf")
            nv[steps[-2], n] = float("nan")
        elif steps:
            values[steps[0], n] = float("nan")
    values[~mask] = float("nan")  # masked steps are ignored
    case.steps.update(values=values, next_values=nv)
    want = case.call(layout, mask=to_layout(mask, layout), backend="torch")
    ref = deleted(case, mask)
    refuse_vtrace_torch(monkeypatch)
    with tiles.override(block_t=16, block_b=2):
        got = case.call(layout, mask=to_layout(mask, layout), backend="triton")
    for g, w, r in zip(got, want, ref):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-5)
        assert torch.equal(g.isnan(), r.isnan().to(g.device))
        fine = torch.isfinite(r).to(g.device)
        assert fine.sum() > N  # most steps are untouched
        assert_close([g[fine]], [r.to(g.device)[fine]])


@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_packed_masked_vtrace_next_values(lengths, device, in_place, vtrace_kernel):
    """Packed rows in place, with a mask and next_values (empty segments, segments of one
    step, L = 1), against each segment alone."""
    steps, extra, cu = packed_inputs("vtrace", LENGTHS[lengths], True, device=device,
                                     bootstrap="next_values")
    got = rl_triton.vtrace(**steps, **extra, cu_seqlens=cu, backend="triton")
    assert_close(got, per_segment("vtrace", steps, extra, cu))


def test_packed_masked_vtrace_next_values_split(device, in_place, vtrace_kernel):
    """A stream of 333 steps in tiles of 16, a mask and next_values: segment ends (a restart
    of both carries) inside tiles and on their edges, carries by look-back and walking."""
    steps, extra, cu = packed_inputs("vtrace", SPLIT, True, device=device,
                                     bootstrap="next_values")
    want = per_segment("vtrace", steps, extra, cu)
    for run in [dict(window=1, depth=0, walk=False), dict(window=16, depth=3, walk=False),
                dict(window=16, depth=0, walk=True)]:
        with tiles.override(block_t=16, block_b=1, **run):
            assert_close(rl_triton.vtrace(**steps, **extra, cu_seqlens=cu, backend="triton"),
                         want)


# ---- Retrace's masked kernel: masked and packed calls run on it, never on the torch backend ---

@pytest.fixture
def retrace_kernel(monkeypatch):
    """Masked and packed Retrace calls must run its Triton kernel: neither the torch backend
    (where masked calls without a kernel go) nor padded rows."""
    def refuse(*args, **kwargs):
        raise AssertionError("retrace ran on the torch backend")

    def refuse_padded(*args, **kwargs):
        raise AssertionError("packed rows ran as padded rows")
    monkeypatch.setattr(rl_triton.ops.retrace.OP, "torch", refuse)
    monkeypatch.setattr(rl_triton._core.scan.ScanOp, "_padded", refuse_padded)


@pytest.mark.parametrize("n_act", [1, 3, 18])
@pytest.mark.parametrize("T, N", [(1, 1), (1, 50), (37, 1), (37, 50), (333, 5)])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_retrace_runs_its_kernel(layout, T, N, n_act, device, retrace_kernel):
    """Odd shapes (333 x 50 is left to the GPU tests: minutes in the interpreter), 1 to 18
    actions, masks in the middle, at the start, at the end, all masked and none
    (`mask_rows`), against the deletion of the masked steps."""
    case = make_case("retrace", T, (N,), n_act=n_act, seed=T + N + n_act, device=device)
    mask = mask_rows(T, N, seed=T + n_act).to(device)
    assert_close(case.call(layout, mask=to_layout(mask, layout), backend="triton"),
                 deleted(case, mask))


@pytest.mark.parametrize("n_act", [1, 18])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_retrace_split_across_programs(layout, n_act, device, retrace_kernel):
    """Rows of 87 steps in tiles of 16 (masked spans that cover whole tiles): the carries of
    the scan and of the successor's expectation by look-back and by walking."""
    T, N = 5 * 16 + 7, 5
    case = make_case("retrace", T, (N,), n_act=n_act, seed=3, device=device)
    mask = long_masks(T, N, seed=9).to(device)
    assert_split_rows(case, mask, layout, deleted(case, mask))


def assert_same_non_finite(got, want):
    """The same non-finite pattern (NaN and inf alike) and the finite values close."""
    for o, w in zip(got, want):
        o, w = o.double().cpu(), w.double().cpu()
        fin = torch.isfinite(w)
        assert torch.equal(torch.isfinite(o), fin)
        assert_close([o[fin]], [w[fin]])


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_retrace_non_finite_stays_in_its_episode(layout, device, retrace_kernel):
    """NaN and inf at decision steps (a reward, a Q value, a probability, a behaviour
    probability, the bootstrap state; a NaN reward where pi(a_t) = 0 cuts the trace), in rows
    split over tiles: the float64 reference's pattern exactly, on the kernel and the torch
    backend."""
    T, N = 70, 8
    case = make_case("retrace", T, (N,), n_act=3, seed=5, device=device)
    mask = mask_rows(T, N, seed=2).to(device)
    steps = {k: None if v is None else v.clone() for k, v in case.steps.items()}
    extra = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.extra.items()}
    steps["rewards"][40, 0] = float("nan")
    steps["q_values"][30, 2, steps["actions"][30, 2]] = float("inf")
    steps["target_probs"][50, 3, 1] = float("nan")
    steps["behavior_probs"][20, 4] = float("nan")
    steps["target_probs"][25, 7, steps["actions"][25, 7]] = 0.0  # c = 0: the trace is cut
    steps["rewards"][25, 7] = float("nan")
    extra["last_q_values"][6, 0] = float("nan")
    mask[[40, 30, 50, 20, 25], [0, 2, 3, 4, 7]] = True
    noref = {k: v for k, v in extra.items() if k != "return_advantages"}
    want = rl_triton.reference.retrace(**steps, **noref, mask=mask)
    assert all(not torch.isfinite(w).all() for w in want)
    with tiles.override(block_t=16, block_b=2):
        got = rl_triton.retrace(**{k: to_layout(v, layout) for k, v in steps.items()}, **extra,
                                mask=to_layout(mask, layout),
                                time_dim=0 if layout == "time-major" else 1, backend="triton")
    assert_same_non_finite([o if layout == "time-major" else o.movedim(1, 0) for o in got],
                           want)
    # the torch backend's own (the fixture refuses it through the public function)
    op = rl_triton.ops.retrace
    x = op.Inputs(**steps, last_q_values=extra["last_q_values"],
                  last_target_probs=extra["last_target_probs"], mask=mask)
    s = op.Scalars(extra["gamma"], extra["lam"], extra["c_clip"])
    assert_same_non_finite(op.torch_impl(x, s, op.Extras(True, True)), want)


@pytest.mark.parametrize("n_act", [1, 18])
@pytest.mark.parametrize("masked", [False, True])
def test_packed_retrace_runs_its_kernel(masked, n_act, device, retrace_kernel):
    """Packed rows with empty segments, split over tiles of 16 (look-back and walk), 1 and 18
    actions, against each segment alone."""
    steps, extra, cu = packed_inputs("retrace", SPLIT, masked, device=device, n_act=n_act)
    want = per_segment("retrace", steps, extra, cu)
    for run in (dict(window=16, depth=3, walk=False), dict(window=16, depth=0, walk=True)):
        with tiles.override(block_t=16, block_b=1, **run):
            assert_close(rl_triton.retrace(**steps, **extra, cu_seqlens=cu, backend="triton"),
                         want)
    assert_close(rl_triton.retrace(**steps, **extra, cu_seqlens=cu, backend="triton"), want)


def test_masked_and_packed_retrace_need_the_bootstrap_state(device):
    """Retrace's bootstrap state is required with a mask and with packed rows too (no silent
    zero bootstrap), and checked per segment."""
    steps, extra, cu = packed_inputs("retrace", [3, 0, 4], True, device=device)
    for missing in ("last_q_values", "last_target_probs"):
        kw = {k: v for k, v in extra.items() if k != missing}
        with pytest.raises(ValueError, match=missing):  # one row of 7 steps: [A] bootstraps
            rl_triton.retrace(**steps, **{k: v[0] if k in BOOTS else v for k, v in kw.items()},
                              backend="triton")
        with pytest.raises(ValueError, match=missing):
            rl_triton.retrace(**steps, **kw, cu_seqlens=cu, backend="triton")
    with pytest.raises(ValueError, match="last_q_values"):
        rl_triton.retrace(**steps, **{**extra, "last_q_values": extra["last_q_values"][:2]},
                          cu_seqlens=cu, backend="triton")
