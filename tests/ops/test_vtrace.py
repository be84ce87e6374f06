"""`vtrace` (docs/semantics.md §3): by hand and on-policy as lambda-returns, NaN log-probabilities,
the backward's sub-tiles, masked and packed calls with next_values on its kernel, and on a CUDA
device (marked gpu_large) memory traffic and masked and packed rows at token shapes. The checks
every scan op shares (tests/ops/op_checks: every backend, layout and dtype against the float64
reference, gradcheck and the Triton backward, masks, packed rows, non-finite inputs, large shapes)
run here for it too."""
import math

import pytest
import torch

import rl_triton
from rl_triton import testing
from rl_triton._core.plans import clear_plans
from rl_triton.scan import tiles
from by_hand import close, flags, t
from by_hand import backend  # noqa: F401 (a fixture: every backend)
from cases import BACKENDS, assert_close, make_case, rel_err, to_layout
import op_checks
from op_checks.gradients import triton_vs_reference
from op_checks.large_masks import multi_turn, packed_against_float64, random_lengths, refuse
from op_checks.masks import (LENGTHS, SPLIT, assert_split_rows, deleted, long_masks, mask_rows,
                             packed_inputs, per_segment)
from op_checks.nonfinite import INTERPRETER_WARNINGS, LAYOUTS, SHAPES, quiet

OPS = ["vtrace"]
DEV = "cuda"  # the gpu_large tests' device


# ---- by hand, and on-policy as lambda-returns ----------------------------------------------------

def test_vtrace_by_hand(backend, device):
    r, v, no = t(1.0, 1.0).to(device), t(0.0, 0.0).to(device), flags(0, 0).to(device)
    lv = torch.zeros(1, device=device)
    zero = t(0.0, 0.0).to(device)
    vs, pg = rl_triton.vtrace(r, v, no, zero, zero, last_value=lv, gamma=1.0, backend=backend)
    close(vs, [2.0, 1.0])
    close(pg, [2.0, 1.0])
    # target twice as likely at t=0: rho_0 clipped to 1, c_0 clipped to 1; pg clipped to 1
    tlp = t(float(torch.log(torch.tensor(2.0))), 0.0).to(device)
    vs, pg = rl_triton.vtrace(r, v, no, tlp, zero, last_value=lv, gamma=1.0, backend=backend)
    close(vs, [2.0, 1.0])
    # without clipping: delta_0 = 2 * 1, c_0 = 2 -> vs_0 = 2 + 2 * 1 = 4; pg_0 = 2 * (1 + 1)
    vs, pg = rl_triton.vtrace(r, v, no, tlp, zero, last_value=lv, gamma=1.0, rho_clip=5.0,
                              c_clip=5.0, pg_rho_clip=5.0, backend=backend)
    close(vs, [4.0, 1.0])
    close(pg, [4.0, 1.0])
    # half the target probability at t=1: vs_1 = .5, vs_0 = 1 + .5 * 1 ... with lam = 1
    tlp = t(0.0, float(torch.log(torch.tensor(0.5)))).to(device)
    vs, pg = rl_triton.vtrace(r, v, no, tlp, zero, last_value=lv, gamma=1.0, backend=backend)
    close(vs, [1.0 + 0.5, 0.5])
    close(pg, [1.0 + 0.5, 0.5])


def test_onpolicy_vtrace_lambda_one_is_lambda_return(backend, device):
    c = make_case("gae", 150, (6,), device=device, seed=47)
    lp = torch.randn(c.steps["rewards"].shape, device=device)
    vs, _ = rl_triton.vtrace(**c.steps, target_log_probs=lp, behavior_log_probs=lp,
                             last_value=c.extra["last_value"], gamma=0.97, lam=1.0,
                             backend=backend)
    lr = rl_triton.lambda_returns(**c.steps, last_value=c.extra["last_value"], gamma=0.97,
                                  lam=1.0, backend=backend)
    assert rel_err(vs, lr) < 1e-5


# ---- an infinite trace coefficient beside a cut (semantics §1, §2) ------------------------------

