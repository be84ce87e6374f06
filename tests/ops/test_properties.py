"""Property-based tests: random shapes, layouts and flag patterns against the references; and
the gradients of every estimator at a zero discount and at a cut, on every backend."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_triton.scan import tiles
from conftest import DEVICE
from cases import ESTIMATORS, FLAG_DTYPES, assert_close, make_case
from op_checks.gradients import (assert_grads_close, call, differentiable, grads, reference_grads,
                                 weights_like)

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(name=st.sampled_from(ESTIMATORS), T=st.integers(1, 90), n=st.integers(1, 7),
       layout=st.sampled_from(["time-major", "batch-major", "transposed-view"]),
       backend=st.sampled_from(["torch", "triton"]), flag_dtype=st.sampled_from(FLAG_DTYPES),
       p_term=st.sampled_from([0.0, 0.05, 0.5, 1.0]), p_trunc=st.sampled_from([0.0, 0.1, 1.0]),
       trunc=st.booleans(), seed=st.integers(0, 2**16))
def test_random_cases(name, T, n, layout, backend, flag_dtype, p_term, p_trunc, trunc, seed,
                      device):
    case = make_case(name, T, (n,), device=device, flag_dtype=flag_dtype, trunc=trunc,
                     p_term=p_term, p_trunc=p_trunc, seed=seed)
    assert_close(case.call(layout, backend=backend), case.reference())


@SETTINGS
@given(name=st.sampled_from(ESTIMATORS), T=st.integers(17, 200), n=st.integers(1, 4),
       block_t=st.sampled_from([16, 32]), window=st.sampled_from([1, 2, 4]),
       depth=st.sampled_from([0, 1, 3]), walk=st.booleans(), time_major=st.booleans(),
       sub=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_random_splits(name, T, n, block_t, window, depth, walk, time_major, sub, seed, device):
    """Any split of the time axis into tiles, carried by look-back (any window, read whole or in
    part) or by a program walking its row, and time-major tiles in any number of sub-tiles, give
    the same result."""
    case = make_case(name, T, (n,), device=device, seed=seed)
    with tiles.override(block_t=block_t, block_b=2, window=window, depth=depth, walk=walk,
                         sub=sub):
        out = case.call("time-major" if time_major else "batch-major", backend="triton")
    assert_close(out, case.reference())


# ---- gradients at a zero discount and at a cut (docs/semantics.md §6) ----------------------------
# A beta of 0 is a select in the values; its gradient is still the product's: d beta[t] =
# H[t] A[t+1] (the adjoint of §6), so a per-row gamma or lam of exactly 0 gets the gradient of
# the formula. A cut (a flag, the window end) is a select in the values and in the gradients:
# nothing after it reaches d gamma or d lam, inf and NaN included.

DISCOUNTED = [n for n in ESTIMATORS if n not in ("episodic_cumsum", "linear_scan_reverse",
                                                 "linear_scan_forward")]


def zero_discounts(name, dtype, device="cpu"):
    """A case (T = 5, 3 rows) with per-row gamma and lam leaves: gamma 0 in row 0, lam 0 in row
    1 (gamma 0 in rows 0 and 1 where there is no lam)."""
    case, leaves = differentiable(name, 5, (3,), dtype=dtype, per_row=True, device=device)
    with torch.no_grad():
        case.extra["gamma"][0] = 0.0
        if "lam" in case.extra:
            case.extra["lam"][1] = 0.0
        else:
            case.extra["gamma"][1] = 0.0
    return case, leaves


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("name", DISCOUNTED)
def test_gradcheck_at_zero_discounts(name, backend):
    """gradcheck (the finite differences of every input, gamma and lam too) at gamma = 0 and
    lam = 0: the torch and loop backends differentiated their selects, d beta = 0 there."""
    case, leaves = zero_discounts(name, torch.float64)
    assert torch.autograd.gradcheck(
        lambda *values: call(case, leaves, values, "time-major", backend=backend,
                             out_dtype=torch.float64), tuple(leaves.values()))


@pytest.mark.parametrize("name", DISCOUNTED)
def test_triton_gradients_at_zero_discounts(name, device):
    """The Triton backward at gamma = 0 and lam = 0, against the float64 loop's gradients (which
    the gradcheck above checks)."""
    case, leaves = zero_discounts(name, torch.float32, device)
    out = call(case, leaves, list(leaves.values()), "time-major", backend="triton")
    weights = weights_like(out)
    got = grads(out, weights, leaves)
    ref_case, ref_leaves = zero_discounts(name, torch.float64, device)
    for k, v in ref_leaves.items():
        v.data.copy_(leaves[k].detach().double())
    want = reference_grads(ref_case, ref_leaves, weights)
    # the zero discounts' own gradients are not 0 (the selects' were)
    assert got["gamma"][0] != 0 and ("lam" not in got or got["lam"][1] != 0)
    assert_grads_close(got, {k: w.to(leaves[k].dtype) for k, w in want.items()}, 1e-4)


def spoiled_after_a_cut(name, value, where, backend):
    """d gamma and d lam (per row) of a case whose rows all end an episode at step 2 (a
    termination; a done for the forward scans), with `value` in the episode after it (reverse
    scans: rewards[3]; forward scans: x[2], before the done) or, with where="bootstrap", a
    termination at T-1 and `value` in the bootstrap (last_value, last_q_values), which it drops.
    The loss weighs the outputs of the other episode only."""
    T, k = 6, 2
    device = DEVICE if backend == "triton" else "cpu"
    case, leaves = differentiable(name, T, (3,), dtype=torch.float32, per_row=True, trunc=False,
                                  device=device)
    forward = "dones" in case.steps
    flag = "dones" if forward else "terminated"
    spot = T - 1 if where == "bootstrap" else k
    case.steps[flag] = torch.zeros_like(case.steps[flag])
    case.steps[flag][spot] = True
    with torch.no_grad():
        if where == "bootstrap":
            boot = "last_q_values" if name == "retrace" else "last_value"
            leaves[boot].fill_(value)
        else:
            leaves["x" if forward else "rewards"][k if forward else k + 1] = value
    out = call(case, leaves, list(leaves.values()), "time-major", backend=backend)
    steps = torch.arange(T, device=device)[:, None]
    keep = (steps > k) if forward else (steps <= k)
    if where == "bootstrap":
        keep = torch.ones_like(keep)
    loss = sum((torch.where(keep.reshape(keep.shape + (1,) * (o.ndim - 2)), o, 0.0)).sum()
               for o in out)
    d = torch.autograd.grad(loss, [leaves[n] for n in ("gamma", "lam") if n in leaves])
    return torch.cat(d).cpu()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
@pytest.mark.parametrize("where", ["episode", "bootstrap"])
@pytest.mark.parametrize("name", DISCOUNTED)
def test_no_gradient_crosses_a_cut(name, where, backend):
    """A NaN or inf after a cut (or in a bootstrap a termination drops) reaches neither the
    outputs before it nor d gamma, d lam: they are those of the same call with 0 there."""
    if where == "bootstrap" and name in ("eligibility_traces",):
        pytest.skip("no bootstrap after the window")
    clean = spoiled_after_a_cut(name, 0.0, where, backend)
    assert torch.isfinite(clean).all()
    for value in (float("nan"), float("inf")):
        got = spoiled_after_a_cut(name, value, where, backend)
        assert torch.isfinite(got).all(), (value, got)
        torch.testing.assert_close(got, clean, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", DISCOUNTED)
def test_non_finite_per_row_discounts(name, device):
    """Per-row discounts are not range-checked (§6): a NaN gamma or lam, and gamma = inf with
    lam = 0 (a beta of inf * 0), give NaN where the formula uses them and never cross a cut;
    every backend gives the loop's NaN pattern, and the other rows' values."""
    case = make_case(name, 11, (4,), device=device, p_term=0.2, p_trunc=0.1, seed=3)
    nan, inf = float("nan"), float("inf")
    lam = "lam" in case.extra
    gamma = [nan, 0.97, inf, 0.97] if lam else [nan, 0.97, nan, 0.97]
    case.extra["gamma"] = torch.tensor(gamma, device=device)
    if lam:
        case.extra["lam"] = torch.tensor([0.9, nan, 0.0, 0.9], device=device)
    want = case.call(backend="loop")
    for backend in ("torch", "triton"):
        for o, w in zip(case.call(backend=backend), want):
            assert torch.equal(o.isnan(), w.isnan()), (backend, o, w)
            assert torch.equal(o.isinf(), w.isinf()), (backend, o, w)
            fine = torch.isfinite(w)
            torch.testing.assert_close(o[fine], w[fine], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(o[:, 3]).all()
