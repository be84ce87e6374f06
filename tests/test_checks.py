"""Checks on every call, views read as their values, Retrace's actions (gradients, and never a
silent detach: tests/ops/op_checks/gradients.py)."""
import pytest
import torch

import rl_triton
from cases import BACKENDS, make_case
from conftest import DEVICE


def _gae_args(T=7, N=3):
    g = torch.Generator().manual_seed(0)
    a = dict(rewards=torch.randn(T, N, generator=g), values=torch.randn(T, N, generator=g),
             terminated=torch.rand(T, N, generator=g) < 0.2, last_value=torch.randn(N, generator=g))
    return {k: v.to(DEVICE) for k, v in a.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [1.0, True, "1"])
def test_checks_run_on_every_call(backend, bad):
    """A cached launch plan never skips a check: a call with time_dim=1 first, then the same
    tensors with time_dim 1.0 / True / "1", which hash like 1 or name it."""
    a = _gae_args()
    for _ in range(3):
        rl_triton.gae(**a, time_dim=0, backend=backend)
    with pytest.raises(TypeError, match="time_dim"):
        rl_triton.gae(**a, time_dim=bad, backend=backend)
    for name, value in [("gamma", "0.9"), ("lam", 1.5), ("backend", "cuda"),
                        ("out_dtype", torch.int32)]:
        kw = {"backend": backend, name: value}
        with pytest.raises((TypeError, ValueError), match=name):
            rl_triton.gae(**a, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_checks_after_a_cached_call(backend):
    a = _gae_args()
    rl_triton.gae(**a, backend=backend)
    rl_triton.gae(**a, backend=backend)
    with pytest.raises(ValueError, match="last_value"):
        rl_triton.gae(**dict(a, last_value=torch.randn(4, device=DEVICE)), backend=backend)
    with pytest.raises(TypeError, match="terminated"):
        rl_triton.gae(**dict(a, terminated=a["terminated"].to(torch.complex64)),
                      backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negated_view_is_read_as_its_values(backend):
    a = _gae_args()
    neg = torch._neg_view(-a["rewards"])
    assert neg.is_neg()
    want = rl_triton.gae(**a, backend=backend)
    got = rl_triton.gae(**dict(a, rewards=neg), backend=backend)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


def _one_input_calls(backend):
    """(name, x, f): the ops of semantics §8 to 11 as functions of one floating input."""
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    lp, old, adv, ids = rnd(4, 6), rnd(4, 6), rnd(4, 6), torch.tensor([2, 0, 2, 1, 0, 0])
    term = torch.tensor([True, False, False, True, False, False], device=DEVICE)
    yield "group_advantages", rnd(6), lambda s: rl_triton.group_advantages(
        s, group_size=3, backend=backend)
    yield "group_advantages(group_index)", rnd(6), lambda s: rl_triton.group_advantages(
        s, ids.to(DEVICE), scale="batch_std", backend=backend)
    yield "masked_whiten", lp, lambda x: rl_triton.masked_whiten(x, backend=backend)
    yield "ppo_policy_loss", lp, lambda x: rl_triton.ppo_policy_loss(x, old, adv,
                                                                     backend=backend)
    yield "policy_loss", adv, lambda a: rl_triton.policy_loss(lp, old, a, loss_type="gspo",
                                                              backend=backend)[0]
    yield "value_loss", old, lambda r: rl_triton.value_loss(lp, r, adv, clip=0.2,
                                                            backend=backend)
    yield "kl_penalty", lp, lambda x: rl_triton.kl_penalty(x, old, backend=backend)
    yield "rollout_correction", old, lambda x: rl_triton.rollout_correction(
        lp, x, backend=backend)[0]
    yield "sac_targets", rnd(6, 2), lambda q: rl_triton.sac_targets(
        adv[0], term, q, lp[0], backend=backend)
    yield "crr_weights", rnd(6, 3), lambda q: rl_triton.crr_weights(adv[0], q,
                                                                    backend=backend)
    if backend != "loop":  # (the fused head has the torch and triton backends)
        labels, weight = torch.tensor([1, 6, 0, 3], device=DEVICE), rnd(7, 5)
        yield "token_log_probs", rnd(4, 5), lambda h: rl_triton.token_log_probs(
            h, weight, labels, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_reads_a_negated_view_as_its_values(backend):
    """As `test_negated_view_is_read_as_its_values`, for every op that is not a scan, before
    and after calls with its plain twin validated the signature."""
    for name, x, f in _one_input_calls(backend):
        want = f(x)
        neg = torch._neg_view(-x)
        for _ in range(2):
            torch.testing.assert_close(f(neg), want, msg=name)
            f(-x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negated_offsets_are_read_as_their_values(backend):
    """cu_seqlens as a lazily negated view: the kernels read the offsets' values (they read its
    memory, the negated bits, where only the check resolved it)."""
    neg = torch._neg_view(-torch.tensor([0, 2, 5]))
    plain = torch.tensor([0, 2, 5])
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(5, generator=g).to(DEVICE), torch.randn(5, generator=g).to(DEVICE)
    term = torch.tensor([False, True, False, False, False], device=DEVICE)
    for f in (lambda cu: rl_triton.gae(r, v, term, last_value=v[:2], cu_seqlens=cu,
                                       backend=backend),
              lambda cu: rl_triton.ppo_policy_loss(r, v, r, cu_seqlens=cu, backend=backend,
                                                   aggregation="seq-mean-token-mean"),
              lambda cu: rl_triton.rollout_correction(r, v, cu_seqlens=cu, level="sequence",
                                                      backend=backend)):
        for a, b in zip(f(plain), f(neg)):
            torch.testing.assert_close(b, a)


@pytest.mark.parametrize("backend", BACKENDS)
def test_option_pairs_checked_after_a_cached_call(backend):
    """policy_loss's cov_bounds: (True, 5.0) equals (1.0, 5.0) as a key, and is refused after
    the plan of (1.0, 5.0) was cached as before it."""
    lp = torch.randn(2, 6, device=DEVICE)
    for _ in range(2):
        rl_triton.policy_loss(lp, lp, lp, loss_type="clip_cov", cov_bounds=(1.0, 5.0),
                              backend=backend)
    with pytest.raises(TypeError, match="cov_bounds"):
        rl_triton.policy_loss(lp, lp, lp, loss_type="clip_cov", cov_bounds=(True, 5.0),
                              backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [-1, 5, 1000, -(2**40)])
def test_retrace_actions_out_of_range(backend, value):
    """An action outside [0, num_actions) is a ValueError naming `actions` on every backend;
    with check_actions=False every backend clamps it (the kernel never reads outside its
    tensors): the same result as the clamped actions."""
    case = make_case("retrace", 11, (4,), n_act=5, device=DEVICE)
    actions = case.steps["actions"].clone()
    actions[6, 2] = value
    steps = dict(case.steps, actions=actions)
    with pytest.raises(ValueError, match="actions"):
        case.fn(**steps, **case.extra, backend=backend)
    got = case.fn(**steps, **case.extra, backend=backend, check_actions=False)
    clamped = dict(case.steps, actions=actions.clamp(0, 4))
    want = case.fn(**clamped, **case.extra, backend="loop")
    for w, g in zip(want, got):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["bool", "float", "int"])
def test_retrace_masked_actions_are_not_checked(backend, mask_kind):
    """An action outside [0, num_actions) at a masked step is ignored (semantics §3): no error,
    the result of any in-range action there; at a decision step it raises."""
    case = make_case("retrace", 11, (4,), n_act=5, device=DEVICE)
    mask = torch.ones(11, 4, dtype=torch.bool, device=DEVICE)
    mask[6, 2] = False
    m = mask.to({"bool": torch.bool, "float": torch.float32, "int": torch.int32}[mask_kind])
    actions = case.steps["actions"].clone()
    actions[6, 2] = 1000
    got = case.fn(**dict(case.steps, actions=actions), **case.extra, mask=m, backend=backend)
    want = case.fn(**case.steps, **case.extra, mask=m, backend=backend)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)
    actions[7, 2] = -3
    with pytest.raises(ValueError, match="actions holds -3"):
        case.fn(**dict(case.steps, actions=actions), **case.extra, mask=m, backend=backend)


@pytest.mark.parametrize("n", [1, 37, 1025, 333 * 50])
def test_action_range_kernel(n):
    """Retrace's action check on the GPU (`retrace.action_range`, one launch whose last program
    combines; here through the interpreter): the extremes of the decision steps' actions, 0
    counted, for every integer dtype, a mask of each kind or a broadcast one, beyond 512
    blocks; None where the layout is not one run of memory (torch reduces then)."""
    from rl_triton.ops.retrace import action_range
    g = torch.Generator().manual_seed(n)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        low = 0 if dtype is torch.uint8 else -40
        a = torch.randint(low, 90, (n,), generator=g).to(dtype)
        keep = torch.rand(n, generator=g) < 0.6
        masks = [(None, keep | True), (keep, keep), (keep.float(), keep),
                 (torch.ones((), dtype=torch.bool).expand(n), keep | True)]
        for m, kept in masks:
            ref = torch.where(kept, a.long(), 0)
            got = action_range(a.to(DEVICE), None if m is None else m.to(DEVICE))
            assert got == (min(0, ref.min().item()), max(0, ref.max().item()))
    big = torch.full((1024 * 600,), 3, dtype=torch.int64)
    big[-1] = 7  # in the last of 600 blocks, which 512 programs share
    assert action_range(big.to(DEVICE), None) == (0, 7)
    two = torch.arange(12, device=DEVICE).reshape(3, 4)
    assert action_range(two.t(), None) is None
    assert action_range(two, torch.ones(4, 3, dtype=torch.bool, device=DEVICE).t()) is None


def test_check_actions_must_be_bool():
    case = make_case("retrace", 5, (2,), device=DEVICE)
    with pytest.raises(TypeError, match="check_actions"):
        case.fn(**case.steps, **case.extra, check_actions=1)


class _Str(str):
    pass


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_validated_signature_admits_nothing_the_checks_refuse(backend):
    """The hot path (a call whose signature a validated call had, `_args.signature`) refuses
    what the checks refuse: options equal to validated ones but of another type, a flag that
    requires grad once grad mode is on, a tensor whose metadata changed in place."""
    a = _gae_args()
    b = dict(a, last_value=torch.randn(a["rewards"].shape[0], device=DEVICE))  # [N, T] rows
    for _ in range(3):
        rl_triton.gae(**b, time_dim=1, backend=backend, check_offsets=True)
    with pytest.raises(TypeError, match="time_dim"):
        rl_triton.gae(**b, time_dim=True, backend=backend)
    with pytest.raises(TypeError, match="check_offsets"):
        rl_triton.gae(**b, time_dim=1, backend=backend, check_offsets=1)
    with pytest.raises(ValueError, match="backend"):
        rl_triton.gae(**b, time_dim=1, backend=_Str(backend))
    term = a["terminated"].float().requires_grad_()
    with torch.no_grad():  # no gradient is asked for: the flag's requires_grad is harmless
        for _ in range(2):
            rl_triton.gae(**dict(a, terminated=term), backend=backend)
    with pytest.raises(RuntimeError, match="terminated requires grad"):
        rl_triton.gae(**dict(a, terminated=term), backend=backend)
    lv = a["last_value"].clone()
    rl_triton.gae(**dict(a, last_value=lv), backend=backend)
    lv.resize_(lv.shape[0] + 1)
    with pytest.raises(ValueError, match="last_value"):
        rl_triton.gae(**dict(a, last_value=lv), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_validated_signature_keeps_gradients(backend):
    """A tensor that requires grad gets its gradient after calls of the same tensors under
    no_grad, and after calls of a twin that does not require grad (grad mode and
    requires_grad are part of a signature): never a silent detach."""
    a = _gae_args()
    r = a["rewards"].clone().requires_grad_()
    with torch.no_grad():
        for _ in range(2):
            adv, _ = rl_triton.gae(**dict(a, rewards=r), backend=backend)
            assert not adv.requires_grad
    for _ in range(2):
        rl_triton.gae(**dict(a, rewards=r.detach().clone()), backend=backend)
    adv, _ = rl_triton.gae(**dict(a, rewards=r), backend=backend)
    (g,) = torch.autograd.grad(adv.sum(), r)
    ref = a["rewards"].clone().requires_grad_()
    want, _ = rl_triton.gae(**dict(a, rewards=ref), backend="loop")
    (g_want,) = torch.autograd.grad(want.sum(), ref)
    torch.testing.assert_close(g, g_want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negated_view_after_its_signature_was_validated(backend):
    """A negated view has its own signature: after calls with its plain twin (same shape,
    strides, dtype, device) it is still read as its values."""
    a = _gae_args()
    plain = -a["rewards"]
    for _ in range(2):
        rl_triton.gae(**dict(a, rewards=plain), backend=backend)
    want = rl_triton.gae(**a, backend=backend)
    got = rl_triton.gae(**dict(a, rewards=torch._neg_view(plain)), backend=backend)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_retrace_actions_checked_after_a_validated_call(backend):
    """Data checks run on every call, the hot path's too: the same tensors, valid twice, then an
    action out of range written in place."""
    case = make_case("retrace", 11, (4,), n_act=5, device=DEVICE)
    actions = case.steps["actions"].clone()
    steps = dict(case.steps, actions=actions)
    for _ in range(2):
        case.fn(**steps, **case.extra, backend=backend)
    actions[6, 2] = 5
    with pytest.raises(ValueError, match="actions"):
        case.fn(**steps, **case.extra, backend=backend)
