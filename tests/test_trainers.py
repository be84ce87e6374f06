"""The trainers in trainers/ run one or two tiny iterations on CPU with every credit backend (Triton
through its interpreter), write the TensorBoard tags they promise, feed their loss the advantages
the specification defines at a truncation, and train identically whatever the backend."""


import importlib.util
import pathlib

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = ["loop", "compile", "triton", "auto"]
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
                cuda=False, log_dir=str(tmp_path), **COMPILE)
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


def chain_envs(args):
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
            return agent.get_value(torch.tensor([[t, kind]], dtype=torch.float32)).item()

    c = captured
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
                cuda=False, log_dir=str(tmp_path), **COMPILE)
    args.update(kw)
    return impala.Args(**args)


def tiny_retrace_args(retrace, tmp_path, backend, **kw):
    args = dict(env_id="CartPole-v1", env_backend="gymnasium", credit_backend=backend,
                num_envs=4, num_steps=8, total_timesteps=128, learning_starts=64, batch_size=4,
                end_e=1.0,  # random acting: CartPole episodes of ~20 steps end inside the run
                buffer_size=16, target_network_frequency=2, cuda=False, log_dir=str(tmp_path),
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


@pytest.fixture(scope="module")
def llm():
    return load("llm_ppo")


def tiny_llm_args(llm, tmp_path, backend, **kw):
    # 3 turns of a guess and a 2-token reply, padded to 12 tokens: masked spans inside every row
    args = dict(credit_backend=backend, num_numbers=8, max_turns=3, obs_len=2, response_len=12,
                d_model=16, n_layers=1, n_heads=2, num_episodes=8, group_size=4, total_episodes=16,
                update_epochs=2, num_minibatches=2, gamma=0.9, cuda=False, log_dir=str(tmp_path),
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
    assert not torch.allclose(params["loop"], torch.nn.utils.parameters_to_vector(initial.parameters()))


def test_llm_ppo_kl_penalty(llm, tmp_path):
    _, run_dir = llm.train(tiny_llm_args(llm, tmp_path, "auto", kl_coef=0.1))
    assert "losses/ref_kl" in scalars(run_dir)


def test_llm_ppo_masks_and_loop_gae(llm):
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
        want_adv, want_ret = rl_triton.gae(rewards, values, torch.zeros_like(mask), mask=mask,
                                           last_value=torch.zeros(64), gamma=0.9, lam=0.8,
                                           time_dim=1, backend=backend)
        torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret, want_ret, rtol=1e-5, atol=1e-5)
    hidden_groups = torch.randint(8, (16,)).repeat_interleave(4)
    _, mask, _, solved = llm.play(llm.Policy(args), hidden_groups, args)
    torch.testing.assert_close(llm.grpo_loop(solved.float(), mask, group_size=4),
                               rl_triton.group_advantages(solved.float(), group_size=4, mask=mask))
