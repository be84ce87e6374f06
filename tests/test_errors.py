"""Bad input: a clear exception naming the argument, before any kernel runs."""
import pathlib
import re

import pytest
import torch

import rl_triton
from cases import BACKENDS, make_case
from conftest import DEVICE


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def gae_args(T=6, N=3, device=DEVICE):
    return dict(rewards=torch.randn(T, N, device=device), values=torch.randn(T, N, device=device),
                terminated=torch.zeros(T, N, dtype=torch.bool, device=device),
                last_value=torch.randn(N, device=device))


def raises(exc, match, fn, **kw):
    with pytest.raises(exc, match=match):
        fn(**kw)


def test_mismatched_shapes_name_both(backend):
    a = gae_args()
    a["values"] = torch.randn(6, 4, device=DEVICE)
    raises(ValueError, r"values has shape \(6, 4\) but rewards has shape \(6, 3\)", rl_triton.gae,
           **a, backend=backend)
    a = gae_args()
    a["terminated"] = torch.zeros(5, 3, dtype=torch.bool, device=DEVICE)
    raises(ValueError, r"terminated has shape \(5, 3\)", rl_triton.gae, **a, backend=backend)
    a = gae_args()
    a["last_value"] = torch.randn(6, device=DEVICE)
    raises(ValueError, r"last_value has shape \(6,\) .* must have shape \(3,\)", rl_triton.gae,
           **a, backend=backend)
    raises(ValueError, r"last_value has shape \(3,\) .* must have shape \(6,\)", rl_triton.gae,
           **gae_args(), time_dim=1, backend=backend)


def test_retrace_shapes(backend):
    c = make_case("retrace", 5, (2,))
    s, e = c.steps, dict(c.extra)
    bad = dict(s, target_probs=s["target_probs"][..., :3])
    raises(ValueError, r"target_probs has shape \(5, 2, 3\)", rl_triton.retrace, **bad, **e,
           backend=backend)
    bad = dict(s, q_values=s["rewards"])
    raises(ValueError, r"q_values has shape \(5, 2\)", rl_triton.retrace, **bad, **e,
           backend=backend)
    e2 = dict(e, last_q_values=None)
    raises(ValueError, r"last_q_values is required", rl_triton.retrace, **s, **e2,
           backend=backend)
    bad = dict(s, actions=s["actions"].float())
    raises(TypeError, r"actions has dtype torch.float32; expected an integer dtype",
           rl_triton.retrace, **bad, **e, backend=backend)


def test_forward_shapes(backend):
    raises(ValueError, r"x has shape \(4, 3\) but dones has shape \(5, 3\)",
           rl_triton.episodic_cumsum, x=torch.randn(4, 3), dones=torch.zeros(5, 3),
           backend=backend)
    raises(ValueError, r"initial has shape \(3,\) .* must have shape \(3, 2\)",
           rl_triton.eligibility_traces, x=torch.randn(5, 3, 2), dones=torch.zeros(5, 3),
           initial=torch.zeros(3), gamma=0.9, lam=0.9, backend=backend)
    raises(ValueError, r"beta has shape \(5, 2\) but alpha has shape \(5, 3\)",
           rl_triton.linear_scan, alpha=torch.randn(5, 3), beta=torch.randn(5, 2),
           backend=backend)


def test_dtypes(backend):
    for name, dt, msg in [("rewards", torch.complex64, "rewards has dtype torch.complex64"),
                          ("values", torch.int32, "values has dtype torch.int32"),
                          ("terminated", torch.complex64, "terminated has dtype")]:
        a = gae_args()
        a[name] = a[name].to(dt)
        raises(TypeError, msg, rl_triton.gae, **a, backend=backend)
    raises(TypeError, "out_dtype must be one of", rl_triton.gae, **gae_args(), backend=backend,
           out_dtype=torch.int32)
    raises(TypeError, "rewards must be a torch.Tensor", rl_triton.gae,
           **dict(gae_args(), rewards=[1.0, 2.0]), backend=backend)