@INTERPRETER_WARNINGS
def test_infinite_ratio_beside_a_termination(backend, device):
    """c_clip = inf and a ratio that overflows to inf: beta = gamma lam c is inf, and 0 * inf (the
    betas' product across the termination) must not carry a NaN to the steps before it; with
    lam = 0, c = 0 * inf is NaN by the formula (there only)."""
    inf, nan = float("inf"), float("nan")
    r, v = t(1.0, 1.0, 1.0, 1.0).to(device), t(0.0, 0.0, 0.0, 0.0).to(device)
    term, blp = flags(0, 1, 0, 0).to(device), t(0.0, 0.0, 0.0, 0.0).to(device)
    for at, lv, lam, vs_want, pg_want in (
            (3, 0.0, 1.0, [1.99, 1.0, 1.99, 1.0], [1.99, 1.0, 1.99, 1.0]),
            (2, 1.0, 1.0, [1.99, 1.0, inf, 1.99], [1.99, 1.0, 2.9701, 1.99]),
            (2, 1.0, 0.0, [1.0, 1.0, nan, 1.99], [1.0, 1.0, 1.0, 1.99])):
        tlp = torch.zeros(4, 1, device=device)
        tlp[at] = 100.0  # exp(100) is inf in float32
        vs, pg = rl_triton.vtrace(r, v, term, tlp, blp,
                                  last_value=torch.tensor([lv], device=device), gamma=0.99,
                                  lam=lam, c_clip=inf, backend=backend)
        for got, want in ((vs, vs_want), (pg, pg_want)):
            got = got.flatten().cpu()
            assert torch.equal(got.isnan(), torch.tensor(want).isnan()), (at, lam, got)
            fine = ~torch.tensor(want).isnan()
            torch.testing.assert_close(got[fine], torch.tensor(want)[fine])


# ---- NaN log-probabilities give NaN (semantics §1) -----------------------------------------------

@INTERPRETER_WARNINGS
@pytest.mark.parametrize("which", ["target_log_probs", "behavior_log_probs"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,N", SHAPES)
def test_vtrace_nan_log_prob_gives_nan(which, backend, layout, T, N, device):
    """A NaN log-probability at step j makes ratio[j] NaN: rho[j], c[j] and the pg clip of step j
    use it, so vs and pg_advantages are NaN at j and at every step before it in the episode
    (through D and vs'), and finite after it. It is never clipped into a finite ratio."""
    case = make_case("vtrace", T, (N,), device=device, seed=T + N)
    quiet(case)
    j = T // 2
    case.steps[which][j, N - 1] = math.nan
    vs, pg = case.call(layout, backend=backend)
    want = torch.zeros(T, N, dtype=torch.bool)
    want[:j + 1, N - 1] = True
    assert torch.equal(torch.isnan(vs.cpu()), want), vs
    assert torch.equal(torch.isnan(pg.cpu()), want), pg
    assert torch.isfinite(vs.cpu()[~want]).all() and torch.isfinite(pg.cpu()[~want]).all()


# ---- gradients (semantics §6) --------------------------------------------------------------------

def test_vtrace_backward_sub_tiles(device):
    """V-trace's backward holds many values per step (`tiles.choose`'s `heavy`): its time-major
    tiles run one sub-tile per step a thread holds (2 at 8 values per thread: 512x4096 on an
    H200). Here 37 steps x 5 rows take 8 values per thread, so 2 sub-tiles (default: 1)."""
    with tiles.rule(ELEMENTS_PER_THREAD_HEAVY_TIME_MAJOR=8):
        cfg = tiles.choose(37, 5, time_contiguous=False, device=torch.device(device),
                           exclusive=True, aux=True, heavy=True)
        assert cfg.sub == 2, cfg
        clear_plans()  # plans keep the tiles of the rule they were built under
        try:
            triton_vs_reference("vtrace", 37, (5,), "time-major", per_row=True, device=device)
        finally:
            clear_plans()


# ---- a mask and next_values: vs is next_values at the last decision step, on the kernel ----------

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


# ---- on a CUDA device only (gpu_large) -----------------------------------------------------------

@pytest.mark.parametrize("layout", ["time-major", "transposed-view", "batch-major"])
@pytest.mark.gpu_large
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


@pytest.mark.parametrize("shape", [(512, 4096), (4, 1048576), (16384, 64)])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.gpu_large
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


@pytest.mark.gpu_large
def test_packed_vtrace_next_values_large(monkeypatch):
    """Packed V-trace with a mask and next_values, in place (padded rows refused): 512
    segments summing to 512 x 4096 tokens (every 37th empty) against float64."""
    monkeypatch.setattr(rl_triton._core.scan.ScanOp, "_padded", refuse)
    lengths = random_lengths(512, 512 * 4096, seed=7, empty_every=37)
    assert all(e < 1e-5 for e in packed_against_float64("vtrace", lengths, True,
                                                        bootstrap="next_values"))


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
