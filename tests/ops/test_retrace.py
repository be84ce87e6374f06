"""`retrace` (docs/semantics.md §3): by hand and its identities (lambda = 0, on-policy state
values), the action axis (many actions, vectors and blocks, the bootstrap state, forward and
backward), NaN probabilities, and masked and packed calls on its kernel. The checks every scan op
shares (tests/ops/op_checks: every backend, layout and dtype against the float64 reference,
gradcheck and the Triton backward, masks, packed rows, non-finite inputs, large shapes) run here for
it too."""
import dataclasses
import math

import pytest
import torch

import rl_triton
from rl_triton._core import plans as _plans
from rl_triton.ops import retrace as retrace_op
from rl_triton.scan import tiles
from by_hand import close, flags, successor, t
from by_hand import backend  # noqa: F401 (a fixture: every backend)
from cases import BACKENDS, assert_close, make_case, rel_err, to_layout
import op_checks
from op_checks.gradients import (assert_grads_close, call, differentiable, grads, reference_grads,
                                 weights_like)
from op_checks.masks import (BOOTS, SPLIT, assert_split_rows, deleted, long_masks, mask_rows,
                             packed_inputs, per_segment)
from op_checks.nonfinite import INTERPRETER_WARNINGS, LAYOUTS, SHAPES, quiet

OPS = ["retrace"]


# ---- by hand, and its identities -----------------------------------------------------------------

def test_retrace_by_hand(backend, device):
    # two steps, two actions; pi uniform, mu(a_t) = 1 -> c = lam * min(1, .5) = .5
    r = t(1.0, 1.0).to(device)
    q = torch.tensor([[[1.0, 3.0]], [[2.0, 4.0]]], device=device)
    pi = torch.full((2, 1, 2), 0.5, device=device)
    actions = torch.tensor([[0], [1]], device=device)
    mu = torch.ones(2, 1, device=device)
    lq, lpi = torch.tensor([[6.0, 2.0]], device=device), torch.tensor([[0.25, 0.75]],
                                                                          device=device)
    no = flags(0, 0).to(device)
    g, adv = rl_triton.retrace(r, q, actions, pi, mu, no, last_q_values=lq,
                               last_target_probs=lpi, gamma=1.0, lam=1.0, backend=backend,
                               return_advantages=True)
    # G1 = 1 + E_last = 1 + (1.5 + 1.5) = 4
    # G0 = 1 + E_1 + c_1 * (G1 - Q(s1, a1)) = 1 + 3 + .5 * (4 - 4) = 4
    close(g, [4.0, 4.0])
    close(adv, [4.0 - 1.0, 4.0 - 4.0])
    g = rl_triton.retrace(r, q, actions, pi, mu, flags(1, 0).to(device), last_q_values=lq,
                          last_target_probs=lpi, gamma=1.0, backend=backend)
    close(g, [1.0, 4.0])


def test_retrace_lambda_zero_is_expected_sarsa(backend, device):
    c = make_case("retrace", 80, (4,), device=device, seed=53)
    s, e = c.steps, c.extra
    g = rl_triton.retrace(**s, last_q_values=e["last_q_values"],
                          last_target_probs=e["last_target_probs"], gamma=0.9, lam=0.0,
                          backend=backend)
    expected = (s["target_probs"] * s["q_values"]).sum(-1)
    expected = torch.cat([expected[1:], (e["last_target_probs"] * e["last_q_values"]).sum(-1)[None]])
    target = s["rewards"] + 0.9 * (~s["terminated"]) * expected
    assert rel_err(g, target) < 1e-5


def test_retrace_onpolicy_state_values_is_bootstrapped_return(backend, device):
    c = make_case("retrace", 80, (4,), device=device, seed=59)
    s, e = c.steps, c.extra
    state_v = torch.randn(s["rewards"].shape, device=device)
    q = state_v[..., None].expand_as(s["q_values"])  # Q(s, a) = V(s) for every a
    pi_taken = s["target_probs"].gather(-1, s["actions"][..., None]).squeeze(-1)
    last_v = torch.randn(s["rewards"].shape[1:], device=device)
    g = rl_triton.retrace(s["rewards"], q, s["actions"], s["target_probs"], pi_taken,
                          s["terminated"], s["truncated"],
                          last_q_values=last_v[..., None].expand_as(e["last_q_values"]),
                          last_target_probs=e["last_target_probs"], gamma=0.9, lam=1.0,
                          backend=backend)
    ret = rl_triton.discounted_returns(s["rewards"], s["terminated"], s["truncated"],
                                       next_values=successor(state_v, last_v), gamma=0.9,
                                       backend=backend)
    assert rel_err(g, ret) < 1e-5