def test_dtypes_the_kernels_do_not_take(backend):
    """float8 flags, masks and values, and the unsigned integers torch does not reduce (uint16
    and wider) as actions, labels or group ids: a TypeError naming the argument on every
    backend (the loop and torch backends took some of them, the kernels failed on them)."""
    a = gae_args()
    for name in ("terminated", "rewards"):
        raises(TypeError, f"{name} has dtype torch.float8_e4m3fn", rl_triton.gae,
               **dict(a, **{name: a[name].to(torch.float8_e4m3fn)}), backend=backend)
    raises(TypeError, "mask has dtype torch.float8_e5m2", rl_triton.gae, **a, backend=backend,
           mask=torch.ones(6, 3, device=DEVICE).to(torch.float8_e5m2))
    lp = torch.randn(2, 4, device=DEVICE)
    raises(TypeError, "mask has dtype torch.float8_e5m2", rl_triton.ppo_policy_loss,
           log_probs=lp, old_log_probs=lp, advantages=lp, backend=backend,
           mask=torch.ones(2, 4, device=DEVICE).to(torch.float8_e5m2))
    f8 = torch.randn(6, device=DEVICE).to(torch.float8_e4m3fn)
    raises(TypeError, "scores has dtype torch.float8", rl_triton.group_advantages, scores=f8,
           group_size=3, backend=backend)
    raises(TypeError, "x has dtype torch.float8", rl_triton.masked_whiten, x=f8, backend=backend)
    raises(TypeError, "log_probs has dtype torch.float8", rl_triton.rollout_correction,
           log_probs=f8, rollout_log_probs=f8, backend=backend)
    raises(TypeError, "group_index has dtype torch.complex64", rl_triton.group_advantages,
           scores=f8.float(), group_index=torch.zeros(6, dtype=torch.complex64, device=DEVICE),
           backend=backend)
    case = make_case("retrace", 5, (2,), n_act=3, device=DEVICE)
    raises(TypeError, "actions has dtype torch.uint16", case.fn,
           **dict(case.steps, actions=case.steps["actions"].to(torch.uint16)), **case.extra,
           backend=backend)
    if backend != "loop":  # (the fused head has the torch and triton backends)
        h, w = torch.randn(3, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE)
        raises(TypeError, "labels has dtype torch.uint32", rl_triton.token_log_probs,
               hidden=h, weight=w, labels=torch.zeros(3, dtype=torch.uint32, device=DEVICE),
               backend=backend)


def test_offsets_and_counts_on_devices_without_data(backend):
    """Offsets and verl's global counts on the meta device (no values to read), and counts of
    a dtype that is no count: an error naming them."""
    lp = torch.randn(5, device=DEVICE)
    meta = torch.tensor([0, 2, 5]).to("meta")
    raises(ValueError, "cu_seqlens is on meta", rl_triton.ppo_policy_loss, log_probs=lp,
           old_log_probs=lp, advantages=lp, cu_seqlens=meta, aggregation="seq-mean-token-mean",
           backend=backend)
    raises(ValueError, "cu_seqlens is on meta", rl_triton.gae, rewards=lp, values=lp,
           terminated=lp > 5, last_value=lp[:2], cu_seqlens=meta, backend=backend)
    lp = torch.randn(2, 4, device=DEVICE)
    for count, exc, msg in [(torch.tensor(True), TypeError, "batch_num_tokens has dtype"),
                            (torch.tensor(6 + 1j), TypeError, "batch_num_tokens has dtype"),
                            (torch.tensor(6.0, device="meta"), ValueError,
                             "batch_num_tokens is on meta")]:
        raises(exc, msg, rl_triton.policy_loss, log_probs=lp, old_log_probs=lp, advantages=lp,
               batch_num_tokens=count, dp_size=2, backend=backend)


def test_devices(backend):
    a = gae_args()
    a["values"] = a["values"].to("meta")
    raises(ValueError, "values is on meta but rewards is on (cpu|cuda)", rl_triton.gae, **a,
           backend=backend)


def test_time_dim(backend):
    raises(ValueError, r"time_dim=2 is out of range for rewards with shape \(6, 3\)",
           rl_triton.gae, **gae_args(), time_dim=2, backend=backend)
    raises(ValueError, "time_dim=-3 is out of range", rl_triton.gae, **gae_args(), time_dim=-3,
           backend=backend)
    raises(TypeError, "time_dim must be an int", rl_triton.gae, **gae_args(), time_dim=0.0,
           backend=backend)
    raises(TypeError, "time_dim must be an int", rl_triton.gae, **gae_args(), time_dim=[0],
           backend=backend)
    raises(ValueError, "must have a time axis", rl_triton.gae,
           **dict(gae_args(), rewards=torch.tensor(1.0)), backend=backend)


def test_options_and_scalars(backend):
    raises(ValueError, "backend must be one of", rl_triton.gae, **gae_args(), backend="cuda")
    raises(ValueError, r"gamma=1.5 is outside \[0.0, 1.0\]", rl_triton.gae, **gae_args(),
           gamma=1.5, backend=backend)
    raises(ValueError, "lam=-0.1 is outside", rl_triton.gae, **gae_args(), lam=-0.1,
           backend=backend)
    raises(TypeError, "gamma is a tensor of dtype torch.int64", rl_triton.gae, **gae_args(),
           gamma=torch.tensor([1, 1, 1]), backend=backend)
    raises(ValueError, r"lam has shape \(2,\), which does not broadcast to the batch shape",
           rl_triton.gae, **gae_args(), lam=torch.full((2,), 0.9), backend=backend)
    raises(TypeError, "gamma must be a real number", rl_triton.gae, **gae_args(),
           gamma="0.9", backend=backend)
    raises(ValueError, "gamma=nan", rl_triton.gae, **gae_args(), gamma=float("nan"),
           backend=backend)
    c = make_case("vtrace", 5, (2,))
    raises(ValueError, r"rho_clip=0.0 is outside \(0.0, inf\)", rl_triton.vtrace, **c.steps,
           **dict(c.extra, rho_clip=0.0), backend=backend)
    raises(TypeError, "reverse must be a bool", rl_triton.linear_scan, alpha=torch.randn(3, 2),
           beta=torch.randn(3, 2), reverse="yes", backend=backend)


