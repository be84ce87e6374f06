# Retrace(lambda) Q-learning in CleanRL's single-file style, with credit assignment by rl_triton.
# Off-policy: the actors act epsilon-greedily and store the behaviour probability mu(a_t | s_t) of
# the action they took; a replay holds fixed-length sequences; the learner trains Q towards
# Retrace(lambda) targets computed with a target network for the greedy target policy.
# Episode boundaries as in ppo.py: terminations and truncations kept apart (slot t+1 of a sequence
# holds the final observation after a done), reset transitions of next-step autoreset masked out.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on CPU runs only in its interpreter

import functools
import importlib.util
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
    exp_name: str = "retrace"
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
    """whether to save the agent's parameters into the run's folder"""

    # Algorithm specific arguments
    env_id: str = "CartPole-v1"
    """the id of the environment"""
    env_backend: Literal["auto", "envpool", "gymnasium"] = "auto"
    """where the environments come from; `auto` is EnvPool where it is installed"""
    credit_backend: Literal["loop", "compile", "triton", "auto"] = "auto"
    """Retrace implementation: a sequential loop, rl_triton's torch backend under torch.compile,
    the Triton kernels, or rl_triton's choice (Triton on CUDA, torch on CPU)"""
    compile_backend: str = "inductor"
    """the torch.compile backend used by `--credit-backend compile`"""
    total_timesteps: int = 500000
    """total timesteps of the experiments"""
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    anneal_lr: bool = True
    """Toggle learning rate annealing (linearly to zero at the end of training)"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 16
    """the length of the stored sequences (steps per environment per rollout)"""
    buffer_size: int = 4096
    """the replay capacity, in sequences"""
    gamma: float = 0.99
    """the discount factor gamma"""
    retrace_lambda: float = 0.95
    """the lambda of Retrace"""
    c_clip: float = 1.0
    """the truncation of the trace coefficients"""
    target_network_frequency: int = 500
    """the number of updates between target network copies"""
    batch_size: int = 32
    """the number of sequences per update"""
    updates_per_iteration: int = 2
    """gradient steps per rollout of num_envs x num_steps steps"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.3
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 5000
    """timestep to start learning"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""

    # to be filled in runtime
    num_iterations: int = 0
    """the number of iterations (computed in runtime)"""


def env_backend(args):
    if args.env_backend == "auto":
        return "envpool" if importlib.util.find_spec("envpool") else "gymnasium"
    return args.env_backend


def make_envs(args):
    """A vector environment with next-step autoreset: after a step that ends an episode, the next
    step returns the first observation of the next episode, with reward 0 and no flags."""
    if env_backend(args) == "envpool":
        import envpool

        envs = envpool.make(args.env_id, env_type="gymnasium", num_envs=args.num_envs, seed=args.seed)
        if not hasattr(envs, "single_action_space"):  # EnvPool < 1.0: the spaces are per env
            envs.single_action_space = envs.action_space
            envs.single_observation_space = envs.observation_space
        return envs
    # CartPole has a numpy-vectorized implementation (vector_entry_point); others run in a loop
    return gym.make_vec(args.env_id, num_envs=args.num_envs)


# ALGO LOGIC: initialize agent here:
class QNetwork(nn.Module):
    def __init__(self, envs):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(np.array(envs.single_observation_space.shape).prod(), 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, envs.single_action_space.n),
        )

    def forward(self, x):
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def greedy_probs(q_values):
    """The target policy: greedy in Q (ties to the lowest action), as probabilities."""
    return F.one_hot(q_values.argmax(-1), q_values.shape[-1]).float()


def retrace_loop(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated, *,
                 last_q_values, last_target_probs, gamma, lam, c_clip):
    """Retrace(lambda) Q targets as a sequential loop, with terminations and truncations kept
    apart: a termination drops the successor, a truncation keeps its expected value and cuts."""
    num_steps = rewards.shape[0]
    targets = torch.zeros_like(rewards)
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            expected = (last_target_probs * last_q_values).sum(-1)
            correction = 0.0
        else:
            a_next = actions[t + 1].unsqueeze(-1)
            expected = (target_probs[t + 1] * q_values[t + 1]).sum(-1)
            c_next = lam * (target_probs[t + 1].gather(-1, a_next).squeeze(-1) / behavior_probs[t + 1]).clamp(max=c_clip)
            nextnoncut = 1.0 - torch.maximum(terminated[t], truncated[t])
            correction = nextnoncut * c_next * (targets[t + 1] - q_values[t + 1].gather(-1, a_next).squeeze(-1))
        targets[t] = rewards[t] + gamma * (1.0 - terminated[t]) * (expected + correction)
    return targets


def make_credit_assignment(args, device):
    """The one thing `--credit-backend` changes: which Retrace runs."""
    kwargs = dict(gamma=args.gamma, lam=args.retrace_lambda, c_clip=args.c_clip)
    if args.credit_backend == "loop":
        return functools.partial(retrace_loop, **kwargs)
    if args.credit_backend == "compile":
        return torch.compile(functools.partial(rl_triton.retrace, backend="torch", **kwargs),
                             backend=args.compile_backend)
    return functools.partial(rl_triton.retrace, backend=args.credit_backend, **kwargs)


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
    args.num_iterations = max(1, args.total_timesteps // (args.num_envs * args.num_steps))
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
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "only discrete action space is supported"
    n_actions = envs.single_action_space.n
    q_network = QNetwork(envs).to(device)
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(envs).to(device)
    target_network.load_state_dict(q_network.state_dict())
    credit_assignment = make_credit_assignment(args, device)
    credit_timers = [Timer(device) for _ in range(args.updates_per_iteration)]

    # ALGO Logic: storage of one rollout (time-major), obs with one more slot: the bootstrap state
    T, N = args.num_steps, args.num_envs
    obs_shape = envs.single_observation_space.shape
    obs = torch.zeros((T + 1, N) + obs_shape).to(device)
    actions = torch.zeros((T, N), dtype=torch.long).to(device)
    behavior_probs = torch.zeros((T, N)).to(device)
    rewards = torch.zeros((T, N)).to(device)
    terminated = torch.zeros((T, N)).to(device)
    truncated = torch.zeros((T, N)).to(device)
    valid = torch.zeros((T, N), dtype=torch.bool).to(device)  # False for reset transitions
    # the replay: `buffer_size` sequences of T steps, time-major like the rollout
    rb_obs = torch.zeros((T + 1, args.buffer_size) + obs_shape).to(device)
    rb_actions = torch.zeros((T, args.buffer_size), dtype=torch.long).to(device)
    rb_behavior_probs = torch.ones((T, args.buffer_size)).to(device)
    rb_rewards = torch.zeros((T, args.buffer_size)).to(device)
    rb_terminated = torch.zeros((T, args.buffer_size)).to(device)
    rb_truncated = torch.zeros((T, args.buffer_size)).to(device)
    rb_valid = torch.zeros((T, args.buffer_size), dtype=torch.bool).to(device)
    rb_pos, rb_full = 0, False

    # TRY NOT TO MODIFY: start the game
    global_step = 0
    num_updates = 0
    start_time = time.time()
    next_obs, _ = envs.reset() if env_backend(args) == "envpool" else envs.reset(seed=args.seed)
    next_obs = torch.as_tensor(next_obs, dtype=torch.float32).to(device)
    next_valid = np.ones(N, dtype=bool)
    episode_return = np.zeros(N)
    episode_length = np.zeros(N, dtype=np.int64)
    recent_returns = deque(maxlen=100)

    for iteration in range(1, args.num_iterations + 1):
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # the actors: epsilon-greedy, storing mu(a_t | s_t) of the action taken
        rollout_start = time.perf_counter()
        finished_returns, finished_lengths = [], []
        for step in range(T):
            epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
            global_step += N
            obs[step] = next_obs
            valid[step] = torch.as_tensor(next_valid).to(device)
            with torch.no_grad():
                greedy = q_network(next_obs).argmax(-1)
            explore = torch.rand(N, device=device) < epsilon
            action = torch.where(explore, torch.randint(0, n_actions, (N,), device=device), greedy)
            actions[step] = action
            behavior_probs[step] = epsilon / n_actions + (1 - epsilon) * (action == greedy).float()

            next_obs, reward, term, trunc, info = envs.step(action.cpu().numpy())
            done = np.logical_or(term, trunc)
            rewards[step] = torch.as_tensor(reward, dtype=torch.float32).to(device)
            terminated[step] = torch.as_tensor(term, dtype=torch.float32).to(device)
            truncated[step] = torch.as_tensor(trunc, dtype=torch.float32).to(device)
            next_obs = torch.as_tensor(next_obs, dtype=torch.float32).to(device)

            episode_return += reward
            episode_length += next_valid
            next_valid = ~done
            if done.any():
                finished_returns.extend(episode_return[done].tolist())
                finished_lengths.extend(episode_length[done].tolist())
                episode_return[done] = 0.0
                episode_length[done] = 0
        obs[T] = next_obs
        # the N new sequences enter the replay (a ring)
        slots = torch.arange(rb_pos, rb_pos + N, device=device) % args.buffer_size
        rb_obs[:, slots] = obs
        rb_actions[:, slots] = actions
        rb_behavior_probs[:, slots] = behavior_probs
        rb_rewards[:, slots] = rewards
        rb_terminated[:, slots] = terminated
        rb_truncated[:, slots] = truncated
        rb_valid[:, slots] = valid
        rb_full = rb_full or rb_pos + N >= args.buffer_size
        rb_pos = (rb_pos + N) % args.buffer_size
        synchronize(device)
        rollout_ms = (time.perf_counter() - rollout_start) * 1e3
        if finished_returns:
            recent_returns.extend(finished_returns)
            writer.add_scalar("charts/episodic_return", np.mean(finished_returns), global_step)
            writer.add_scalar("charts/episodic_length", np.mean(finished_lengths), global_step)
            writer.add_scalar("charts/avg_return_100", np.mean(recent_returns), global_step)
        writer.add_scalar("charts/epsilon", epsilon, global_step)
        writer.add_scalar("perf/rollout_ms", rollout_ms, global_step)

        # ALGO LOGIC: training.
        if global_step < args.learning_starts:
            continue
        update_start = time.perf_counter()
        for update in range(args.updates_per_iteration):
            idx = torch.randint(0, args.buffer_size if rb_full else rb_pos, (args.batch_size,), device=device)
            b_obs, b_actions, b_valid = rb_obs[:, idx], rb_actions[:, idx], rb_valid[:, idx]
            q_all = q_network(b_obs)  # [T + 1, B, A]
            with torch.no_grad():
                target_q = target_network(b_obs)
                target_probs = greedy_probs(q_all.detach())  # the policy being evaluated
                credit_timers[update].start()
                q_targets = credit_assignment(
                    rb_rewards[:, idx], target_q[:T], b_actions, target_probs[:T], rb_behavior_probs[:, idx],
                    rb_terminated[:, idx], rb_truncated[:, idx], last_q_values=target_q[T], last_target_probs=target_probs[T])
                credit_timers[update].stop()
            q_taken = q_all[:T].gather(-1, b_actions.unsqueeze(-1)).squeeze(-1)
            loss = F.mse_loss(q_taken[b_valid], q_targets[b_valid])

            # optimize the model
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
            optimizer.step()
            num_updates += 1

            # update target network
            if num_updates % args.target_network_frequency == 0:
                target_network.load_state_dict(q_network.state_dict())

        synchronize(device)
        update_ms = (time.perf_counter() - update_start) * 1e3
        credit_ms = sum(timer.ms() for timer in credit_timers)
        writer.add_scalar("losses/td_loss", loss.item(), global_step)
        writer.add_scalar("losses/q_values", q_taken[b_valid].mean().item(), global_step)
        writer.add_scalar("perf/credit_ms", credit_ms, global_step)
        writer.add_scalar("perf/update_ms", update_ms, global_step)
        writer.add_scalar("perf/credit_share", credit_ms / update_ms, global_step)
        writer.add_scalar("perf/iteration_ms", rollout_ms + update_ms, global_step)
        sps = int(global_step / (time.time() - start_time))
        writer.add_scalar("charts/SPS", sps, global_step)
        if iteration % 50 == 0 or iteration == args.num_iterations:
            avg = np.mean(recent_returns) if recent_returns else float("nan")
            print(f"iteration={iteration} global_step={global_step} avg_return_100={avg:.1f} SPS={sps} epsilon={epsilon:.3f} "
                  f"rollout_ms={rollout_ms:.1f} credit_ms={credit_ms:.2f} update_ms={update_ms:.1f}")

    if args.save_model:
        torch.save(q_network.state_dict(), f"{args.log_dir}/{run_name}/{args.exp_name}.cleanrl_model")
    envs.close()
    writer.close()
    return q_network, f"{args.log_dir}/{run_name}"


if __name__ == "__main__":
    train(tyro.cli(Args))