# ---- the action axis, forward and backward -------------------------------------------------------

@INTERPRETER_WARNINGS
def test_infinite_trace_coefficient_beside_a_termination(backend, device):
    """c = lam min(c_clip, pi / mu) = -inf (a target probability of -inf, or a negative one over
    mu = 0) two steps after a termination: its 0 * inf in the betas' product must not carry a
    NaN to the terminated step (docs/semantics.md §1); G[1] is NaN by the formula."""
    r, q = torch.ones(3, 1, device=device), torch.ones(3, 1, 2, device=device)
    actions = torch.zeros(3, 1, dtype=torch.long, device=device)
    term = flags(1, 0, 0).to(device)
    lq, lpi = torch.ones(1, 2, device=device), torch.full((1, 2), 0.5, device=device)
    for pi_bad, mu_bad in ((-math.inf, 0.5), (-0.5, 0.0)):
        pi = torch.full((3, 1, 2), 0.5, device=device)
        mu = torch.full((3, 1), 0.5, device=device)
        pi[2, 0, 0], mu[2, 0] = pi_bad, mu_bad
        got = rl_triton.retrace(r, q, actions, pi, mu, term, last_q_values=lq,
                                last_target_probs=lpi, backend=backend).flatten().cpu()
        assert got[1].isnan(), got
        torch.testing.assert_close(got[[0, 2]], torch.tensor([1.0, 1.99]))


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_infinite_bootstrap_q_value_gradient(backend, device):
    """G[T-1] = r + g sum_a pi(a|s_T) Q(s_T, a): with Q(s_T, a0) = -inf its gradient to
    pi(a0|s_T) is g * -inf, the others' g Q (the loop formed the expectation at every step and
    dropped it by a select: 0 * inf = NaN)."""
    g = torch.Generator().manual_seed(0)
    T, N, A = 3, 1, 3
    r, q = torch.randn(T, N, generator=g), torch.randn(T, N, A, generator=g)
    pi = torch.softmax(torch.randn(T, N, A, generator=g), -1)
    lq, lpi = torch.randn(N, A, generator=g), torch.softmax(torch.randn(N, A, generator=g), -1)
    lq[0, 0] = -torch.inf
    lpi = lpi.to(device).requires_grad_()
    G = rl_triton.retrace(r.to(device), q.to(device), torch.zeros(T, N, dtype=torch.long,
                          device=device), pi.to(device), torch.full((T, N), 0.5, device=device),
                          torch.zeros(T, N, device=device), last_q_values=lq.to(device),
                          last_target_probs=lpi, gamma=0.9, backend=backend)
    G[T - 1].sum().backward()
    want = 0.9 * lq[0]
    assert lpi.grad[0, 0].item() == -torch.inf
    torch.testing.assert_close(lpi.grad[0, 1:].cpu(), want[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradient_passes_at_the_clip_tie(backend, device, dtype):
    """pi(a_t | s_t) = mu(a_t | s_t) exactly at every step: the ratio is 1, a tie at c_clip = 1,
    where min(c_clip, ratio)'s gradient passes (docs/semantics.md §6, as torch.clamp's), so
    every decision step's d mu is the ratio's. A check of the GPU's division: pi / mu by its
    default, approximate one can land an ulp above 1 and drop the gradient (the likely cause of
    1.2% of Retrace's bfloat16 gradient at 16384x1024 on the H200); the interpreter divides
    exactly, so on the CPU this holds either way."""
    T, N = (1024, 256) if device == "cuda" else (37, 50)  # many ties where it matters
    c = make_case("retrace", T, (N,), device=device, seed=11, dtype=dtype)
    c.steps["behavior_probs"] = c.steps["target_probs"].gather(
        -1, c.steps["actions"][..., None])[..., 0].requires_grad_()
    out = c.fn(**c.steps, **c.extra, backend=backend)
    weights = weights_like(out)
    got = grads(out, weights, {"mu": c.steps["behavior_probs"]})["mu"]

    def f64(d):  # the same values in float64, for the reference
        return {k: v.detach().double() if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in d.items()}

    ref = dataclasses.replace(c, steps=f64(c.steps), extra=f64(c.extra))
    want = reference_grads(ref, {"mu": ref.steps["behavior_probs"].requires_grad_()},
                           weights)["mu"]
    assert (want != 0).double().mean() > 0.5  # the ties carry a gradient
    torch.testing.assert_close(got.double(), want, rtol=1e-2 if dtype is torch.bfloat16 else 1e-4,
                               atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_retrace_many_actions(backend, device):
    case = make_case("retrace", 45, (3,), n_act=37, device=device, seed=2)
    assert_close(case.call("batch-major", backend=backend), case.reference())


@pytest.mark.parametrize("n_act", [2, 8, 18])
@pytest.mark.parametrize("storage", ["contiguous", "offset", "padded", "batch-major"])
def test_retrace_action_vectors(n_act, storage, device):
    """Rows of an even number of actions are loaded several actions at a time
    (`ops.action_vector`: float32 pairs for 18 actions, fours for 8), when the data is 16-byte
    aligned and every stride even; q-values and target probabilities that start 4 bytes into
    their storage, or whose rows are padded to n_act + 1 values, are loaded one action at a
    time. The same results every way (each its own plan)."""
    case = make_case("retrace", 37, (5,), n_act=n_act, device=device, seed=n_act)
    for k in ("q_values", "target_probs"):
        x = case.steps[k]
        if storage == "offset":
            y = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
        elif storage == "padded":
            y = torch.empty(*x.shape[:-1], n_act + 1, dtype=x.dtype, device=x.device)[..., :n_act]
        else:
            continue
        case.steps[k] = y.copy_(x)
    layout = "batch-major" if storage == "batch-major" else "time-major"
    assert_close(case.call(layout), case.reference())


@pytest.mark.parametrize("layout", ["batch-major", "time-major"])
def test_retrace_action_blocks_bound_the_vectors(layout, device):
    """2-byte rows walk their actions in blocks of 2, 4-byte rows in blocks of 8
    (`tiles.action_block`); a vector along actions never spans more than a block, although
    rows of 16 bfloat16 actions could load 8 at a time."""
    case = make_case("retrace", 37, (5,), dtype=torch.bfloat16, device=device, seed=7, n_act=16)
    _plans._PLANS.clear()
    assert_close(case.call(layout, backend="triton"), case.reference(), tol=1e-5)
    (plan,) = _plans._PLANS.values()
    assert (plan.meta["BLOCK_A"], plan.meta["ACT_BLOCKS"], plan.meta["ACT_VEC"]) == (2, 8, 2)


def test_action_vector_rule():
    from rl_triton.scan.launch import action_vector
    f32 = torch.zeros(6, 4, 18)
    assert action_vector([f32, f32[0]], 18) == 2  # per-step rows and the bootstrap row
    assert action_vector([torch.zeros(6, 4, 8)], 8) == 4
    assert action_vector([torch.zeros(6, 4, 16, dtype=torch.bfloat16)], 16) == 8  # 16 bytes
    assert action_vector([torch.zeros(6, 4, 19)[..., :18]], 18) == 1  # rows 19 values apart
    assert action_vector([torch.zeros(6 * 4 * 18 + 1)[1:].view(6, 4, 18)], 18) == 1  # 4 bytes in
    assert action_vector([torch.zeros(6, 18, 4).transpose(1, 2)], 18) == 1  # actions strided
    assert action_vector([torch.zeros(6, 4, 5)], 5) == 1
    assert action_vector([f32, torch.zeros(6, 4, 19)[..., :18]], 18) == 1  # all or none


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.parametrize("last_dtype", [None, torch.bfloat16], ids=["same-dtype", "bfloat16"])
def test_retrace_bootstrap_state(layout, last_dtype, device):
    """E[T-1] comes from the bootstrap state. Where every tile spans its rows' whole window
    (`retrace_op.coef_whole`), the action blocks read the bootstrap's rows at
    t = T-1 when they share Q's and pi's dtypes, else a pass of its own does (bfloat16 bootstrap
    tensors); where rows span several tiles, the tile holding T-1 does: all against the
    reference, in one-row tiles (batch-major 128 x 1) and tiles of several rows."""
    for T, n, block_t, block_b in ((37, 5, 64, 4), (37, 5, 64, 1), (37, 5, 16, 2),
                                   (100, 3, 128, 1)):
        case = make_case("retrace", T, (n,), device=device, seed=T + block_b, n_act=18)
        if last_dtype is not None:
            case.extra.update({k: case.extra[k].to(last_dtype)
                               for k in ("last_q_values", "last_target_probs")})
        _plans._PLANS.clear()
        with tiles.override(block_t=block_t, block_b=block_b):
            assert_close(case.call(layout, backend="triton"), case.reference())
            (plan,) = _plans._PLANS.values()
        whole = block_t >= T
        assert (plan.meta["COEF"] is retrace_op.coef_whole) is whole


@pytest.mark.parametrize("n_act,storage,layout", [
    (8, "contiguous", "time-major"), (18, "offset", "time-major"), (18, "padded", "time-major"),
    (18, "contiguous", "batch-major"), (37, "contiguous", "batch-major")])
def test_retrace_backward_action_axis(n_act, storage, layout, device):
    """Retrace's backward reads Q and pi along their action axis in blocks in its writer and
    writes their gradients there: rows of 8 and 18 actions loaded 4 and 2 at a time
    (`launch.action_vector`), one at a time where they start 4 bytes into their storage or are
    padded to n_act + 1 values, and 37 actions in several blocks."""
    case, leaves = differentiable("retrace", 37, (5,), dtype=torch.float32, n_act=n_act,
                                  device=device)
    for k in ("q_values", "target_probs"):
        x = leaves[k].detach()
        if storage == "offset":
            y = torch.empty(x.numel() + 1, device=x.device)[1:].view(x.shape)
        elif storage == "padded":
            y = torch.empty(*x.shape[:-1], n_act + 1, device=x.device)[..., :n_act]
        else:
            y = torch.empty_like(x)
        leaves[k] = case.steps[k] = y.copy_(x).detach().requires_grad_()
    out = call(case, leaves, list(leaves.values()), layout, backend="triton")
    weights = weights_like(out)
    got = grads(out, weights, leaves)
    ref_case, ref_leaves = differentiable("retrace", 37, (5,), n_act=n_act, device=device)
    for k, v in ref_leaves.items():
        v.data.copy_(leaves[k].detach().double())
    want = reference_grads(ref_case, ref_leaves, weights)
    assert_grads_close(got, {k: v.float() for k, v in want.items()}, 1e-4)


# ---- NaN probabilities give NaN (semantics §1) ---------------------------------------------------

@INTERPRETER_WARNINGS
@pytest.mark.parametrize("which", ["taken target prob", "other target prob", "behavior prob"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,N", SHAPES)
def test_retrace_nan_probability_gives_nan(which, backend, layout, T, N, device):
    """A NaN pi(a | s_j) or mu(a_j | s_j) at step j: the trace coefficient c[j] (pi / mu of the
    action taken) or the expectation E[j-1] (any action) is NaN, so G and G - Q are NaN at every
    step before j in the episode, and finite from j on (slot 0 is read by no step)."""
    case = make_case("retrace", T, (N,), device=device, seed=T + N)
    quiet(case)
    j = T // 2
    a = int(case.steps["actions"][j, N - 1])
    if which == "behavior prob":
        case.steps["behavior_probs"][j, N - 1] = math.nan
    else:
        n_act = case.steps["target_probs"].shape[-1]
        case.steps["target_probs"][j, N - 1, a if which.startswith("taken") else (a + 1) % n_act] \
            = math.nan
    outs = case.call(layout, backend=backend)
    want = torch.zeros(T, N, dtype=torch.bool)
    want[:j, N - 1] = True
    for out in outs:
        assert torch.equal(torch.isnan(out.cpu()), want), out
        assert torch.isfinite(out.cpu()[~want]).all()


# ---- masked and packed calls run its kernel, never the torch backend -----------------------------

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


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
