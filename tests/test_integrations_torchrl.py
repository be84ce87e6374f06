"""TorchRL integration: rl_triton's estimators equal TorchRL's on the same TensorDict."""
import pytest
import torch
from torch import nn

pytest.importorskip("torchrl")
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torchrl.modules import ProbabilisticActor  # noqa: E402
from torchrl.objectives import A2CLoss, ClipPPOLoss  # noqa: E402
from torchrl.objectives.utils import ValueEstimators  # noqa: E402
from torchrl.objectives.value import GAE, TD1Estimator, TDLambdaEstimator, VTrace  # noqa: E402

import rl_triton  # noqa: E402
from rl_triton.integrations.torchrl import (RLTritonGAE, RLTritonTD1Estimator,  # noqa: E402
                                            RLTritonTDLambdaEstimator, RLTritonVTrace,
                                            revert_rl_triton, use_rl_triton)

OBS = 3
LOG_PROB = VTrace(gamma=0.9, value_network=None, actor_network=None).tensor_keys.sample_log_prob


def _data(batch, time_dim, seed=0, p_term=0.08, p_trunc=0.08):
    """A rollout TensorDict with terminations and truncations kept apart (done = either)."""
    g = torch.Generator().manual_seed(seed)
    shape = list(batch)
    shape.insert(time_dim % (len(batch) + 1), None)
    T = 29
    shape = [T if s is None else s for s in shape]
    term = torch.rand(*shape, 1, generator=g) < p_term
    trunc = (torch.rand(*shape, 1, generator=g) < p_trunc) & ~term
    return TensorDict({
        "obs": torch.randn(*shape, OBS, generator=g),
        "done": torch.zeros(*shape, 1, dtype=torch.bool),
        "terminated": torch.zeros(*shape, 1, dtype=torch.bool),
        LOG_PROB: torch.randn(*shape, 1, generator=g) * 0.3 - 1.4,
        "action": torch.nn.functional.one_hot(torch.randint(4, shape, generator=g), 4),
        "next": {"obs": torch.randn(*shape, OBS, generator=g),
                 "reward": torch.randn(*shape, 1, generator=g),
                 "done": term | trunc, "terminated": term, "truncated": trunc},
    }, batch_size=shape)


def _value_net(seed=1):
    torch.manual_seed(seed)
    return TensorDictModule(nn.Linear(OBS, 1), in_keys=["obs"], out_keys=["state_value"])


def _actor(seed=2):
    torch.manual_seed(seed)
    return ProbabilisticActor(TensorDictModule(nn.Linear(OBS, 4), in_keys=["obs"],
                                               out_keys=["logits"]),
                              in_keys=["logits"], out_keys=["action"],
                              distribution_class=torch.distributions.OneHotCategorical,
                              return_log_prob=True)