def test_missing_or_double_bootstrap(backend):
    a = gae_args()
    del a["last_value"]
    for fn in (rl_triton.gae, rl_triton.lambda_returns):
        raises(ValueError, "pass last_value .* or next_values", fn, **a, backend=backend)
    raises(ValueError, "values is required", rl_triton.lambda_returns,
           **dict(a, values=None, last_value=torch.randn(3, device=DEVICE)), backend=backend)
    c = make_case("vtrace", 5, (2,))
    raises(ValueError, "pass last_value", rl_triton.vtrace,
           **c.steps, **{k: v for k, v in c.extra.items() if k != "last_value"}, backend=backend)
    raises(ValueError, "not both", rl_triton.gae, **gae_args(),
           next_values=torch.randn(6, 3, device=DEVICE),
           backend=backend)
    # discounted returns: a missing bootstrap means zero, no error
    rl_triton.discounted_returns(a["rewards"], a["terminated"], backend=backend)


def test_packed_shapes_name_the_callers(backend):
    """Packed rows (cu_seqlens): every backend names the shapes the caller passed and the
    number of segments, never the padded rows some backends run."""
    cu = torch.tensor([0, 2, 6], device=DEVICE)
    for batch in ((), (3,)):
        a = {k: v if batch else v[:, 0] for k, v in gae_args(6, 3).items() if k != "last_value"}
        want = "(2,)" if not batch else "(2, 3)"
        for lv in (torch.randn(3, device=DEVICE), torch.randn(2, 4, device=DEVICE)):
            raises(ValueError, rf"last_value has shape {re.escape(str(tuple(lv.shape)))} but "
                   rf"cu_seqlens has 2 segments; last_value must have shape {re.escape(want)}",
                   rl_triton.gae, **dict(a, last_value=lv), cu_seqlens=cu, backend=backend)
        lv = torch.randn((2,) + batch, device=DEVICE)
        bad = torch.randn((5,) + batch, device=DEVICE)
        shape = re.escape(str(tuple(a["rewards"].shape)))
        raises(ValueError, rf"values has shape {re.escape(str(tuple(bad.shape)))} but rewards "
               rf"has shape {shape}", rl_triton.gae, **dict(a, last_value=lv, values=bad),
               cu_seqlens=cu, backend=backend)
        raises(ValueError, r"gamma has shape \(3,\) but cu_seqlens has 2 segments",
               rl_triton.gae, **dict(a, last_value=lv), gamma=torch.full((3,), 0.9),
               cu_seqlens=cu, backend=backend)
    c = make_case("retrace", 6, (2,), device=DEVICE)
    steps = {k: None if v is None else v[:, 0] for k, v in c.steps.items()}
    raises(ValueError, r"last_q_values has shape \(3, 5\) but cu_seqlens has 2 segments; "
           r"last_q_values must have shape \(2, 5\)", rl_triton.retrace, **steps,
           **dict(c.extra, last_q_values=torch.randn(3, 5, device=DEVICE),
                  last_target_probs=torch.rand(2, 5, device=DEVICE)),
           cu_seqlens=cu, backend=backend)
    raises(ValueError, r"initial has shape \(3,\) but cu_seqlens has 2 segments",
           rl_triton.episodic_cumsum, x=torch.randn(6, device=DEVICE),
           dones=torch.zeros(6, device=DEVICE), initial=torch.zeros(3, device=DEVICE),
           cu_seqlens=cu, backend=backend)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    """Kernels defined without the interpreter (a GPU machine, or TRITON_INTERPRET set only
    after the import) refuse CPU tensors, saying what to do in either case."""
    from rl_triton.scan import jit
    monkeypatch.setattr(jit, "INTERPRETER", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    raises(ValueError, "set TRITON_INTERPRET=1 before triton is imported", rl_triton.gae,
           **gae_args(device="cpu"), backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    raises(ValueError, "was set after rl_triton was imported", rl_triton.gae,
           **gae_args(device="cpu"), backend="triton")


def test_no_assert_for_argument_checking():
    """Asserts vanish under python -O: the package uses none."""
    root = pathlib.Path(rl_triton.__file__).parent
    for path in root.rglob("*.py"):
        assert not re.search(r"^\s*assert\b", path.read_text(), re.M), path
