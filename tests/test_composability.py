"""The Triton backend as PyTorch custom ops: traced by torch.compile without graph breaks.

On the CPU the kernels run in Triton's interpreter and the graph runs with the aot_eager
backend (the custom ops' fake implementations, schemas and output rules are what is checked);
the GPU suite compiles with Inductor and captures CUDA graphs (tests/test_gpu.py).
"""
import pytest
import torch

import rl_triton
from cases import ESTIMATORS, assert_close, make_case


@pytest.mark.parametrize("name", ESTIMATORS)
def test_fullgraph_compile_matches_eager(name, device):
    case = make_case(name, 23, (4,), device=device, seed=3)
    steps = case.steps

    def step(**tensors):
        out = case.fn(**tensors, **case.extra, backend="triton")
        out = out if isinstance(out, tuple) else (out,)
        return tuple(o * 2.0 for o in out)  # something around the op, so there is a graph

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(**steps)
    assert_close(tuple(g / 2.0 for g in got), case.reference())


def test_ops_are_registered():
    for name in ("gae", "lambda_returns", "discounted_returns", "vtrace", "retrace",
                 "eligibility_traces", "episodic_cumsum", "linear_scan"):
        assert hasattr(torch.ops.rl_triton, name)


def test_eager_calls_reuse_the_launch_plan(device):
    """Repeated calls with one signature take the cached plan; new scalars are honoured."""
    from rl_triton import _plans
    case = make_case("gae", 31, (3,), device=device, seed=8)
    _plans._PLANS.clear()
    a1 = rl_triton.gae(**case.steps, last_value=case.extra["last_value"], gamma=0.9, lam=0.8,
                       backend="triton")
    assert len(_plans._PLANS) == 1
    a2 = rl_triton.gae(**case.steps, last_value=case.extra["last_value"], gamma=0.5, lam=0.3,
                       backend="triton")
    assert len(_plans._PLANS) == 1
    for out, (g, l) in ((a1, (0.9, 0.8)), (a2, (0.5, 0.3))):
        ref = rl_triton.gae(**case.steps, last_value=case.extra["last_value"], gamma=g, lam=l,
                            backend="loop")
        assert_close(out, ref, tol=1e-6)
    with pytest.raises(ValueError, match="gamma=2.0"):  # scalars are checked on the fast path
        rl_triton.gae(**case.steps, last_value=case.extra["last_value"], gamma=2.0,
                      backend="triton")


def test_compiled_calls_reuse_the_launch_plan(device):
    """Inside a compiled step the custom op looks its plan up like an eager call: one plan (and
    one look-back scratch) for every call with one signature."""
    from rl_triton import _plans

    def step(r, v, term, trunc, lv):
        adv, ret = rl_triton.gae(r, v, term, trunc, last_value=lv, backend="triton")
        return adv * 1.0, ret

    torch._dynamo.reset()
    _plans._PLANS.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for seed in (1, 2):
        case = make_case("gae", 40, (3,), device=device, seed=seed)
        s = case.steps
        got = compiled(s["rewards"], s["values"], s["terminated"], s["truncated"],
                       case.extra["last_value"])
        ref = rl_triton.gae(**s, last_value=case.extra["last_value"], backend="loop")
        assert_close(got, ref, tol=1e-5)
    assert [key[0] for key in _plans._PLANS] == ["gae"]
