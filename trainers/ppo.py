# PPO with GAE, in CleanRL's single-file style, with credit assignment by rl_triton.
# Differences from CleanRL's ppo.py: terminations and truncations are kept apart (a time limit
# bootstraps from the value of the final observation), the reset transition of next-step
# autoreset is masked out of the loss, one script serves discrete, continuous and Atari tasks,
# and the run logs where its time goes (perf/*) so that Amdahl's law can be read off TensorBoard.
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
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import tyro
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal
from torch.utils.tensorboard import SummaryWriter

import rl_triton
from data_parallel import init_distributed, parameter_spread, sum_gradients


@dataclass
class Args:
    exp_name: str = "ppo"
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
    """the id of the environment (EnvPool Atari ids such as `Breakout-v5` get the Nature-CNN agent)"""
    env_backend: Literal["auto", "envpool", "gymnasium", "gymnax"] = "auto"
    """where the environments come from; `auto` is EnvPool where it is installed; `gymnax` runs
    JAX environments on the trainer's device (trainers/gymnax_envs.py, the `gymnax` extra)"""
    credit_backend: Literal["loop", "compile", "triton", "auto"] = "auto"
    """GAE implementation: CleanRL's loop, rl_triton's torch backend under torch.compile, the
    Triton kernels, or rl_triton's choice (Triton on CUDA, torch on CPU)"""
    compile_backend: str = "inductor"
    """the torch.compile backend used by `--credit-backend compile`"""
    loss_backend: Literal["torch", "triton"] = "torch"
    """the clipped surrogate and value loss: CleanRL's inline torch lines, or rl_triton's fused
    `ppo_policy_loss` and `value_loss` kernels (Triton's interpreter on CPU)"""
    total_timesteps: int = 500000
    """total timesteps of the experiments"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 4
    """the number of parallel game environments (of each rank under torchrun)"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """Toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """Toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper."""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: Optional[float] = None
    """the target KL divergence threshold"""
    reward_scale: float = 1.0
    """rewards are multiplied by this before credit assignment (e.g. 0.1 for Pendulum)"""

    # to be filled in runtime
    batch_size: int = 0
    """the batch size, of all ranks together (computed in runtime)"""
    minibatch_size: int = 0
    """the mini-batch size, of all ranks together (computed in runtime)"""
    num_iterations: int = 0
    """the number of iterations (computed in runtime)"""


def env_backend(args):
    if args.env_backend == "auto":
        return "envpool" if importlib.util.find_spec("envpool") else "gymnasium"
    return args.env_backend


def env_seed(args):
    """Rank r's environments are seeded after rank r-1's: K ranks of N environments seeded one
    by one (EnvPool, Gymnasium's sync vector env) are the environments of one run of K*N."""
    return args.seed + (dist.get_rank() if dist.is_initialized() else 0) * args.num_envs


def make_envs(args, device):
    """A vector environment with next-step autoreset: after a step that ends an episode, the next
    step returns the first observation of the next episode, with reward 0 and no flags."""
    if env_backend(args) == "gymnax":
        from gymnax_envs import GymnaxVectorEnv

        return GymnaxVectorEnv(args.env_id, args.num_envs, device)
    if env_backend(args) == "envpool":
        import envpool

        atari = "episodic_life" in envpool.make_spec(args.env_id)._config_keys
        kwargs = dict(episodic_life=True, reward_clip=True) if atari else {}
        envs = envpool.make(args.env_id, env_type="gymnasium", num_envs=args.num_envs,
                            seed=env_seed(args), **kwargs)
        if not hasattr(envs, "single_action_space"):  # EnvPool < 1.0: the spaces are per env
            envs.single_action_space = envs.action_space
            envs.single_observation_space = envs.observation_space
        return envs
    # CartPole has a numpy-vectorized implementation (vector_entry_point); others run in a loop
    return gym.make_vec(args.env_id, num_envs=args.num_envs)


