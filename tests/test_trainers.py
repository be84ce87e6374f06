"""The trainers in trainers/ run one or two tiny iterations with every credit backend (on the GPU
where there is one; elsewhere on the CPU, Triton through its interpreter), write the TensorBoard tags they promise, feed their loss the advantages
the specification defines at a truncation, and train identically whatever the backend."""


import importlib.util
import os
import pathlib
import shutil
import socket
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl_triton.testing import leave_rank, spawn_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainers"))  # as `python trainers/ppo.py` has it: they import gymnax_envs, data_parallel
BACKENDS = ["loop", "compile", "triton", "auto"]
CUDA = torch.cuda.is_available()  # the trainers run there: `triton` is the kernels, not the interpreter
# inductor's first compile costs ~45 s on a 2-core machine: the tests check the compile path's
# wiring through a cheaper torch.compile backend
COMPILE = dict(compile_backend="aot_eager")
PERF_TAGS = {"perf/rollout_ms", "perf/credit_ms", "perf/update_ms", "perf/credit_share"}


def load(name):
    spec = importlib.util.spec_from_file_location(f"trainer_{name}", ROOT / "trainers" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ppo():
    return load("ppo")


def scalars(run_dir):
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tiny_ppo_args(ppo, tmp_path, backend, **kw):
    args = dict(env_id="CartPole-v1", env_backend="gymnasium", credit_backend=backend,
                num_envs=2, num_steps=32, total_timesteps=128, update_epochs=1, num_minibatches=2,
                cuda=CUDA, log_dir=str(tmp_path), **COMPILE)
    args.update(kw)
    return ppo.Args(**args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ppo_logs(ppo, tmp_path, backend):
    _, run_dir = ppo.train(tiny_ppo_args(ppo, tmp_path, backend))
    assert pathlib.Path(run_dir).name.startswith(f"CartPole-v1__ppo__{backend}__1__")
    logged = scalars(run_dir)
    expected = PERF_TAGS | {"charts/episodic_return", "charts/SPS", "losses/value_loss",
                            "losses/policy_loss", "losses/entropy", "losses/approx_kl"}
    assert expected <= set(logged)
    assert len(logged["perf/credit_ms"]) == 2  # one per iteration
    assert all(0 < s < 1 for s in logged["perf/credit_share"])
    assert all(np.isfinite(v).all() for v in logged.values())


def test_ppo_backends_train_identically(ppo, tmp_path):
    params = {}
    for backend in BACKENDS:
        agent, _ = ppo.train(tiny_ppo_args(ppo, tmp_path / backend, backend, total_timesteps=64,
                                           update_epochs=2))
        params[backend] = torch.nn.utils.parameters_to_vector(agent.parameters()).detach()
    for backend in BACKENDS[1:]:
        torch.testing.assert_close(params[backend], params["loop"], rtol=0, atol=1e-5)
    assert not torch.equal(params["loop"], params["loop"] * 0)


def test_ppo_continuous(ppo, tmp_path):
    _, run_dir = ppo.train(tiny_ppo_args(ppo, tmp_path, "auto", env_id="Pendulum-v1",
                                         total_timesteps=64, reward_scale=0.1))
    assert PERF_TAGS <= set(scalars(run_dir))


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Breakout-v5"])
def test_ppo_envpool(ppo, tmp_path, env_id):
    """EnvPool (the trainers' default where installed; .ci/run installs it): a classic-control id
    and an Atari id (the Nature-CNN agent)."""
    pytest.importorskip("envpool")
    _, run_dir = ppo.train(tiny_ppo_args(ppo, tmp_path, "auto", env_backend="envpool",
                                         env_id=env_id, num_steps=8, total_timesteps=16))
    assert pathlib.Path(run_dir).name.startswith(f"{env_id}__ppo__auto__1__")
    assert PERF_TAGS <= set(scalars(run_dir))


# A chain with known episode boundaries. Observation [steps taken, kind]; reward 1 per step.
# kind 0 is cut by a time limit after 3 steps (truncation), kind 1 terminates after 2 steps.
class Chain(gym.Env):
    observation_space = gym.spaces.Box(-10, 10, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, kind):
        self.kind = kind

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.t, self.kind], np.float32), {}

    def step(self, action):
        self.t += 1
        terminated = self.kind == 1 and self.t == 2
        return np.array([self.t, self.kind], np.float32), 1.0, terminated, False, {}


def chain_envs(args, device):
    envs = gym.vector.SyncVectorEnv([  # Gymnasium's default: next-step autoreset
        lambda: gym.wrappers.TimeLimit(Chain(0), max_episode_steps=3),
        lambda: gym.wrappers.TimeLimit(Chain(1), max_episode_steps=100),
    ])
    return envs


