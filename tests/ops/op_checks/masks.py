"""Masks and packed rows (semantics §7), checks shared by the scan ops (run in each op's module):
every op with flags as if the masked steps were deleted from each row.

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
from cases import FLAGGED, assert_close, make_case, per_op, to_layout
from conftest import DEVICE

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


@per_op("name", FLAGGED)
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
@per_op("name", FLAGGED)
@pytest.mark.parametrize("T", [1, 37])
def test_mask_matches_deletion(name, layout, backend, T, device):
    N = 9
    features = (3,) if name == "eligibility_traces" else ()
    case = make_case(name, T, (N,), features=features, device=device)
    mask = mask_rows(T, N, seed=T).to(device)
    got = case.call(layout, mask=to_layout(mask, layout), backend=backend)
    assert_close(got, deleted(case, mask))


@per_op("name", FLAGGED)
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


@per_op("name", FLAGGED)
def test_mask_of_ones_is_no_mask(name, device):
    T, N = 40, 6
    case = make_case(name, T, (N,), device=device)
    mask = torch.ones(T, N, dtype=torch.uint8, device=device)
    for backend in ("torch", "triton"):
        plain = case.call(backend=backend)
        masked = case.call(mask=mask, backend=backend)
        for a, b in zip(plain, masked):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


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


@per_op("name", FLAGGED)
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_masked_rows_split_across_programs(name, layout, device):
    """Six tiles per row: carries (and the successor's value across masked tiles) found by
    look-back with windows of 1, 2 and 16 tiles, or by walking; time-major sub-tiles."""
    T, N = 5 * 16 + 7, 5
    features = (3,) if name == "eligibility_traces" else ()
    case = make_case(name, T, (N,), seed=13, features=features, device=device)
    mask = long_masks(T, N, seed=7).to(device)
    assert_split_rows(case, mask, layout, deleted(case, mask))


@per_op("name", FLAGGED)
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


@per_op("name", FLAGGED)
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_packed_time_dim_counts_the_step_axes(name, backend):
    """Packed, time is axis 0 of the per-step tensors: time_dim 0 or -1 for [L] steps, counted
    on `dones` where a forward scan's x carries feature axes (the unpacked rule); -2 is out of
    range."""
    lengths = [2, 0, 3]
    cu = torch.tensor([0] + lengths).cumsum(0).to(DEVICE)
    features = (3,) if name == "eligibility_traces" else ()
    case = make_case(name, 5, (3,), features=features, device=DEVICE, seed=2)
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    packed = {k: None if v is None else v[torch.arange(5), seg.to(v.device)]
              for k, v in case.steps.items()}
    extra = {k: v for k, v in case.extra.items()}

    def run(td):
        out = case.fn(**packed, **extra, cu_seqlens=cu, time_dim=td, backend=backend)
        return out if isinstance(out, tuple) else (out,)

    for a, b in zip(run(0), run(-1)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="time_dim"):
        run(-2)


# ---- packed rows in place (the Triton kernels, semantics §7): segment ends as window ends --------

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
@per_op("name", FLAGGED)
def test_packed_kernel_matches_segments_and_padding(name, lengths, masked, device, in_place):
    """The in-place kernels on packed rows against each segment alone (float64) and against
    the same rows padded and masked (the unpacked kernels)."""
    steps, extra, cu = packed_inputs(name, LENGTHS[lengths], masked, device=device)
    got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="triton")
    got = got if isinstance(got, tuple) else (got,)
    assert_close(got, per_segment(name, steps, extra, cu))
    assert_close(got, padded(name, steps, extra, cu, backend="triton"), tol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
@per_op("name", FLAGGED)
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


@per_op("name", FLAGGED)
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


@per_op("name", FLAGGED)
def test_packed_nan_stays_in_its_segment(name, device, in_place):
    """A NaN input in one segment leaves every other segment's outputs exact."""
    steps, extra, cu, outside = nan_in_a_segment(name, device)
    with tiles.override(block_t=16, block_b=2 if name == "eligibility_traces" else 1):
        got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="triton")
    assert_exact_outside(got, per_segment(name, steps, extra, cu), outside)


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
@per_op("name", FLAGGED)
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
@per_op("name", FLAGGED)
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


@per_op("name", FLAGGED)
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


@per_op("name", FLAGGED)
def test_packed_kernel_empty_stream(name, device, in_place):
    """No step at all (every segment empty): empty outputs, no launch."""
    steps, extra, cu = packed_inputs(name, [2, 1], True, device=device)
    steps = {k: None if v is None else v[:0] for k, v in steps.items()}
    cu = torch.zeros(4, dtype=torch.int64, device=device)
    extra = {k: (torch.cat([v, v[:1]]) if k in BOOTS else v) for k, v in extra.items()}
    got = getattr(rl_triton, name)(**steps, **extra, cu_seqlens=cu, backend="triton")
    for o in got if isinstance(got, tuple) else (got,):
        assert o.shape[0] == 0


@per_op("name", ["gae", "lambda_returns", "discounted_returns", "vtrace",
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