def is_atari(space):
    """EnvPool's Atari frames (4 x 84 x 84 uint8) go to the Nature CNN; vector observations and
    gymnax's MinAtar grids (10 x 10 x C) to the MLP, flattened."""
    return space.dtype == np.uint8 and len(space.shape) == 3


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Categorical policy and value over an MLP (vector observations) or the Nature CNN (Atari)."""

    def __init__(self, envs):
        super().__init__()
        obs_shape = envs.single_observation_space.shape
        n_actions = envs.single_action_space.n
        if is_atari(envs.single_observation_space):
            self.network = nn.Sequential(
                layer_init(nn.Conv2d(obs_shape[0], 32, 8, stride=4)), nn.ReLU(),
                layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
                layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
                nn.Flatten(),
                layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
            )
            self.obs_scale = 1.0 / 255.0
            self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
            self.critic = layer_init(nn.Linear(512, 1), std=1)
        else:
            self.network = nn.Flatten()
            self.obs_scale = 1.0
            n_obs = int(np.prod(obs_shape))
            self.critic = nn.Sequential(
                layer_init(nn.Linear(n_obs, 64)), nn.Tanh(),
                layer_init(nn.Linear(64, 64)), nn.Tanh(),
                layer_init(nn.Linear(64, 1), std=1.0),
            )
            self.actor = nn.Sequential(
                layer_init(nn.Linear(n_obs, 64)), nn.Tanh(),
                layer_init(nn.Linear(64, 64)), nn.Tanh(),
                layer_init(nn.Linear(64, n_actions), std=0.01),
            )

    def get_value(self, x):
        return self.critic(self.network(x.float() * self.obs_scale))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x.float() * self.obs_scale)
        probs = Categorical(logits=self.actor(hidden))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


class GaussianAgent(nn.Module):
    """Diagonal Gaussian policy for continuous actions (CleanRL's ppo_continuous_action agent)."""

    def __init__(self, envs):
        super().__init__()
        n_obs = int(np.prod(envs.single_observation_space.shape))
        n_act = int(np.prod(envs.single_action_space.shape))
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, n_act), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, n_act))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        action_mean = self.actor_mean(x)
        probs = Normal(action_mean, self.actor_logstd.expand_as(action_mean).exp())
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


def gae_loop(rewards, values, terminated, truncated, *, last_value, gamma, lam):
    """CleanRL's sequential GAE loop, with terminations and truncations kept apart: a
    termination drops the successor value, a truncation keeps it and cuts the trace."""
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    num_steps = rewards.shape[0]
    for t in reversed(range(num_steps)):
        nextvalues = last_value if t == num_steps - 1 else values[t + 1]
        nextnonterminal = 1.0 - terminated[t]
        nextnoncut = 1.0 - torch.maximum(terminated[t], truncated[t])
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * lam * nextnoncut * lastgaelam
    return advantages, advantages + values


def make_credit_assignment(args, device):
    """The one thing `--credit-backend` changes: which GAE runs."""
    kwargs = dict(gamma=args.gamma, lam=args.gae_lambda)
    if args.credit_backend == "loop":
        return functools.partial(gae_loop, **kwargs)
    if args.credit_backend == "compile":
        return torch.compile(functools.partial(rl_triton.gae, backend="torch", **kwargs),
                             backend=args.compile_backend)
    return functools.partial(rl_triton.gae, backend=args.credit_backend, **kwargs)


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


def minibatch_moments(x, world_size):
    """Size, mean and (unbiased) std of the minibatch; with K ranks it is the union of the K
    ranks' minibatches, from one all-reduce of (count, sum, sum of squares) in float64."""
    if world_size == 1:
        return x.numel(), x.mean(), x.std()
    x64 = x.double()
    stats = torch.stack([torch.tensor(x.numel(), dtype=torch.float64, device=x.device), x64.sum(), (x64 * x64).sum()])
    dist.all_reduce(stats)
    n, total, squares = stats
    mean = total / n
    var = (squares - n * mean * mean).clamp(min=0) / (n - 1)
    return int(n.item()), mean.to(x.dtype), var.sqrt().to(x.dtype)