@pytest.fixture
def spy(monkeypatch):
    """Counts the rl_triton calls, to be sure the integration did not fall back to TorchRL."""
    calls = []
    for name in ("gae", "lambda_returns", "vtrace"):
        fn = getattr(rl_triton, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            calls.append((_name, k.get("backend")))
            return _fn(*a, **k)
        monkeypatch.setattr(rl_triton, name, wrapped)
    return calls


PAIRS = [
    (GAE, RLTritonGAE, {"gamma": 0.97, "lmbda": 0.9}, "gae"),
    (TDLambdaEstimator, RLTritonTDLambdaEstimator, {"gamma": 0.97, "lmbda": 0.9},
     "lambda_returns"),
    (TD1Estimator, RLTritonTD1Estimator, {"gamma": 0.95}, "lambda_returns"),
]
LAYOUTS = [((4,), -1), ((4,), 0), ((2, 3), 2), ((2, 3), 1)]  # (batch shape, time_dim)


def _assert_same(ours, theirs):
    for key in ("advantage", "value_target"):
        assert ours[key].shape == theirs[key].shape and ours[key].dtype == theirs[key].dtype
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("theirs_cls,ours_cls,kwargs,fn", PAIRS)
@pytest.mark.parametrize("batch,time_dim", LAYOUTS)
def test_estimator_equals_torchrl(theirs_cls, ours_cls, kwargs, fn, batch, time_dim, spy):
    data = _data(batch, time_dim)
    assert (data["next", "done"] & ~data["next", "terminated"]).any()  # truncations present
    assert data["next", "terminated"].any()
    net = _value_net()
    theirs = theirs_cls(value_network=net, time_dim=time_dim, **kwargs)(data.clone())
    ours = ours_cls(value_network=net, time_dim=time_dim, **kwargs)(data.clone())
    _assert_same(ours, theirs)
    assert [c[0] for c in spy] == [fn]


@pytest.mark.parametrize("theirs_cls,ours_cls,kwargs,fn", PAIRS)
def test_precomputed_values_and_value_estimate(theirs_cls, ours_cls, kwargs, fn, spy):
    data = _data((5,), -1, seed=3)
    g = torch.Generator().manual_seed(4)
    data["state_value"] = torch.randn(5, 29, 1, generator=g)
    data["next", "state_value"] = torch.randn(5, 29, 1, generator=g)
    theirs, ours = theirs_cls(value_network=None, **kwargs), ours_cls(value_network=None, **kwargs)
    _assert_same(ours(data.clone()), theirs(data.clone()))
    # value_estimate, as DQN-style losses call it
    nv = data["next", "state_value"]
    torch.testing.assert_close(ours.value_estimate(data.clone(), next_value=nv) if fn != "gae"
                               else ours.value_estimate(data.clone()),
                               theirs.value_estimate(data.clone(), next_value=nv) if fn != "gae"
                               else theirs.value_estimate(data.clone()), rtol=1e-5, atol=1e-5)
    assert spy and all(c[0] == fn for c in spy)


def test_done_versus_terminated():
    # the same rollout read two ways: every done a termination, or every done a truncation
    data = _data((3,), -1, seed=5, p_term=0.0, p_trunc=0.2)
    net = _value_net()
    as_trunc = data.clone()
    as_term = data.clone()
    as_term["next", "terminated"] = as_term["next", "done"].clone()
    for d in (as_trunc, as_term):
        _assert_same(RLTritonGAE(gamma=0.9, lmbda=0.8, value_network=net)(d.clone()),
                     GAE(gamma=0.9, lmbda=0.8, value_network=net)(d.clone()))
    a = RLTritonGAE(gamma=0.9, lmbda=0.8, value_network=net)(as_trunc.clone())["advantage"]
    b = RLTritonGAE(gamma=0.9, lmbda=0.8, value_network=net)(as_term.clone())["advantage"]
    done = data["next", "done"]
    assert not torch.allclose(a[done], b[done])  # the bootstrap differs at the dones
    last_segment = done.flip(1).cumsum(1).flip(1) == 0  # no done from t on: same advantage
    assert last_segment.any()
    torch.testing.assert_close(a[last_segment], b[last_segment])


@pytest.mark.parametrize("batch,time_dim", [((4,), -1), ((4,), 0)])
@pytest.mark.parametrize("rho,c", [(1.0, 1.0), (2.0, 0.7)])
def test_vtrace_equals_torchrl(batch, time_dim, rho, c, spy):
    data = _data(batch, time_dim, seed=6)
    net, actor = _value_net(), _actor()
    kwargs = {"gamma": 0.96, "value_network": net, "actor_network": actor, "rho_thresh": rho,
              "c_thresh": c, "time_dim": time_dim}
    _assert_same(RLTritonVTrace(**kwargs)(data.clone()), VTrace(**kwargs)(data.clone()))
    assert [c[0] for c in spy] == ["vtrace"]


def test_ppo_loss_make_value_estimator_and_helper(spy):
    data = _data((4,), -1, seed=7)
    critic, actor = _value_net(), _actor()
    with torch.no_grad():
        actor(data)  # actions and their log-probabilities, as a collector stores them

    def losses(loss):
        torch.manual_seed(0)
        out = loss(data.clone())
        return {k: v.detach() for k, v in out.items() if k.startswith("loss_")}

    theirs = ClipPPOLoss(actor, critic)
    theirs.make_value_estimator(ValueEstimators.GAE, gamma=0.98, lmbda=0.9)
    ref = losses(theirs)
    assert not spy

    by_instance = ClipPPOLoss(actor, critic)
    by_instance.make_value_estimator(RLTritonGAE(gamma=0.98, lmbda=0.9, value_network=critic))
    got = losses(by_instance)
    assert spy and got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5)

    spy.clear()
    swapped = ClipPPOLoss(actor, critic)
    swapped.make_value_estimator(ValueEstimators.GAE, gamma=0.98, lmbda=0.9)
    est = use_rl_triton(swapped, backend="torch")
    assert type(est) is RLTritonGAE and swapped.value_estimator is est
    assert float(est.gamma) == pytest.approx(0.98) and float(est.lmbda) == pytest.approx(0.9)
    got = losses(swapped)
    assert spy == [("gae", "torch")]
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5)
    assert type(revert_rl_triton(swapped)) is GAE and "backend" not in vars(est)


