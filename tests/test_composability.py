"""The Triton backend as PyTorch custom ops: traced by torch.compile without graph breaks.

On the CPU the kernels run in Triton's interpreter and the graph runs with the aot_eager
backend (the custom ops' fake implementations, schemas and output rules are what is checked);
the GPU suite compiles with Inductor and captures CUDA graphs (the gpu_large tests of tests/ops).
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


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_fullgraph_compile_batch_major_with_gradients(name, backend, device):
    """The torch backend (and the Triton backend's masked calls with gradients, which run its
    code) compiled on batch-major inputs that require grad: both outputs and the gradients as
    eager (torch.compile merged the two outputs' equal torch.empty calls into one tensor)."""
    from cases import to_layout
    device = device if backend == "triton" else "cpu"
    case = make_case(name, 9, (4,), device=device, seed=5)
    mask = None if backend == "torch" or name.startswith("linear_scan") else \
        (torch.rand(4, 9, generator=torch.Generator().manual_seed(1)) < 0.7).to(device)
    floats = [k for k, v in case.steps.items() if v is not None and v.is_floating_point()
              and k not in ("terminated", "truncated", "dones")]
    extra = dict(case.extra)  # (Retrace's actions check: not traced, on every backend)

    def step(*xs):
        steps = {k: to_layout(v, "batch-major") for k, v in case.steps.items()}
        steps.update(zip(floats, xs))
        out = case.fn(**steps, **extra, time_dim=1, backend=backend,
                      **({} if mask is None else {"mask": mask}))
        return out if isinstance(out, tuple) else (out,)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        xs = [to_layout(case.steps[k], "batch-major").clone().requires_grad_() for k in floats]
        out = fn(*xs)
        grads = torch.autograd.grad(sum(o.sum() * (i + 1) for i, o in enumerate(out)), xs)
        results.append((out, grads))
    (want, want_g), (got, got_g) = results
    assert len(got) == len(want)
    for a, b in zip((*got, *got_g), (*want, *want_g)):
        torch.testing.assert_close(a, b)


def test_ops_are_registered():
    """Every op of the registry has its custom op, and its backward where it has gradients."""
    from rl_triton._core.op import OPS, UNDECLARED, ops
    assert len(ops()) == len(OPS)
    assert ops() + list(UNDECLARED) == rl_triton.__all__
    for name in ops():
        assert getattr(torch.ops.rl_triton, name) is not None
        assert hasattr(torch.ops.rl_triton, name + "_backward") == OPS[name].differentiable


def test_eager_calls_reuse_the_launch_plan(device):
    """Repeated calls with one signature take the cached plan; new scalars are honoured."""
    from rl_triton._core import plans as _plans
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
    from rl_triton._core import plans as _plans

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


PACKED_LENGTHS = [3, 0, 2]  # an empty segment between two


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["gae", "lambda_returns", "discounted_returns", "vtrace",
                                  "retrace", "eligibility_traces", "episodic_cumsum"])
def test_packed_fullgraph_compile_matches_eager(name, backend, device):
    """Packed rows (cu_seqlens, with a mask) under torch.compile(fullgraph=True): forward and
    gradients of every floating input equal eager's (the torch implementation on the packed
    row, traced). On the Triton backend a call without gradients runs the in-place kernels as
    a custom op, which reads and checks the offsets at run time."""
    from rl_triton.testing import make_packed_inputs
    features = (2,) if name == "eligibility_traces" else ()
    steps, extra, cu = make_packed_inputs(name, PACKED_LENGTHS, features=features,
                                          device=device, seed=4, dtype=torch.float64)
    L = int(cu[-1])
    steps["mask"] = torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool, device=device)[:L]
    tensors = {k: v for k, v in {**steps, **extra}.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in extra.items() if k not in tensors}
    leaves = [k for k, v in tensors.items() if v.is_floating_point()]
    fn = getattr(rl_triton, name)

    def step(cu, **tensors):
        out = fn(**tensors, **others, cu_seqlens=cu, backend=backend)
        out = out if isinstance(out, tuple) else (out,)
        return tuple(o * 2.0 for o in out)

    def run(f):
        inputs = {k: v.clone().requires_grad_(k in leaves) for k, v in tensors.items()}
        outs = f(cu, **inputs)
        loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype, device=device)
                    .reshape(o.shape)).sum() for o in outs)
        return outs, torch.autograd.grad(loss, [inputs[k] for k in leaves])

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    want, want_grads = run(step)
    got, got_grads = run(compiled)
    assert_close(got, want, tol=1e-6)
    for k, a, b in zip(leaves, got_grads, want_grads):
        torch.testing.assert_close(a, b, msg=k)
    if backend == "triton":
        with torch.no_grad():
            assert_close(compiled(cu, **tensors), step(cu, **tensors), tol=1e-6)
            bad = cu.clone()
            bad[1] = L + 1
            with pytest.raises(ValueError, match="cu_seqlens"):
                compiled(bad, **tensors)


def test_packed_fullgraph_compile_per_segment_discounts(device):
    """A tensor gamma and lam, one per segment, under torch.compile(fullgraph=True): their
    gradients (and the inputs') equal eager's, on the torch and Triton backends."""
    from rl_triton.testing import make_packed_inputs
    steps, extra, cu = make_packed_inputs("gae", PACKED_LENGTHS, device=device, seed=6,
                                          dtype=torch.float64)
    disc = dict(gamma=torch.tensor([0.9, 0.5, 0.7], dtype=torch.float64, device=device),
                lam=torch.tensor([0.8, 0.6, 0.95], dtype=torch.float64, device=device))
    for backend in ("torch", "triton"):
        def step(r, lv, gamma, lam):
            adv, ret = rl_triton.gae(r, steps["values"], steps["terminated"], steps["truncated"],
                                     last_value=lv, gamma=gamma, lam=lam, cu_seqlens=cu,
                                     backend=backend)
            return adv, ret * 1.0

        def run(f):
            args = [t.clone().requires_grad_() for t in (steps["rewards"], extra["last_value"],
                                                         disc["gamma"], disc["lam"])]
            adv, ret = f(*args)
            return (adv, ret), torch.autograd.grad((adv * ret).sum(), args)

        torch._dynamo.reset()
        want, want_grads = run(step)
        got, got_grads = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
        assert_close(got, want, tol=1e-6)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b)
