"""Large shapes of the scan ops on a CUDA device only (marked gpu_large; shared checks, run in
each op's module): long rows, many rows, masks kept or dropped.

Large shapes are checked against the vectorized torch backend run in float64 (itself checked
against the sequential references at small shapes), since a Python loop over 2^20 steps is slow.
"""
import pytest

from rl_triton.testing import vectorized
from cases import ESTIMATORS, assert_close, make_case, per_op

DEV = "cuda"


def float64_vectorized(case):
    return vectorized(case.name, **case.steps, **case.extra)


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("T,batch", [(2**20, (1,)), (16, (2**20,)), (3 * 2**17 + 5, (3,))])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.gpu_large
def test_large_shapes(name, T, batch, layout):
    n_act = 18
    case = make_case(name, T, batch, device=DEV, seed=T % 97, n_act=n_act, p_term=0.001,
                     p_trunc=0.001)
    assert_close(case.call(layout, backend="triton"), float64_vectorized(case))


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("T,batch", [(128, (256,)), (1000, (130,)), (4096, (300,)), (77, (1000,))])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.gpu_large
def test_many_row_tiles_and_segments(name, T, batch, layout):
    """Several row tiles, each cut into several tiles along time (the default tile rule), with
    one program per tile (look-back) and one per row tile (walking the row)."""
    case = make_case(name, T, batch, device=DEV, seed=T + batch[0])
    assert_close(case.call(layout, backend="triton"), float64_vectorized(case))


@per_op("name", ["gae", "vtrace", "episodic_cumsum", "linear_scan_reverse"])
@pytest.mark.gpu_large
def test_one_row_of_2_pow_24_steps(name):
    case = make_case(name, 2**24, (1,), device=DEV, seed=1, p_term=1e-5, p_trunc=1e-5)
    assert_close(case.call("batch-major", backend="triton"), float64_vectorized(case))


@per_op("name,T,n,layout,full", [
    ("gae", 1024, 16384, "time-major", True),  # Triton 3.6: 64 -> 56 registers without masks
    ("vtrace", 2**20, 4, "batch-major", True),  # one-warp look-back tiles, 80 registers (capped)
    ("gae", 1000, 16384, "time-major", False),  # T not a multiple of the tile
])
@pytest.mark.gpu_large
def test_full_tiles_drop_their_masks_where_that_keeps_the_warps(name, T, n, layout, full,
                                                                monkeypatch):
    """A plan whose tiles divide the problem compiles its kernel with and without masks at its
    first launch and runs the one `launch.even_keeps_occupancy` picks (its rule:
    tests/test_config.py); other plans keep their masks. Either way the results are exact."""
    from rl_triton._core import plans as _plans
    from rl_triton.scan import launch
    picked = []
    rule = launch.even_keeps_occupancy
    monkeypatch.setattr(launch, "even_keeps_occupancy",
                        lambda *a, **k: picked.append(rule(*a, **k)) or picked[-1])
    _plans._PLANS.clear()
    case = make_case(name, T, (n,), device=DEV, seed=3)
    assert_close(case.call(layout, backend="triton"), float64_vectorized(case))
    (plan,) = _plans._PLANS.values()
    assert picked == ([plan.meta["EVEN"]] if full else [])
    assert full or not plan.meta["EVEN"]
