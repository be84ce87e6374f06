# IMPALA (V-trace) in CleanRL's single-file style, with credit assignment by rl_triton.
# The actors act with a behaviour policy that lags the learner by up to `--policy-lag` updates
# and store its log-probabilities; the learner corrects for the lag with V-trace targets (value
# loss) and V-trace policy-gradient advantages. Episode boundaries as in ppo.py: terminations and
# truncations kept apart, the reset transition of next-step autoreset masked out of the loss.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on CPU runs only in its interpreter

import copy
import functools
import importlib.util
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import tyro
from torch.distributions.categorical import Categorical
from torch.utils.tensorboard import SummaryWriter

import rl_triton
from data_parallel import init_distributed, parameter_spread, sum_gradients


@dataclass
class Args:
    exp_name: str = "impala"
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
    env_backend: Literal["auto", "envpool", "gymnasium", "gymnax"] = "auto"
    """where the environments come from; `auto` is EnvPool where it is installed; `gymnax` runs
    JAX environments on the trainer's device (trainers/gymnax_envs.py, the `gymnax` extra)"""
    credit_backend: Literal["loop", "compile", "triton", "auto"] = "auto"
    """V-trace implementation: a sequential loop, rl_triton's torch backend under torch.compile,
    the Triton kernels, or rl_triton's choice (Triton on CUDA, torch on CPU)"""
    compile_backend: str = "inductor"
    """the torch.compile backend used by `--credit-backend compile`"""
    loss_backend: Literal["torch", "triton"] = "torch"
    """the value loss: inline torch lines, or rl_triton's fused `value_loss` kernels (Triton's
    interpreter on CPU); the policy-gradient and entropy terms stay inline either way"""
    total_timesteps: int = 500000
    """total timesteps of the experiments"""
    learning_rate: float = 5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 16
    """the number of parallel game environments (actors; of each rank under torchrun)"""
    num_steps: int = 32
    """the unroll length: steps per environment per rollout"""
    anneal_lr: bool = True
    """Toggle learning rate annealing"""
    policy_lag: int = 4
    """the behaviour policy is refreshed from the learner every `policy_lag` updates"""
    num_minibatches: int = 4
    """the batch is split into this many groups of whole sequences (one update each)"""
    update_epochs: int = 1
    """passes over each batch"""
    gamma: float = 0.99
    """the discount factor gamma"""
    vtrace_lambda: float = 1.0
    """the lambda of V-trace"""
    rho_clip: float = 1.0
    """the truncation rho-bar of the importance weights in the value targets"""
    c_clip: float = 1.0
    """the truncation c-bar of the trace coefficients"""
    pg_rho_clip: float = 1.0
    """the truncation of the importance weights of the policy-gradient advantages"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""

    # to be filled in runtime
    batch_size: int = 0
    """the batch size, of all ranks together (computed in runtime)"""
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


def vtrace_loop(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated, *,
                last_value, gamma, lam, rho_clip, c_clip, pg_rho_clip):
    """V-trace as a sequential loop, the way a CleanRL script would write it, with terminations
    and truncations kept apart. Returns (vs, pg_advantages)."""
    ratio = (target_log_probs - behavior_log_probs).exp()
    rho = ratio.clamp(max=rho_clip)
    c = lam * ratio.clamp(max=c_clip)
    vs = torch.zeros_like(values)
    pg_advantages = torch.zeros_like(values)
    acc = 0
    num_steps = rewards.shape[0]
    for t in reversed(range(num_steps)):
        nextvalues = last_value if t == num_steps - 1 else values[t + 1]
        nextnonterminal = 1.0 - terminated[t]
        nextnoncut = 1.0 - torch.maximum(terminated[t], truncated[t]) if t < num_steps - 1 else 0.0
        delta = rho[t] * (rewards[t] + gamma * nextnonterminal * nextvalues - values[t])
        acc = delta + gamma * c[t] * nextnoncut * acc
        next_vs = nextvalues if t == num_steps - 1 else nextnoncut * vs[t + 1] + (1 - nextnoncut) * nextvalues
        vs[t] = values[t] + acc
        pg_target = rewards[t] + gamma * nextnonterminal * (lam * next_vs + (1 - lam) * nextvalues)
        pg_advantages[t] = ratio[t].clamp(max=pg_rho_clip) * (pg_target - values[t])
    return vs, pg_advantages


def make_credit_assignment(args, device):
    """The one thing `--credit-backend` changes: which V-trace runs."""
    kwargs = dict(gamma=args.gamma, lam=args.vtrace_lambda, rho_clip=args.rho_clip,
                  c_clip=args.c_clip, pg_rho_clip=args.pg_rho_clip)
    if args.credit_backend == "loop":
        return functools.partial(vtrace_loop, **kwargs)
    if args.credit_backend == "compile":
        return torch.compile(functools.partial(rl_triton.vtrace, backend="torch", **kwargs),
                             backend=args.compile_backend)
    return functools.partial(rl_triton.vtrace, backend=args.credit_backend, **kwargs)


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
    rank, world_size, device = init_distributed(args)
    args.batch_size = int(args.num_envs * args.num_steps * world_size)
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
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "only discrete action space is supported"
    atari = is_atari(envs.single_observation_space)
    agent = Agent(envs).to(device)  # the learner
    if world_size > 1:  # every rank starts from rank 0's parameters
        for param in agent.parameters():
            dist.broadcast(param.data, 0)
    actor = copy.deepcopy(agent)  # the behaviour policy, refreshed every `policy_lag` updates
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    credit_assignment = make_credit_assignment(args, device)
    credit_timers = [Timer(device) for _ in range(args.num_minibatches * args.update_epochs)]
    loss_timers = [Timer(device) for _ in range(args.num_minibatches * args.update_epochs)]

    # ALGO Logic: Storage setup. obs has one slot more: the bootstrap observation
    obs_dtype = torch.uint8 if atari else torch.float32
    obs = torch.zeros((args.num_steps + 1, args.num_envs) + envs.single_observation_space.shape, dtype=obs_dtype).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long).to(device)
    behavior_logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    terminated = torch.zeros((args.num_steps, args.num_envs)).to(device)
    truncated = torch.zeros((args.num_steps, args.num_envs)).to(device)
    # valid[t] is False for the reset transition of next-step autoreset: never in the loss
    valid = torch.zeros((args.num_steps, args.num_envs), dtype=torch.bool).to(device)

    # TRY NOT TO MODIFY: start the game
    global_step = 0
    num_updates = 0
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
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # the actors: act with the lagging behaviour policy and store its log-probabilities
        rollout_start = time.perf_counter()
        for step in range(0, args.num_steps):
            global_step += args.num_envs * world_size
            obs[step] = next_obs
            valid[step] = next_valid
            with torch.no_grad():
                action, logprob, _, _ = actor.get_action_and_value(next_obs)
            actions[step] = action
            behavior_logprobs[step] = logprob

            next_obs, reward, term, trunc, info = envs.step(action if on_device else action.cpu().numpy())
            next_obs, reward, term, trunc = (torch.as_tensor(x, device=device) for x in (next_obs, reward, term, trunc))
            done = term | trunc
            rewards[step] = reward
            terminated[step] = term
            truncated[step] = trunc

            episode_return += torch.as_tensor(info["reward"], device=device) if atari else reward
            episode_length += next_valid
            next_valid = ~done
            ended[step] = (torch.as_tensor(info["terminated"], device=device).bool() | trunc) if atari else done
            ended_return[step], ended_length[step] = episode_return, episode_length
            episode_return.masked_fill_(ended[step], 0.0)
            episode_length.masked_fill_(ended[step], 0)
        obs[args.num_steps] = next_obs
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

        # the learner: each update takes whole sequences of a group of environments, evaluates
        # them with the current parameters and corrects for the lag with V-trace
        update_start = time.perf_counter()
        env_inds = np.arange(args.num_envs)
        timer_index = 0
        for epoch in range(args.update_epochs):
            np.random.shuffle(env_inds)
            for mb_envs in np.array_split(env_inds, args.num_minibatches):
                mb_envs = torch.as_tensor(mb_envs, device=device)
                mb_obs = obs[:, mb_envs]  # [T + 1, n, ...]
                hidden = agent.network(mb_obs.flatten(0, 1).float() * agent.obs_scale)
                all_values = agent.critic(hidden).view(args.num_steps + 1, -1)
                probs = Categorical(logits=agent.actor(hidden).view(args.num_steps + 1, len(mb_envs), -1)[:-1])
                mb_actions = actions[:, mb_envs]
                target_logprobs = probs.log_prob(mb_actions)
                entropy = probs.entropy()
                values = all_values[:-1]
                mb_valid = valid[:, mb_envs]

                # slot t+1 holds the successor of step t (the final observation after a done)
                timer, loss_timer = credit_timers[timer_index], loss_timers[timer_index]
                timer_index += 1
                with torch.no_grad():
                    timer.start()
                    vs, pg_advantages = credit_assignment(
                        rewards[:, mb_envs], values.detach(), terminated[:, mb_envs], target_logprobs.detach(),
                        behavior_logprobs[:, mb_envs], truncated[:, mb_envs], last_value=all_values[-1].detach())
                    timer.stop()

                # the losses, timed alone (their backward runs inside loss.backward() below). The
                # policy gradient -A log pi has no ratio to clip: no semantics §9 loss is it, so it
                # stays inline
                loss_timer.start()
                n_valid = mb_valid.sum().clamp(min=1)
                pg_loss = -(pg_advantages * target_logprobs)[mb_valid].sum() / n_valid
                if args.loss_backend == "torch":
                    v_loss = 0.5 * ((vs - values) ** 2)[mb_valid].sum() / n_valid
                else:  # 0.5 (V - vs)^2 averaged over the valid steps: token-mean under the mask
                    v_loss = rl_triton.value_loss(values, vs, mask=mb_valid, backend="triton")
                entropy_loss = entropy[mb_valid].sum() / n_valid
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
                loss_timer.stop()

                optimizer.zero_grad()
                if world_size > 1:
                    # the mean over every rank's valid steps: each rank's mean weighted by its
                    # share of them, then summed
                    mb_size = mb_valid.sum()
                    dist.all_reduce(mb_size)
                    (loss * (mb_valid.sum() / mb_size.clamp(min=1))).backward()
                    sum_gradients(agent)
                else:
                    loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                num_updates += 1
                if num_updates % args.policy_lag == 0:
                    actor.load_state_dict(agent.state_dict())

        synchronize(device)
        update_ms = (time.perf_counter() - update_start) * 1e3
        credit_ms = sum(timer.ms() for timer in credit_timers)
        loss_ms = sum(timer.ms() for timer in loss_timers)
        with torch.no_grad():
            log_ratio = (target_logprobs - behavior_logprobs[:, mb_envs])[mb_valid]

        # TRY NOT TO MODIFY: record rewards for plotting purposes (losses and perf/*: rank 0's own;
        # global_step and SPS count every rank's steps)
        if rank != 0:
            continue
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
        writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
        writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
        writer.add_scalar("losses/importance_ratio", log_ratio.exp().mean().item(), global_step)
        writer.add_scalar("losses/approx_kl", ((log_ratio.exp() - 1) - log_ratio).mean().item(), global_step)
        writer.add_scalar("perf/rollout_ms", rollout_ms, global_step)
        writer.add_scalar("perf/credit_ms", credit_ms, global_step)
        writer.add_scalar("perf/loss_ms", loss_ms, global_step)
        writer.add_scalar("perf/update_ms", update_ms, global_step)
        writer.add_scalar("perf/credit_share", credit_ms / update_ms, global_step)
        writer.add_scalar("perf/iteration_ms", rollout_ms + update_ms, global_step)
        writer.add_scalar("perf/valid_fraction", valid.float().mean().item(), global_step)
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
