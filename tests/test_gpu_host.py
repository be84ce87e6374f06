"""On a CUDA device: the C++ host path of launch plans (rl_triton/_triton/host.py) is taken from
a plan's second call on, and gives what the Python path gives (to float32 rounding)."""
import pytest
import torch

import rl_triton
from rl_triton import estimators
from cases import ESTIMATORS, assert_close, make_case

DEV = "cuda"


def _plans():
    return list(estimators._PLANS.values())


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("T,n", [(37, (5,)), (4096, (3,)), (333, (300,))])
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_host_path_matches_the_python_path(name, T, n, layout):
    """One tile per row, look-back, several row tiles: from the second call on, the C++ table
    finds the plan and runs it; its outputs are those of the Python path (to rounding: where
    rows span several tiles, the order in which a tile composes its predecessors' carries
    depends on which of them had finished)."""
    case = make_case(name, T, n, device=DEV, seed=21)
    estimators._PLANS.clear()
    first = case.call(layout, backend="triton")
    (plan,) = _plans()
    assert plan.host is not None
    ((key, entry),) = estimators._FAST.items()
    ran = []
    estimators._FAST[key] = lambda t, s: ran.append(entry(t, s)) or ran[-1]
    by_table = case.call(layout, backend="triton")
    assert len(ran) == 1 and ran[0] is not None
    estimators._FAST.clear()  # the Python path
    by_python = case.call(layout, backend="triton")
    assert estimators._FAST == {}
    for out in (first, by_table):
        assert_close(out, by_python, tol=1e-6)
    assert_close(by_table, case.reference())


def test_host_table_tells_signatures_apart():
    """Same shapes, other strides or dtypes: another plan, right results."""
    case = make_case("gae", 100, (6,), device=DEV, seed=8)
    ref = case.reference()
    estimators._PLANS.clear()
    for _ in range(2):
        assert_close(case.call(backend="triton"), ref)
    s = case.steps
    wide = {k: torch.zeros(v.shape[0], 2 * v.shape[1], dtype=v.dtype, device=DEV)[:, ::2]
            for k, v in s.items()}
    for k in s:
        wide[k].copy_(s[k])
    for _ in range(2):
        assert_close(rl_triton.gae(**wide, **case.extra), ref)
    half = make_case("gae", 100, (6,), dtype=torch.bfloat16, device=DEV, seed=8)
    for _ in range(2):
        assert_close(half.call(backend="triton"), half.reference())
    assert len(estimators._PLANS) == 3
    estimators._PLANS.clear()
    assert estimators._FAST == {}


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


def test_host_scratch_outlives_the_python_plan():
    """The C++ plan holds its look-back scratch: a table entry that outlives its Python plan
    (the plan cache replaced, as a test's monkeypatch would) still runs correctly."""
    case = make_case("gae", 8192, (4,), device=DEV, seed=12)  # look-back: scratch in use
    ref = case.reference()
    estimators._PLANS.clear()
    case.call(backend="triton")
    fast = dict(estimators._FAST)
    estimators._PLANS.clear()  # drops the plans and the table ...
    estimators._FAST.update(fast)  # ... the table comes back, the Python plan does not
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    for _ in range(3):
        assert_close(case.call(backend="triton"), ref)
    estimators._PLANS.clear()


def test_uncached_plans_get_no_host_plan(monkeypatch):
    """Batch axes that no two strides describe are copied and their plan is run once and dropped:
    no C++ plan is made for it (the parameter walk and `host.make` would be wasted). The same
    call on contiguous inputs makes one, once."""
    from rl_triton._triton import host
    made = []
    make = host.make
    monkeypatch.setattr(host, "make", lambda *a, **k: made.append(1) or make(*a, **k))
    case = make_case("gae", 23, (2, 3, 2), device=DEV, seed=19)
    ref = case.reference()
    permuted = {k: (None if v is None else v.permute(3, 1, 0, 2).contiguous().permute(2, 1, 3, 0))
                for k, v in case.steps.items()}
    estimators._PLANS.clear()
    for _ in range(2):
        assert_close(rl_triton.gae(**permuted, **case.extra), ref)
    assert made == [] and _plans() == []
    for _ in range(2):
        assert_close(case.call(backend="triton"), ref)
    assert made == [1] and len(_plans()) == 1
    estimators._PLANS.clear()