@pytest.mark.parametrize("backend", BACKENDS)
def test_ppo_advantages_at_a_truncation(ppo, tmp_path, monkeypatch, backend):
    """Slot by slot (T = 8, gamma 0.9, lambda 0.8), with V the (unchanging: lr 0) critic:

    env 0 (truncated after 3 steps): obs 0 1 2 [3] 0 1 2 [3], the bracketed slots are the final
        observations; the steps out of them are reset transitions (reward 0, not in the loss).
    env 1 (terminated after 2 steps): obs 0 1 [2] 0 1 [2] 0 1.
    """
    captured = {}
    make = ppo.make_credit_assignment

    def capturing(args, device):
        fn = make(args, device)

        def credit(rewards, values, terminated, truncated, *, last_value):
            adv, ret = fn(rewards, values, terminated, truncated, last_value=last_value)
            captured.update(rewards=rewards.clone(), values=values.clone(), adv=adv.clone(),
                            terminated=terminated.clone(), truncated=truncated.clone())
            return adv, ret
        return credit

    monkeypatch.setattr(ppo, "make_envs", chain_envs)
    monkeypatch.setattr(ppo, "make_credit_assignment", capturing)
    g, lam = 0.9, 0.8
    args = tiny_ppo_args(ppo, tmp_path, backend, num_steps=8, total_timesteps=16,
                         learning_rate=0.0, gamma=g, gae_lambda=lam)
    agent, run_dir = ppo.train(args)

    def V(t, kind):
        with torch.no_grad():
            obs = torch.tensor([[t, kind]], dtype=torch.float32)
            return agent.get_value(obs.to(next(agent.parameters()).device)).item()

    c = {k: v.cpu() for k, v in captured.items()}
    assert c["truncated"][:, 0].tolist() == [0, 0, 1, 0, 0, 0, 1, 0]
    assert c["terminated"][:, 0].tolist() == [0] * 8
    assert c["terminated"][:, 1].tolist() == [0, 1, 0, 0, 1, 0, 0, 1]
    assert c["rewards"][:, 0].tolist() == [1, 1, 1, 0, 1, 1, 1, 0]
    # the slot after the truncation holds the final observation, not the reset one
    assert c["values"][3, 0].item() == pytest.approx(V(3, 0), abs=1e-6)
    assert V(3, 0) != pytest.approx(V(0, 0), abs=1e-4)

    adv = c["adv"]
    a2 = 1 + g * V(3, 0) - V(2, 0)  # truncation: bootstrap from the final observation, cut trace
    a1 = 1 + g * V(2, 0) - V(1, 0) + g * lam * a2
    a0 = 1 + g * V(1, 0) - V(0, 0) + g * lam * a1
    torch.testing.assert_close(adv[0:3, 0], torch.tensor([a0, a1, a2]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv[6, 0], torch.tensor(a2), rtol=1e-5, atol=1e-5)
    b1 = 1 - V(1, 1)  # termination: no bootstrap
    b0 = 1 + g * V(1, 1) - V(0, 1) + g * lam * b1
    torch.testing.assert_close(adv[0:2, 1], torch.tensor([b0, b1]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv[3:5, 1], torch.tensor([b0, b1]), rtol=1e-5, atol=1e-5)
    # env 1's last step (slot 7, obs 1 -> 2) terminates at the window end: no bootstrap either
    torch.testing.assert_close(adv[7, 1], torch.tensor(b1), rtol=1e-5, atol=1e-5)
    # four reset transitions (env 0: slots 3, 7; env 1: slots 2, 5) stay out of the loss
    assert scalars(run_dir)["perf/valid_fraction"][0] == pytest.approx(12 / 16)


@pytest.fixture(scope="module")
def impala():
    return load("impala")


@pytest.fixture(scope="module")
def retrace():
    return load("retrace")


def tiny_impala_args(impala, tmp_path, backend, **kw):
    args = dict(env_id="CartPole-v1", env_backend="gymnasium", credit_backend=backend,
                num_envs=4, num_steps=16, total_timesteps=128, num_minibatches=2, policy_lag=3,
                cuda=CUDA, log_dir=str(tmp_path), **COMPILE)
    args.update(kw)
    return impala.Args(**args)


def tiny_retrace_args(retrace, tmp_path, backend, **kw):
    args = dict(env_id="CartPole-v1", env_backend="gymnasium", credit_backend=backend,
                num_envs=4, num_steps=8, total_timesteps=128, learning_starts=64, batch_size=4,
                end_e=1.0,  # random acting: CartPole episodes of ~20 steps end inside the run
                buffer_size=16, target_network_frequency=2, cuda=CUDA, log_dir=str(tmp_path),
                **COMPILE)
    args.update(kw)
    return retrace.Args(**args)


def test_impala_envpool(impala, tmp_path):
    pytest.importorskip("envpool")
    _, run_dir = impala.train(tiny_impala_args(impala, tmp_path, "auto", env_backend="envpool",
                                               total_timesteps=64))
    assert PERF_TAGS <= set(scalars(run_dir))


@pytest.mark.parametrize("backend", BACKENDS)
def test_impala_logs(impala, tmp_path, backend):
    _, run_dir = impala.train(tiny_impala_args(impala, tmp_path, backend))
    assert pathlib.Path(run_dir).name.startswith(f"CartPole-v1__impala__{backend}__1__")
    logged = scalars(run_dir)
    assert PERF_TAGS | {"charts/episodic_return", "charts/SPS", "losses/value_loss",
                        "losses/policy_loss", "losses/importance_ratio"} <= set(logged)
    assert len(logged["perf/credit_ms"]) == 2
    assert all(np.isfinite(v).all() for v in logged.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_retrace_logs(retrace, tmp_path, backend):
    _, run_dir = retrace.train(tiny_retrace_args(retrace, tmp_path, backend))
    assert pathlib.Path(run_dir).name.startswith(f"CartPole-v1__retrace__{backend}__1__")
    logged = scalars(run_dir)
    assert PERF_TAGS | {"charts/episodic_return", "charts/SPS", "losses/td_loss"} <= set(logged)
    assert len(logged["perf/rollout_ms"]) == 4 and len(logged["perf/credit_ms"]) == 3
    assert all(np.isfinite(v).all() for v in logged.values())


@pytest.mark.parametrize("name", ["impala", "retrace"])
def test_off_policy_backends_train_identically(name, tmp_path):
    module = load(name)
    tiny = tiny_impala_args if name == "impala" else tiny_retrace_args
    params = {}
    for backend in BACKENDS:
        net, _ = module.train(tiny(module, tmp_path / backend, backend))
        params[backend] = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    for backend in BACKENDS[1:]:
        torch.testing.assert_close(params[backend], params["loop"], rtol=0, atol=1e-5)


def test_credit_loops_match_rl_triton(impala, retrace):
    """The inline loops (the `loop` backend) compute what the specification defines, as rl_triton does."""
    torch.manual_seed(0)
    T, N, A = 24, 5, 3
    r, v = torch.randn(T, N), torch.randn(T, N)
    term = (torch.rand(T, N) < 0.1).float()
    trunc = (torch.rand(T, N) < 0.1).float() * (1 - term)
    lv = torch.randn(N)
    tlp, blp = torch.randn(T, N) * 0.3, torch.randn(T, N) * 0.3
    kw = dict(gamma=0.97, lam=0.9, rho_clip=1.0, c_clip=0.9, pg_rho_clip=1.2)
    got = impala.vtrace_loop(r, v, term, tlp, blp, trunc, last_value=lv, **kw)
    want = rl_triton_module().vtrace(r, v, term, tlp, blp, trunc, last_value=lv, backend="loop", **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    q, a = torch.randn(T, N, A), torch.randint(0, A, (T, N))
    pi, mu = torch.softmax(torch.randn(T, N, A), -1), torch.rand(T, N) * 0.9 + 0.1
    lq, lpi = torch.randn(N, A), torch.softmax(torch.randn(N, A), -1)
    kw = dict(gamma=0.97, lam=0.9, c_clip=1.0)
    got = retrace.retrace_loop(r, q, a, pi, mu, term, trunc, last_q_values=lq, last_target_probs=lpi, **kw)
    want = rl_triton_module().retrace(r, q, a, pi, mu, term, trunc, last_q_values=lq,
                                      last_target_probs=lpi, backend="loop", **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def rl_triton_module():
    import rl_triton
    return rl_triton


# --env-backend gymnax (trainers/gymnax_envs.py; the `gymnax` extra, which .ci/run installs)
@pytest.fixture(scope="module")
def gymnax_envs():
    pytest.importorskip("gymnax")
    import gymnax_envs
    return gymnax_envs


def test_gymnax_next_step_autoreset(gymnax_envs):
    """CartPole cut at 3 steps, always pushing right: truncations at steps 2 and 6, reset
    transitions at 3 and 7. CartPole's observation is its state, so each step is checked against
    gymnax's own transition from the previous observation."""
    import jax
    from gymnax.environments.classic_control.cartpole import EnvState

    envs = gymnax_envs.GymnaxVectorEnv("CartPole-v1", 2, max_steps_in_episode=3)
    obs, _ = envs.reset(seed=0)

    def transition(o, time):
        o = jax.device_put(o.numpy(), envs.device)  # the envs' JAX device (a GPU's JAX defaults to it)
        state = EnvState(x=o[0], x_dot=o[1], theta=o[2], theta_dot=o[3], time=time)
        key = jax.device_put(jax.random.key(0), envs.device)
        next_obs, _, reward, _, _ = envs.env.step_env(key, state, 1, envs.params)
        return torch.from_dlpack(next_obs), float(reward)

    for step in range(8):
        prev = obs
        obs, reward, terminated, truncated, info = envs.step(torch.ones(2, dtype=torch.long))
        assert obs.shape == (2, 4) and obs.dtype == torch.float32 and info == {}
        assert not terminated.any()
        for i in range(2):
            if step in (3, 7):  # the reset transition: first observation, reward 0, no flags
                assert reward[i] == 0 and not truncated[i]
                assert obs[i].abs().max() <= 0.05  # CartPole's reset draws U(-0.05, 0.05)
                assert not torch.allclose(obs[i], transition(prev[i], step % 4)[0])
            else:  # a real step; at the truncation (steps 2, 6) its true final observation
                want_obs, want_reward = transition(prev[i], step % 4)
                torch.testing.assert_close(obs[i], want_obs)
                assert reward[i] == want_reward == 1.0
                assert bool(truncated[i]) == (step in (2, 6))


@pytest.mark.parametrize("max_steps, term_steps, trunc_steps", [
    (1000, [8, 18], []),  # the ball reaches the bottom row after 9 steps: a termination
    (9, [8, 18], [8, 18]),  # ... at the time limit as well: both flags, as Gymnasium's TimeLimit
    (5, [], [4, 10, 16]),  # cut before the ball lands: a truncation only
])
def test_gymnax_terminations_apart_from_truncations(gymnax_envs, max_steps, term_steps, trunc_steps):
    envs = gymnax_envs.GymnaxVectorEnv("Catch-bsuite", 3, max_steps_in_episode=max_steps)
    envs.reset(seed=1)
    flags = [envs.step(torch.ones(3, dtype=torch.long))[1:4] for _ in range(20)]
    for env in range(3):
        assert [t for t, (_, term, _) in enumerate(flags) if term[env]] == term_steps
        assert [t for t, (_, _, trunc) in enumerate(flags) if trunc[env]] == trunc_steps
        for t in term_steps:
            assert flags[t][0][env].abs() == 1  # caught or missed
            assert flags[t + 1][0][env] == 0  # the reset transition
        for t in trunc_steps:
            assert flags[t + 1][0][env] == 0


def test_gymnax_dlpack_zero_copy(gymnax_envs):
    """On JAX's CPU backend the hand-off shares buffers both ways: the tensors step() returns are
    JAX's output buffers, and an int32 action tensor is JAX's input. (int64 actions are cast to
    int32 in torch first: JAX without x64 would copy them; JAX also copies a tensor whose data is
    not 64-byte aligned, which a fresh torch tensor is.)"""
    envs = gymnax_envs.GymnaxVectorEnv("CartPole-v1", 4)
    envs.reset(seed=0)
    seen = {}
    step = envs._step

    def capturing(carry, actions):
        carry, out = step(carry, actions)
        seen.update(actions=actions, out=out)
        return carry, out

    envs._step = capturing
    actions = torch.ones(4, dtype=torch.int32)
    tensors = envs.step(actions)[:4]
    assert seen["actions"].unsafe_buffer_pointer() == actions.data_ptr()
    for tensor, array in zip(tensors, seen["out"]):
        assert tensor.data_ptr() == array.unsafe_buffer_pointer()


def test_ppo_gymnax_boundaries(ppo, tmp_path, monkeypatch, gymnax_envs):
    """PPO through the adapter on CartPole cut at 3 steps (learning rate 0): the flags, rewards
    and valid mask the trainer stores, and the bootstrap slot after a truncation holds the value
    of the final observation (as test_ppo_advantages_at_a_truncation does for Gymnasium)."""
    captured, stepped = {}, []
    make = ppo.make_credit_assignment

    def capturing(args, device):
        fn = make(args, device)

        def credit(rewards, values, terminated, truncated, *, last_value):
            captured.update(rewards=rewards.clone(), values=values.clone(),
                            terminated=terminated.clone(), truncated=truncated.clone())
            return fn(rewards, values, terminated, truncated, last_value=last_value)
        return credit

    def cut_cartpole(args, device):
        envs = gymnax_envs.GymnaxVectorEnv("CartPole-v1", args.num_envs, device, max_steps_in_episode=3)
        step = envs.step

        def recording(actions):
            out = step(actions)
            stepped.append(out[0].clone())
            return out
        envs.step = recording
        return envs

    monkeypatch.setattr(ppo, "make_envs", cut_cartpole)
    monkeypatch.setattr(ppo, "make_credit_assignment", capturing)
    args = tiny_ppo_args(ppo, tmp_path, "auto", env_backend="gymnax", num_steps=8,
                         total_timesteps=16, learning_rate=0.0)
    agent, run_dir = ppo.train(args)
    c = captured
    for env in range(2):
        assert c["truncated"][:, env].tolist() == [0, 0, 1, 0, 0, 0, 1, 0]
        assert c["terminated"][:, env].tolist() == [0] * 8
        assert c["rewards"][:, env].tolist() == [1, 1, 1, 0, 1, 1, 1, 0]
    with torch.no_grad():
        final_values = agent.get_value(stepped[2]).flatten()
    torch.testing.assert_close(c["values"][3], final_values)
    assert scalars(run_dir)["perf/valid_fraction"][0] == pytest.approx(12 / 16)


def test_ppo_gymnax(ppo, tmp_path, gymnax_envs):
    _, run_dir = ppo.train(tiny_ppo_args(ppo, tmp_path, "auto", env_backend="gymnax"))
    assert pathlib.Path(run_dir).name.startswith("CartPole-v1__ppo__auto__1__")
    logged = scalars(run_dir)
    assert PERF_TAGS | {"charts/episodic_return", "losses/value_loss"} <= set(logged)
    assert all(np.isfinite(v).all() for v in logged.values())


def test_impala_gymnax(impala, tmp_path, gymnax_envs):
    _, run_dir = impala.train(tiny_impala_args(impala, tmp_path, "auto", env_backend="gymnax"))
    logged = scalars(run_dir)
    assert PERF_TAGS | {"charts/episodic_return", "losses/value_loss"} <= set(logged)
    assert all(np.isfinite(v).all() for v in logged.values())


# --loss-backend: rl_triton's fused losses (Triton's interpreter here) against the inline torch lines
@pytest.mark.parametrize("name, kw", [
    # one iteration, four updates; a small clip and a large step so that both clips bind
    ("ppo", dict(total_timesteps=64, update_epochs=2, clip_coef=0.02, learning_rate=3e-3)),
    ("ppo", dict(total_timesteps=64, update_epochs=2, env_id="Pendulum-v1", clip_vloss=False)),
    ("impala", dict()),  # two iterations of two updates
], ids=["ppo", "ppo-continuous-unclipped-vloss", "impala"])
def test_loss_backends_train_identically(name, kw, tmp_path):
    module = load(name)
    tiny = tiny_ppo_args if name == "ppo" else tiny_impala_args
    params, logged = {}, {}
    for loss_backend in ["torch", "triton"]:
        agent, run_dir = module.train(tiny(module, tmp_path / loss_backend, "auto", loss_backend=loss_backend, **kw))
        params[loss_backend] = torch.nn.utils.parameters_to_vector(agent.parameters()).detach()
        logged[loss_backend] = scalars(run_dir)
        assert all(ms > 0 for ms in logged[loss_backend]["perf/loss_ms"])
        assert len(logged[loss_backend]["perf/loss_ms"]) == len(logged[loss_backend]["perf/credit_ms"])
    torch.testing.assert_close(params["triton"], params["torch"], rtol=0, atol=1e-5)
    for tag in ["losses/policy_loss", "losses/value_loss", "losses/approx_kl"]:
        np.testing.assert_allclose(logged["triton"][tag], logged["torch"][tag], rtol=1e-5, atol=1e-6)


SAC_BACKENDS = ["loop", "triton", "auto"]
SAC_TAGS = PERF_TAGS | {"charts/episodic_return", "charts/episodic_length", "charts/SPS", "losses/qf1_values",
                        "losses/qf2_values", "losses/qf1_loss", "losses/qf2_loss", "losses/qf_loss",
                        "losses/actor_loss", "losses/alpha", "losses/alpha_loss"}


@pytest.fixture(scope="module")
def sac():
    return load("sac")


def tiny_sac_args(sac, tmp_path, backend, **kw):
    args = dict(credit_backend=backend, num_envs=2, total_timesteps=64, learning_starts=32, batch_size=16,
                buffer_size=48, log_frequency=4, cuda=CUDA, log_dir=str(tmp_path))
    args.update(kw)
    return sac.Args(**args)


def short_pendulums(args):
    """Pendulum-v1 cut at 8 steps, so that a tiny run ends episodes (by truncation)."""
    return gym.make_vec(args.env_id, num_envs=args.num_envs, max_episode_steps=8)


@pytest.mark.parametrize("backend", SAC_BACKENDS)
def test_sac_logs(sac, tmp_path, monkeypatch, backend):
    monkeypatch.setattr(sac, "make_envs", short_pendulums)
    _, run_dir = sac.train(tiny_sac_args(sac, tmp_path, backend))
    assert pathlib.Path(run_dir).name.startswith(f"Pendulum-v1__sac__{backend}__1__")
    logged = scalars(run_dir)
    assert SAC_TAGS | {"perf/iteration_ms"} <= set(logged)
    # 16 updates (iterations 16-31), written at iterations 16, 20, 24, 28
    assert len(logged["perf/credit_ms"]) == 4 and len(logged["losses/qf_loss"]) == 4
    assert all(0 < s < 1 for s in logged["perf/credit_share"])
    assert all(np.isfinite(v).all() for v in logged.values())


def test_sac_backends_train_identically(sac, tmp_path, monkeypatch):
    monkeypatch.setattr(sac, "make_envs", short_pendulums)
    params, alphas = {}, {}
    for backend in SAC_BACKENDS:
        nets, run_dir = sac.train(tiny_sac_args(sac, tmp_path / backend, backend))
        params[backend] = torch.nn.utils.parameters_to_vector(nets.parameters()).detach()
        alphas[backend] = scalars(run_dir)["losses/alpha"]
    for backend in SAC_BACKENDS[1:]:
        torch.testing.assert_close(params[backend], params["loop"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(alphas[backend], alphas["loop"], rtol=0, atol=1e-6)
    assert alphas["loop"][-1] != 1.0  # the temperature did learn


def test_sac_targets_match_cleanrl(device):
    """rl_triton.sac_targets (every backend) and sac.py's loop against CleanRL's lines (its replay
    samples are [B, 1]; its `dones` are SB3's, the terminations), with terminations among them."""
    sac = load("sac")
    rl_triton = rl_triton_module()
    g = torch.Generator().manual_seed(0)
    B, gamma = 37, 0.97
    rewards = torch.randn(B, 1, generator=g)
    dones = (torch.rand(B, 1, generator=g) < 0.3).float()
    qf1_next_target, qf2_next_target = torch.randn(B, 1, generator=g), torch.randn(B, 1, generator=g)
    next_state_log_pi = torch.randn(B, 1, generator=g)
    assert 0 < dones.sum() < B
    for alpha in [0.2, torch.rand(1, generator=g)]:  # a fixed and a learned temperature
        # CleanRL sac_continuous_action.py, transcribed
        min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
        next_q_value = rewards.flatten() + (1 - dones.flatten()) * gamma * (min_qf_next_target).view(-1)

        next_q_values = torch.cat([qf1_next_target, qf2_next_target], 1)
        for backend in ["triton", "torch", "loop"]:
            dev = device if backend == "triton" else "cpu"  # the kernels on the GPU where there is one
            args = (rewards.view(-1), dones.view(-1).bool(), next_q_values, next_state_log_pi.view(-1))
            got = rl_triton.sac_targets(*(t.to(dev) for t in args), gamma=gamma, backend=backend,
                                        alpha=alpha.to(dev) if isinstance(alpha, torch.Tensor) else alpha)
            torch.testing.assert_close(got.cpu(), next_q_value, rtol=1e-6, atol=1e-6)
        got = sac.sac_targets_loop(rewards.view(-1), dones.view(-1), next_q_values, next_state_log_pi.view(-1),
                                   gamma=gamma, alpha=alpha)
        torch.testing.assert_close(got, next_q_value, rtol=0, atol=0)
        # a termination drops the bootstrap: the target is the reward
        torch.testing.assert_close(next_q_value[dones.view(-1) == 1], rewards.view(-1)[dones.view(-1) == 1])


# ContinuousChain: Chain with a Box action, for SAC's replay
class ContinuousChain(Chain):
    action_space = gym.spaces.Box(-1, 1, (1,), np.float32)


def test_sac_replay_at_episode_boundaries(sac, tmp_path, monkeypatch):
    """What enters the replay over 8 steps of two chains (next-step autoreset):

    env 0 (truncated after 3 steps): obs 0 1 2 [3] 0 1 2 [3]; env 1 (terminated after 2 steps):
    obs 0 1 [2] 0 1 [2] 0 1. The steps out of the bracketed final observations (env 0: 3, 7;
    env 1: 2, 5) are reset transitions and are not stored; a truncation is stored with its final
    observation and no termination flag."""
    buffers = []

    class CapturedReplayBuffer(sac.ReplayBuffer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            buffers.append(self)

    monkeypatch.setattr(sac, "make_envs", lambda args: gym.vector.SyncVectorEnv([
        lambda: gym.wrappers.TimeLimit(ContinuousChain(0), max_episode_steps=3),
        lambda: gym.wrappers.TimeLimit(ContinuousChain(1), max_episode_steps=100),
    ]))
    monkeypatch.setattr(sac, "ReplayBuffer", CapturedReplayBuffer)
    sac.train(tiny_sac_args(sac, tmp_path, "loop", total_timesteps=16, learning_starts=100, buffer_size=100))
    (rb,) = buffers
    n = rb.pos
    assert n == 12 and not rb.full  # 16 steps less the four reset transitions
    obs, next_obs, term = rb.obs[:n], rb.next_obs[:n], rb.terminated[:n]
    assert (next_obs[:, 0] == obs[:, 0] + 1).all() and (next_obs[:, 1] == obs[:, 1]).all()  # no reset step
    assert (rb.rewards[:n] == 1).all()
    kind, t_next = obs[:, 1], next_obs[:, 0]
    assert term.tolist() == ((kind == 1) & (t_next == 2)).float().tolist()
    assert ((kind == 0) & (t_next == 3)).sum() == 2  # the truncations, bootstrapping from obs 3
    assert ((kind == 1) & (t_next == 2)).sum() == 3


@pytest.fixture(scope="module")
def llm():
    return load("llm_ppo")


def tiny_llm_args(llm, tmp_path, backend, **kw):
    # 3 turns of a guess and a 2-token reply, padded to 12 tokens: masked spans inside every row
    args = dict(credit_backend=backend, num_numbers=8, max_turns=3, obs_len=2, response_len=12,
                d_model=16, n_layers=1, n_heads=2, num_episodes=8, group_size=4, total_episodes=16,
                update_epochs=2, num_minibatches=2, gamma=0.9, cuda=CUDA, log_dir=str(tmp_path),
                **COMPILE)
    args.update(kw)
    return llm.Args(**args)


LLM_TAGS = PERF_TAGS | {"charts/success_rate", "charts/episodic_return", "charts/mean_turns",
                        "losses/policy_loss", "losses/entropy", "losses/approx_kl"}


@pytest.mark.parametrize("variant", [dict(estimator="ppo"), dict(estimator="ppo", packed=True),
                                     dict(estimator="grpo")], ids=["ppo", "ppo-packed", "grpo"])
def test_llm_ppo_backends_train_identically(llm, tmp_path, variant):
    """Every credit backend logs the tags and, for two updates, trains the same model."""
    params = {}
    for backend in BACKENDS:
        model, run_dir = llm.train(tiny_llm_args(llm, tmp_path / backend, backend, **variant))
        assert pathlib.Path(run_dir).name.startswith(f"GuessNumber-K8-M3__llm_ppo__{backend}__1__")
        logged = scalars(run_dir)
        expected = LLM_TAGS | ({"losses/value_loss"} if variant["estimator"] == "ppo" else set())
        assert expected <= set(logged)
        assert len(logged["perf/credit_ms"]) == 2  # one per iteration
        assert all(0 < s < 1 for s in logged["perf/credit_share"])
        assert all(np.isfinite(v).all() for v in logged.values())
        params[backend] = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    for backend in BACKENDS[1:]:
        torch.testing.assert_close(params[backend], params["loop"], rtol=0, atol=1e-5)
    torch.manual_seed(1)  # the trainer's seed: its initial model
    initial = llm.Policy(tiny_llm_args(llm, tmp_path, "loop"))
    assert not torch.allclose(params["loop"].cpu(),
                              torch.nn.utils.parameters_to_vector(initial.parameters()))


@pytest.mark.parametrize("estimator", ["ppo", "grpo"])
def test_llm_ppo_fused_head_trains_identically(llm, tmp_path, estimator):
    """--fused-head (rl_triton.linear_policy_loss from the hidden states) and the logits path
    train the same model over two iterations of updates."""
    params = {}
    for fused in (False, True):
        model, _ = llm.train(tiny_llm_args(llm, tmp_path / str(fused), "auto", estimator=estimator,
                                           fused_head=fused))
        params[fused] = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    torch.testing.assert_close(params[True], params[False], rtol=0, atol=1e-5)


def test_llm_ppo_kl_penalty(llm, tmp_path):
    _, run_dir = llm.train(tiny_llm_args(llm, tmp_path, "auto", kl_coef=0.1))
    assert "losses/ref_kl" in scalars(run_dir)


def test_llm_ppo_masks_and_loop_gae(llm, device):
    """The game's rows: decision tokens are the model's guesses, each followed by the environment's
    reply (mask 0), then right padding; the loop GAE is rl_triton.gae(mask=...) on them."""
    import rl_triton

    args = llm.Args(num_numbers=8, max_turns=4, obs_len=3, response_len=20, d_model=16, n_layers=1,
                    n_heads=2)
    torch.manual_seed(0)
    hidden = torch.randint(8, (64,))
    seq, mask, turns, solved = llm.play(llm.Policy(args), hidden, args)
    responses = seq[:, 1:]
    assert seq.shape == (64, 21) and (seq[:, 0] == llm.BOS).all()
    assert torch.equal(mask, responses >= llm.NUM_SPECIAL)  # the model's tokens, nothing else
    for b in range(64):
        starts = torch.arange(turns[b].item()) * 4  # a guess and its 3-token reply per turn
        assert torch.equal(mask[b].nonzero().flatten(), starts)
        for t in starts.tolist():
            guess = responses[b, t].item() - llm.NUM_SPECIAL
            want = llm.CORRECT if guess == hidden[b] else llm.HIGHER if guess < hidden[b] else llm.LOWER
            assert responses[b, t + 1] == want and (responses[b, t + 2: t + 4] == llm.FILL).all()
        assert (responses[b, 4 * turns[b]:] == llm.PAD).all()
        assert solved[b] == (responses[b, 4 * turns[b] - 3] == llm.CORRECT)
    assert (turns >= 2).sum() > 32  # most rows hold an observation span between decisions
    assert (solved & (turns < 4)).any() and (~solved).any()

    values = torch.randn(64, 20)
    scores = solved.float()
    rewards = torch.zeros(64, 20).scatter_(1, (4 * (turns - 1))[:, None], scores[:, None])
    adv, ret = llm.gae_loop(rewards, values, mask, gamma=0.9, lam=0.8)
    for backend in ["torch", "triton"]:
        dev = device if backend == "triton" else "cpu"  # the kernels on the GPU where there is one
        want_adv, want_ret = rl_triton.gae(rewards.to(dev), values.to(dev),
                                           torch.zeros_like(mask, device=dev), mask=mask.to(dev),
                                           last_value=torch.zeros(64, device=dev), gamma=0.9,
                                           lam=0.8, time_dim=1, backend=backend)
        torch.testing.assert_close(adv, want_adv.cpu(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret, want_ret.cpu(), rtol=1e-5, atol=1e-5)
    hidden_groups = torch.randint(8, (16,)).repeat_interleave(4)
    _, mask, _, solved = llm.play(llm.Policy(args), hidden_groups, args)
    torch.testing.assert_close(llm.grpo_loop(solved.float(), mask, group_size=4),
                               rl_triton.group_advantages(solved.float(), group_size=4, mask=mask))


# Data parallel (torchrun): two gloo processes on CPU, each a rank as torchrun starts it
class GreedyCategorical(torch.distributions.Categorical):
    """Acting by the mode: a rollout no longer depends on how the RNG's draws fall per rank."""

    def sample(self, sample_shape=torch.Size()):
        return self.logits.argmax(-1)


def sync_envs(args, device):
    """Gymnasium's sync vector env seeds env i with seed + i (CartPole's numpy-vectorized one
    draws every env's state from one generator), so 2 ranks of N are one run of 2N."""
    return gym.make_vec(args.env_id, num_envs=args.num_envs, vectorization_mode="sync")


def distributed_rank(rank, world_size, port, name, kw, out_dir, greedy):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    trainer = load(name)
    if greedy:
        trainer.make_envs, trainer.Categorical = sync_envs, GreedyCategorical
    tiny = tiny_ppo_args if name == "ppo" else tiny_impala_args
    agent, _ = trainer.train(tiny(trainer, out_dir, "loop", **kw))
    torch.save(torch.nn.utils.parameters_to_vector(agent.parameters()).detach(), f"{out_dir}/rank{rank}.pt")
    leave_rank()


def train_distributed(name, tmp_path, kw, greedy=False, world_size=2):
    def args():  # a free port, an empty folder
        shutil.rmtree(tmp_path, ignore_errors=True)
        tmp_path.mkdir(parents=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return world_size, port, name, kw, str(tmp_path), greedy

    spawn_ranks(distributed_rank, args, world_size)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def dying_rank(rank, marker, how):
    """Rank 1 dies of SIGABRT on the first spawn (no marker file yet), or raises on every one."""
    if rank == 1 and how == "raise":
        raise RuntimeError("a rank's own error")
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()


def test_spawn_ranks_spawns_once_more_after_a_signal_only(tmp_path):
    marker = tmp_path / "died"
    calls = []
    with pytest.warns(UserWarning, match="SIGABRT"):
        spawn_ranks(dying_rank, lambda: calls.append(1) or (str(marker), "abort"))
    assert len(calls) == 2 and marker.exists()
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="own error"):
        spawn_ranks(dying_rank, lambda: (str(marker), "raise"))


@pytest.mark.parametrize("name", ["ppo", "impala"])
def test_distributed_ranks_agree(name, tmp_path, capfd):
    """Two ranks acting on their own (different) data take the same steps: atol 0."""
    kw = dict(num_minibatches=2, update_epochs=2) if name == "ppo" else dict()
    params = train_distributed(name, tmp_path, dict(kw, cuda=False))  # gloo ranks on the CPU
    assert torch.equal(params[0], params[1])
    assert "parameters across 2 ranks: max abs difference 0" in capfd.readouterr().out
    run_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(run_dirs) == 1  # only rank 0 writes TensorBoard


@pytest.mark.parametrize("name", ["ppo", "impala"])
def test_distributed_equals_one_process_on_the_union(name, tmp_path, monkeypatch):
    """2 ranks of N environments against 1 process of 2N seeded the same way, acting greedily
    (the sampled actions cannot line up: one draw of 2N is not two draws of N). One minibatch
    per update, so that the update's batch is the union of the ranks' batches: the global
    advantage normalization and the weighting of each rank's mean loss by its share of the
    valid steps make the averaged step the single-process step, up to float summation order."""
    # two iterations, long enough for greedy CartPole episodes to end; with seed 3 PPO's ranks
    # hold different numbers of valid steps (unweighted rank means miss by 3e-4; IMPALA's seed
    # gives them too little imbalance to tell, its check is the wiring)
    kw = dict(num_minibatches=1, update_epochs=2, num_steps=64) if name == "ppo" else dict(num_minibatches=1)
    kw.update(total_timesteps=512, seed=3, cuda=False)  # gloo ranks on the CPU, and the one process
    params = train_distributed(name, tmp_path / "ranks", kw, greedy=True)
    trainer = load(name)
    monkeypatch.setattr(trainer, "make_envs", sync_envs)
    monkeypatch.setattr(trainer, "Categorical", GreedyCategorical)
    tiny = tiny_ppo_args if name == "ppo" else tiny_impala_args
    n = tiny(trainer, tmp_path, "loop").num_envs
    agent, run_dir = trainer.train(tiny(trainer, tmp_path / "one", "loop", num_envs=2 * n, **kw))
    one = torch.nn.utils.parameters_to_vector(agent.parameters()).detach()
    assert torch.equal(params[0], params[1])
    torch.testing.assert_close(params[0], one, rtol=0, atol=1e-5)
    assert not torch.allclose(one, train_distributed(name, tmp_path / "start", dict(kw, learning_rate=0.0),
                                                     greedy=True)[0], atol=1e-4)  # it did learn
    # episodes ended inside the rollouts: reset transitions left the loss
    assert min(scalars(run_dir)["perf/valid_fraction"]) < 1
