# Soft Actor-Critic for continuous actions in CleanRL's single-file style (sac_continuous_action.py),
# with the soft Q-learning targets by rl_triton.sac_targets. Differences from CleanRL's script: the
# replay buffer is a small torch ring in this file (no SB3), Gymnasium's next-step autoreset is
# handled by not storing the step out of a final observation (its action is ignored), only
# terminations drop the bootstrap (a time limit keeps it), the learned temperature stays a tensor
# (no host sync per update), and the run logs where its time goes (perf/*) like the other trainers.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on CPU runs only in its interpreter

import functools
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from torch.utils.tensorboard import SummaryWriter

import rl_triton


@dataclass
class Args:
    exp_name: str = "sac"
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be enabled by default (when available)"""
    log_dir: str = "runs"
    """where the TensorBoard runs go"""
    save_model: bool = False
    """whether to save the actor's and critics' parameters into the run's folder"""

    # Algorithm specific arguments
    env_id: str = "Pendulum-v1"
    """the id of the environment (continuous actions)"""
    credit_backend: Literal["loop", "triton", "auto"] = "auto"
    """soft Q target implementation: CleanRL's inline lines, rl_triton's Triton kernel, or
    rl_triton's choice (Triton on CUDA, torch on CPU)"""
    total_timesteps: int = 30000
    """total timesteps of the experiments"""
    num_envs: int = 1
    """the number of parallel game environments"""
    buffer_size: int = int(1e6)
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    learning_starts: int = 5000
    """timestep to start learning"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    target_network_frequency: int = 1  # Denis Yarats' implementation delays this by 2.
    """the frequency of updates for the target networks"""
    alpha: float = 0.2
    """Entropy regularization coefficient."""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    log_frequency: int = 100
    """losses and perf/* (means over the iterations since the last write) every this many iterations"""

    # to be filled in runtime
    num_iterations: int = 0
    """the number of iterations: vector steps, one update each once learning starts (computed in runtime)"""


def make_envs(args):
    """A vector environment with next-step autoreset (Gymnasium's default): after a step that ends
    an episode, the next step ignores its action and returns the first observation of the next
    episode, with reward 0 and no flags."""
    return gym.make_vec(args.env_id, num_envs=args.num_envs)


# ALGO LOGIC: initialize agent here:
class SoftQNetwork(nn.Module):
    def __init__(self, envs):
        super().__init__()
        self.fc1 = nn.Linear(
            np.array(envs.single_observation_space.shape).prod() + np.prod(envs.single_action_space.shape),
            256,
        )
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 1)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


LOG_STD_MAX = 2
LOG_STD_MIN = -5


class Actor(nn.Module):
    """A tanh-squashed Gaussian policy, rescaled to the action bounds."""

    def __init__(self, envs):
        super().__init__()
        self.fc1 = nn.Linear(np.array(envs.single_observation_space.shape).prod(), 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc_mean = nn.Linear(256, np.prod(envs.single_action_space.shape))
        self.fc_logstd = nn.Linear(256, np.prod(envs.single_action_space.shape))
        # action rescaling
        self.register_buffer(
            "action_scale",
            torch.tensor((envs.single_action_space.high - envs.single_action_space.low) / 2.0, dtype=torch.float32),
        )
        self.register_buffer(
            "action_bias",
            torch.tensor((envs.single_action_space.high + envs.single_action_space.low) / 2.0, dtype=torch.float32),
        )

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = self.fc_logstd(x)
        log_std = torch.tanh(log_std)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)  # From SpinUp / Denis Yarats

        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()  # for reparameterization trick (mean + std * N(0,1))
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing Action Bound
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


class ReplayBuffer:
    """A ring of transitions (s, a, r, s', terminated) in torch tensors on the trainer's device."""

    def __init__(self, size, obs_shape, action_shape, device):
        self.obs = torch.zeros((size,) + obs_shape, device=device)
        self.next_obs = torch.zeros((size,) + obs_shape, device=device)
        self.actions = torch.zeros((size,) + action_shape, device=device)
        self.rewards = torch.zeros(size, device=device)
        self.terminated = torch.zeros(size, device=device)
        self.size, self.pos, self.full, self.device = size, 0, False, device

    def add(self, obs, next_obs, actions, rewards, terminated):
        slots = torch.arange(self.pos, self.pos + len(rewards), device=self.device) % self.size
        for buffer, x in ((self.obs, obs), (self.next_obs, next_obs), (self.actions, actions),
                          (self.rewards, rewards), (self.terminated, terminated)):
            buffer[slots] = torch.as_tensor(x, dtype=torch.float32, device=self.device)
        self.full = self.full or self.pos + len(rewards) >= self.size
        self.pos = (self.pos + len(rewards)) % self.size

    def sample(self, batch_size):
        idx = torch.randint(0, self.size if self.full else self.pos, (batch_size,), device=self.device)
        return self.obs[idx], self.actions[idx], self.rewards[idx], self.next_obs[idx], self.terminated[idx]


def sac_targets_loop(rewards, terminated, next_q_values, next_state_log_pi, *, gamma, alpha):
    """CleanRL's target lines; its `dones` are the terminations (a time limit keeps the bootstrap)."""
    qf1_next_target, qf2_next_target = next_q_values.unbind(-1)
    min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
    return rewards + (1 - terminated) * gamma * min_qf_next_target


def make_credit_assignment(args):
    """The one thing `--credit-backend` changes: which soft Q targets run."""
    if args.credit_backend == "loop":
        return functools.partial(sac_targets_loop, gamma=args.gamma)
    return functools.partial(rl_triton.sac_targets, gamma=args.gamma, backend=args.credit_backend)


class Timer:
    """Milliseconds of GPU work between start() and stop() (CUDA events), or of wall time on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def start(self):
        if self.cuda:
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self):
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self):
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end)
        return (self.t1 - self.t0) * 1e3


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args: Args):
    args.num_iterations = max(1, args.total_timesteps // args.num_envs)
    run_name = f"{args.env_id}__{args.exp_name}__{args.credit_backend}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"{args.log_dir}/{run_name}")
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n%s" % ("\n".join([f"|{key}|{value}|" for key, value in vars(args).items()])),
    )

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    # env setup
    envs = make_envs(args)
    assert isinstance(envs.single_action_space, gym.spaces.Box), "only continuous action space is supported"
    envs.single_action_space.seed(args.seed)

    actor = Actor(envs).to(device)
    qf1 = SoftQNetwork(envs).to(device)
    qf2 = SoftQNetwork(envs).to(device)
    qf1_target = SoftQNetwork(envs).to(device)
    qf2_target = SoftQNetwork(envs).to(device)
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)
    actor_optimizer = optim.Adam(list(actor.parameters()), lr=args.policy_lr)
    credit_assignment = make_credit_assignment(args)
    credit_timer = Timer(device)

    # Automatic entropy tuning
    if args.autotune:
        target_entropy = -torch.prod(torch.Tensor(envs.single_action_space.shape).to(device)).item()
        log_alpha = torch.zeros(1, requires_grad=True, device=device)
        alpha = log_alpha.exp().detach()
        a_optimizer = optim.Adam([log_alpha], lr=args.q_lr)
    else:
        alpha = args.alpha

    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space.shape, envs.single_action_space.shape, device)

    # TRY NOT TO MODIFY: start the game
    global_step = 0
    start_time = time.time()
    obs, _ = envs.reset(seed=args.seed)
    prev_done = np.zeros(args.num_envs, dtype=bool)
    episode_return = np.zeros(args.num_envs)
    episode_length = np.zeros(args.num_envs, dtype=np.int64)
    recent_returns = deque(maxlen=100)
    perf_sums, perf_count = np.zeros(3), 0  # rollout, credit and update ms since the last write

    for iteration in range(args.num_iterations):
        # ALGO LOGIC: put action logic here
        rollout_start = time.perf_counter()
        if global_step < args.learning_starts:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            with torch.no_grad():
                actions, _, _ = actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device))
            actions = actions.cpu().numpy()
        global_step += args.num_envs

        # TRY NOT TO MODIFY: execute the game and log data.
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        # the step out of a final observation is next-step autoreset's reset transition: its action
        # was ignored, so it is no transition and stays out of the replay. The step into a final
        # observation is stored with next_obs that final observation (the right bootstrap at a
        # truncation) and only a termination's flag
        keep = ~prev_done
        rb.add(obs[keep], next_obs[keep], actions[keep], rewards[keep], terminations[keep])
        done = terminations | truncations
        episode_return += rewards
        episode_length += keep
        for i in np.flatnonzero(done):
            recent_returns.append(episode_return[i])
            writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
            writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
            writer.add_scalar("charts/avg_return_100", np.mean(recent_returns), global_step)
        episode_return[done], episode_length[done] = 0.0, 0
        prev_done = done

        # TRY NOT TO MODIFY: CRUCIAL step easy to overlook
        obs = next_obs
        synchronize(device)
        rollout_ms = (time.perf_counter() - rollout_start) * 1e3

        # ALGO LOGIC: training.
        if global_step <= args.learning_starts:
            continue
        update_start = time.perf_counter()
        b_obs, b_actions, b_rewards, b_next_obs, b_terminated = rb.sample(args.batch_size)
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = actor.get_action(b_next_obs)
            # the K = 2 target critics at a' ~ pi(.|s'), side by side as sac_targets takes them
            next_q_values = torch.cat([qf1_target(b_next_obs, next_state_actions),
                                       qf2_target(b_next_obs, next_state_actions)], 1)
            credit_timer.start()
            next_q_value = credit_assignment(b_rewards, b_terminated, next_q_values, next_state_log_pi.view(-1),
                                             alpha=alpha)
            credit_timer.stop()

        qf1_a_values = qf1(b_obs, b_actions).view(-1)
        qf2_a_values = qf2(b_obs, b_actions).view(-1)
        qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
        qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
        qf_loss = qf1_loss + qf2_loss

        # optimize the model
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()

        if iteration % args.policy_frequency == 0:  # TD 3 Delayed update support
            for _ in range(args.policy_frequency):  # compensate for the delay by doing 'actor_update_interval' instead of 1
                pi, log_pi, _ = actor.get_action(b_obs)
                qf1_pi = qf1(b_obs, pi)
                qf2_pi = qf2(b_obs, pi)
                min_qf_pi = torch.min(qf1_pi, qf2_pi)
                actor_loss = ((alpha * log_pi) - min_qf_pi).mean()

                actor_optimizer.zero_grad()
                actor_loss.backward()
                actor_optimizer.step()

                if args.autotune:
                    with torch.no_grad():
                        _, log_pi, _ = actor.get_action(b_obs)
                    alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()

                    a_optimizer.zero_grad()
                    alpha_loss.backward()
                    a_optimizer.step()
                    alpha = log_alpha.exp().detach()

        # update the target networks
        if iteration % args.target_network_frequency == 0:
            for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
            for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)

        synchronize(device)
        update_ms = (time.perf_counter() - update_start) * 1e3
        perf_sums += (rollout_ms, credit_timer.ms(), update_ms)
        perf_count += 1

        if iteration % args.log_frequency == 0:
            rollout_ms, credit_ms, update_ms = perf_sums / perf_count
            writer.add_scalar("losses/qf1_values", qf1_a_values.mean().item(), global_step)
            writer.add_scalar("losses/qf2_values", qf2_a_values.mean().item(), global_step)
            writer.add_scalar("losses/qf1_loss", qf1_loss.item(), global_step)
            writer.add_scalar("losses/qf2_loss", qf2_loss.item(), global_step)
            writer.add_scalar("losses/qf_loss", qf_loss.item() / 2.0, global_step)
            writer.add_scalar("losses/actor_loss", actor_loss.item(), global_step)
            writer.add_scalar("losses/alpha", float(alpha), global_step)
            if args.autotune:
                writer.add_scalar("losses/alpha_loss", alpha_loss.item(), global_step)
            writer.add_scalar("perf/rollout_ms", rollout_ms, global_step)
            writer.add_scalar("perf/credit_ms", credit_ms, global_step)
            writer.add_scalar("perf/update_ms", update_ms, global_step)
            writer.add_scalar("perf/credit_share", credit_ms / update_ms, global_step)
            writer.add_scalar("perf/iteration_ms", rollout_ms + update_ms, global_step)
            sps = int(global_step / (time.time() - start_time))
            writer.add_scalar("charts/SPS", sps, global_step)
            perf_sums, perf_count = np.zeros(3), 0
            if iteration % (10 * args.log_frequency) == 0:
                avg = np.mean(recent_returns) if recent_returns else float("nan")
                print(f"global_step={global_step} avg_return_100={avg:.1f} SPS={sps} alpha={float(alpha):.3f} "
                      f"rollout_ms={rollout_ms:.2f} credit_ms={credit_ms:.3f} update_ms={update_ms:.2f}")

    if args.save_model:
        torch.save((actor.state_dict(), qf1.state_dict(), qf2.state_dict()),
                   f"{args.log_dir}/{run_name}/{args.exp_name}.cleanrl_model")
    envs.close()
    writer.close()
    return nn.ModuleDict(dict(actor=actor, qf1=qf1, qf2=qf2, qf1_target=qf1_target, qf2_target=qf2_target)), \
        f"{args.log_dir}/{run_name}"


if __name__ == "__main__":
    train(tyro.cli(Args))