def test_a2c_loss_with_td_lambda(spy):
    data = _data((3,), -1, seed=8)
    critic, actor = _value_net(), _actor()
    theirs, ours = A2CLoss(actor, critic), A2CLoss(actor, critic)
    for loss in (theirs, ours):
        loss.make_value_estimator(ValueEstimators.TDLambda, gamma=0.9, lmbda=0.7)
    use_rl_triton(ours)
    assert type(ours.value_estimator) is RLTritonTDLambdaEstimator
    a, b = theirs(data.clone()), ours(data.clone())
    for k in ("loss_objective", "loss_critic"):
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5)
    assert [c[0] for c in spy] == ["lambda_returns"]


@pytest.mark.parametrize("theirs_cls,ours_cls,kwargs,fn", PAIRS)
def test_values_that_carry_gradients_get_them(theirs_cls, ours_cls, kwargs, fn, spy):
    """`value_estimate` on values that require grad: rl_triton computes the call and its
    backward, and the values' gradients equal TorchRL's."""
    data = _data((5,), -1, seed=12)
    g = torch.Generator().manual_seed(5)
    values = torch.randn(5, 29, 1, generator=g)
    grads = []
    for cls in (theirs_cls, ours_cls):
        v, nv = values.clone().requires_grad_(), values.roll(-1, 1).clone().requires_grad_()
        td = data.clone()
        td["state_value"], td["next", "state_value"] = v, nv
        est = cls(value_network=None, **kwargs)
        out = est.value_estimate(td) if fn == "gae" else est.value_estimate(td, next_value=nv)
        (out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum().backward()
        grads.append([v.grad, nv.grad])  # TD(lambda) given next_value does not read v
    assert spy and all(c[0] == fn for c in spy)
    assert grads[0][1] is not None
    for ours, theirs in zip(grads[1], grads[0]):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_falls_back_to_torchrl_where_rl_triton_has_no_kernel(spy):
    data = _data((3,), -1, seed=9).apply(lambda t: t.double() if t.is_floating_point() else t)
    torch.manual_seed(0)
    net = TensorDictModule(nn.Linear(OBS, 1).double(), in_keys=["obs"], out_keys=["state_value"])
    _assert_same(RLTritonGAE(gamma=0.9, lmbda=0.9, value_network=net)(data.clone()),
                 GAE(gamma=0.9, lmbda=0.9, value_network=net)(data.clone()))
    assert not spy  # float64: TorchRL's own code ran
    with pytest.raises(ValueError, match="backend"):
        RLTritonGAE(gamma=0.9, lmbda=0.9, value_network=net, backend="fast")
    with pytest.raises(TypeError, match="expected a TorchRL"):
        use_rl_triton(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("theirs_cls,ours_cls,kwargs,fn", PAIRS[:2] + [
    (VTrace, RLTritonVTrace, {"gamma": 0.96, "rho_thresh": 1.5, "c_thresh": 0.9}, "vtrace")])
def test_triton_backend(theirs_cls, ours_cls, kwargs, fn, spy, device):
    """The kernels (on the GPU, or in Triton's interpreter) behind TorchRL's estimators."""
    data = _data((3,), -1, seed=10).to(device)
    if fn == "vtrace":
        kwargs = {**kwargs, "actor_network": _actor().to(device)}
    net = _value_net().to(device)
    ours = ours_cls(value_network=net, backend="triton", **kwargs)(data.clone())
    _assert_same(ours, theirs_cls(value_network=net, **kwargs)(data.clone()))
    assert spy == [(fn, "triton")]
