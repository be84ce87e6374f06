"""On a CUDA device: the C++ host path of launch plans (rl_triton/_triton/host.py) is taken from
a plan's second call on, and gives exactly what the Python path gives."""
import pytest
import torch

import rl_triton
from rl_triton import estimators
from cases import ESTIMATORS, assert_close, make_case

DEV = "cuda"


def _plans():
    return [p for k, p in estimators._PLANS.items()]


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("T,n", [(37, (5,)), (4096, (3,)), (333, (300,))])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_host_path_matches_the_python_path(name, T, n, layout):
    """One tile per row, look-back, several row tiles: the C++ path is taken from the second
    call on, and its outputs are those of the Python path, bit for bit."""
    case = make_case(name, T, n, device=DEV, seed=21)
    estimators._PLANS.clear()
    first = case.call(layout, backend="triton")
    (plan,) = _plans()
    assert plan.host is not None
    calls = []
    real = plan.host_run
    plan.host_run = lambda *a: calls.append(1) or real(*a)
    second = case.call(layout, backend="triton")
    assert calls == [1]
    plan.host, plan.host_run = None, None  # the Python path
    third = case.call(layout, backend="triton")
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert_close(second, case.reference())


def test_host_path_new_outputs_and_new_scalars():
    """Every call gets its own outputs, and scalars are read per call."""
    case = make_case("gae", 256, (7,), device=DEV, seed=4)
    s, lv = case.steps, case.extra["last_value"]
    estimators._PLANS.clear()
    outs = [rl_triton.gae(**s, last_value=lv, gamma=g, lam=0.9) for g in (0.5, 0.9, 0.99)]
    assert len(_plans()) == 1 and _plans()[0].host is not None
    ptrs = {o.data_ptr() for pair in outs for o in pair}
    assert len(ptrs) == 6
    for g, out in zip((0.5, 0.9, 0.99), outs):
        ref = case.ref(**s, last_value=lv, gamma=g, lam=0.9)
        assert_close(out, ref)