def train(args: Args):
    rank, world_size, device = init_distributed(args)
    args.batch_size = int(args.num_envs * args.num_steps * world_size)
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    run_name = f"{args.env_id}__{args.exp_name}__{args.credit_backend}__{args.seed}__{int(time.time())}"
    if rank == 0:  # the other ranks' statistics reach TensorBoard through rank 0
        writer = SummaryWriter(f"{args.log_dir}/{run_name}")
        writer.add_text(
            "hyperparameters",
            "|param|value|\n|-|-|\n%s" % ("\n".join([f"|{key}|{value}|" for key, value in vars(args).items()])),
        )

    # TRY NOT TO MODIFY: seeding (each rank samples its own actions)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # env setup
    envs = make_envs(args, device)
    on_device = env_backend(args) == "gymnax"  # gymnax takes and returns tensors on the device (DLPack)
    continuous = isinstance(envs.single_action_space, gym.spaces.Box)
    atari = is_atari(envs.single_observation_space)
    agent = (GaussianAgent(envs) if continuous else Agent(envs)).to(device)
    if world_size > 1:  # every rank starts from rank 0's parameters
        for param in agent.parameters():
            dist.broadcast(param.data, 0)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    credit_assignment = make_credit_assignment(args, device)
    credit_timer = Timer(device)
    loss_timers = [Timer(device) for _ in range(args.update_epochs * args.num_minibatches)]
    if continuous:
        low = torch.as_tensor(envs.single_action_space.low, device=device)
        high = torch.as_tensor(envs.single_action_space.high, device=device)

    # ALGO Logic: Storage setup
    obs_dtype = torch.uint8 if atari else torch.float32
    obs = torch.zeros((args.num_steps, args.num_envs) + envs.single_observation_space.shape, dtype=obs_dtype).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs) + envs.single_action_space.shape).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    terminated = torch.zeros((args.num_steps, args.num_envs)).to(device)
    truncated = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)
    # valid[t] is False for the reset transition of next-step autoreset (the step after a done):
    # its action is ignored by the environment, so it never enters the loss
    valid = torch.zeros((args.num_steps, args.num_envs), dtype=torch.bool).to(device)

    # TRY NOT TO MODIFY: start the game
    global_step = 0
    start_time = time.time()
    next_obs, _ = envs.reset() if env_backend(args) == "envpool" else envs.reset(seed=env_seed(args))
    next_obs = torch.as_tensor(next_obs, device=device)
    next_valid = torch.ones(args.num_envs, dtype=torch.bool, device=device)
    # episode statistics stay on the device (no host sync per step); read once per rollout
    episode_return = torch.zeros(args.num_envs, dtype=torch.float64, device=device)
    episode_length = torch.zeros(args.num_envs, dtype=torch.long, device=device)
    ended = torch.zeros((args.num_steps, args.num_envs), dtype=torch.bool, device=device)
    ended_return = torch.zeros((args.num_steps, args.num_envs), dtype=torch.float64, device=device)
    ended_length = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long, device=device)
    recent_returns = deque(maxlen=100)

    for iteration in range(1, args.num_iterations + 1):
        # Annealing the rate if instructed to do so.
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        rollout_start = time.perf_counter()
        for step in range(0, args.num_steps):
            global_step += args.num_envs * world_size
            obs[step] = next_obs
            valid[step] = next_valid

            # ALGO LOGIC: action logic
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob

            # TRY NOT TO MODIFY: execute the game and log data.
            env_action = action.clamp(low, high) if continuous else action
            if not on_device:
                env_action = env_action.cpu().numpy()
            next_obs, reward, term, trunc, info = envs.step(env_action)
            next_obs, reward, term, trunc = (torch.as_tensor(x, device=device) for x in (next_obs, reward, term, trunc))
            done = term | trunc
            rewards[step] = reward * args.reward_scale
            terminated[step] = term
            truncated[step] = trunc

            # episode statistics in raw rewards; an Atari game ends at game over, not at a life loss
            episode_return += torch.as_tensor(info["reward"], device=device) if atari else reward
            episode_length += next_valid
            next_valid = ~done
            ended[step] = (torch.as_tensor(info["terminated"], device=device).bool() | trunc) if atari else done
            ended_return[step], ended_length[step] = episode_return, episode_length
            episode_return.masked_fill_(ended[step], 0.0)
            episode_length.masked_fill_(ended[step], 0)
        synchronize(device)
        rollout_ms = (time.perf_counter() - rollout_start) * 1e3
        finished_returns, finished_lengths = ended_return[ended].tolist(), ended_length[ended].tolist()
        if world_size > 1:  # the episodes of every rank
            finished = [None] * world_size
            dist.all_gather_object(finished, (finished_returns, finished_lengths))
            finished_returns = [r for returns, _ in finished for r in returns]
            finished_lengths = [n for _, lengths in finished for n in lengths]
        if finished_returns and rank == 0:
            recent_returns.extend(finished_returns)
            writer.add_scalar("charts/episodic_return", np.mean(finished_returns), global_step)
            writer.add_scalar("charts/episodic_length", np.mean(finished_lengths), global_step)
            writer.add_scalar("charts/avg_return_100", np.mean(recent_returns), global_step)

        # credit assignment: the successor of step t is slot t+1, which after a done holds the
        # final observation (next-step autoreset), so truncations need no extra input
        update_start = time.perf_counter()
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)[0]
            credit_timer.start()
            advantages, returns = credit_assignment(rewards, values, terminated, truncated, last_value=next_value)
            credit_timer.stop()

        # flatten the batch, keeping only real transitions
        b_valid = valid.reshape(-1).cpu().numpy()
        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape((-1,) + envs.single_action_space.shape)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        # Optimizing the policy and value network
        b_inds = np.flatnonzero(b_valid)
        clipfracs = []
        num_losses = 0
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for mb_inds in np.array_split(b_inds, args.num_minibatches):
                mb_inds = torch.as_tensor(mb_inds, device=device)
                mb_actions = b_actions[mb_inds] if continuous else b_actions.long()[mb_inds]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], mb_actions)
                newvalue = newvalue.view(-1)

                mb_advantages = b_advantages[mb_inds]
                mb_size, mb_mean, mb_std = minibatch_moments(mb_advantages, world_size)
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_mean) / (mb_std + 1e-8)

                # the losses, timed alone (their backward runs inside loss.backward() below)
                loss_timers[num_losses].start()
                if args.loss_backend == "torch":
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()
                    with torch.no_grad():
                        # calculate approx_kl http://joschu.net/blog/kl-approx.html
                        approx_kl = ((ratio - 1) - logratio).mean()

                    # Policy loss
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                    # Value loss
                    if args.clip_vloss:
                        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                        v_clipped = b_values[mb_inds] + torch.clamp(
                            newvalue - b_values[mb_inds],
                            -args.clip_coef,
                            args.clip_coef,
                        )
                        v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                        v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
                        v_loss = 0.5 * v_loss_max.mean()
                    else:
                        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()
                else:
                    # semantics §9's l is CleanRL's max(-A ratio, -A clamp(ratio)) and its value
                    # loss carries the same 0.5; approx_kl is the same k3 mean (of the log-ratio
                    # clamped to +-20)
                    pg_loss, _, approx_kl = rl_triton.ppo_policy_loss(
                        newlogprob, b_logprobs[mb_inds], mb_advantages, clip_low=args.clip_coef,
                        aggregation="token-mean", backend="triton")
                    v_loss = rl_triton.value_loss(newvalue, b_returns[mb_inds], b_values[mb_inds],
                                                  clip=args.clip_coef if args.clip_vloss else None,
                                                  backend="triton")

                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
                loss_timers[num_losses].stop()
                num_losses += 1

                with torch.no_grad():
                    # CleanRL's other diagnostics, outside the timed losses and alike for both
                    # backends: its clipfrac counts |ratio - 1| > clip whatever A's sign (the
                    # semantics' clip_fraction counts only where the clip binds)
                    logratio = newlogprob - b_logprobs[mb_inds]
                    old_approx_kl = (-logratio).mean()
                    clipfracs += [((logratio.exp() - 1.0).abs() > args.clip_coef).float().mean().item()]

                optimizer.zero_grad()
                if world_size > 1:
                    # the union's mean loss: each rank's mean weighted by its share, then summed
                    (loss * (len(mb_inds) / mb_size)).backward()
                    sum_gradients(agent)
                else:
                    loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

            if args.target_kl is not None:
                if world_size > 1:  # every rank stops after the same epoch: on the ranks' mean KL
                    approx_kl = approx_kl.detach().clone()
                    dist.all_reduce(approx_kl)
                    approx_kl /= world_size
                if approx_kl > args.target_kl:
                    break

        synchronize(device)
        update_ms = (time.perf_counter() - update_start) * 1e3
        credit_ms = credit_timer.ms()
        loss_ms = sum(timer.ms() for timer in loss_timers[:num_losses])

        y_pred, y_true = b_values[b_inds].cpu().numpy(), b_returns[b_inds].cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y

        # TRY NOT TO MODIFY: record rewards for plotting purposes (losses and perf/*: rank 0's own;
        # global_step and SPS count every rank's steps)
        if rank != 0:
            continue
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
        writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
        writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
        writer.add_scalar("losses/old_approx_kl", old_approx_kl.item(), global_step)
        writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
        writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
        writer.add_scalar("losses/explained_variance", explained_var, global_step)
        writer.add_scalar("perf/rollout_ms", rollout_ms, global_step)
        writer.add_scalar("perf/credit_ms", credit_ms, global_step)
        writer.add_scalar("perf/loss_ms", loss_ms, global_step)
        writer.add_scalar("perf/update_ms", update_ms, global_step)
        writer.add_scalar("perf/credit_share", credit_ms / update_ms, global_step)
        writer.add_scalar("perf/iteration_ms", rollout_ms + update_ms, global_step)
        writer.add_scalar("perf/valid_fraction", b_inds.size / b_valid.size, global_step)
        sps = int(global_step / (time.time() - start_time))
        writer.add_scalar("charts/SPS", sps, global_step)
        if iteration % 10 == 0 or iteration == args.num_iterations:
            avg = np.mean(recent_returns) if recent_returns else float("nan")
            print(f"iteration={iteration} global_step={global_step} avg_return_100={avg:.1f} SPS={sps} "
                  f"rollout_ms={rollout_ms:.1f} credit_ms={credit_ms:.2f} update_ms={update_ms:.1f}")

    if world_size > 1:  # the ranks took the same steps from the same start: they should agree
        spread = parameter_spread(agent)
        if rank == 0:
            print(f"parameters across {world_size} ranks: max abs difference {spread:.3g}")
        dist.barrier()  # no rank tears its connections down while another still reads them
        dist.destroy_process_group()
    if rank == 0:
        if args.save_model:
            torch.save(agent.state_dict(), f"{args.log_dir}/{run_name}/{args.exp_name}.cleanrl_model")
        writer.close()
    envs.close()
    return agent, f"{args.log_dir}/{run_name}"


if __name__ == "__main__":
    train(tyro.cli(Args))
