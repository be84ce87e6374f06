# PPO and GRPO on token rows, in CleanRL's single-file style, with credit assignment by rl_triton.
# A small decoder-only transformer, trained from scratch, plays a multi-turn number-guessing game:
# each turn it samples a guess token and the environment replies with observation tokens, so every
# response is a row of decision tokens (mask 1) with the environment's replies (mask 0) between
# them and right padding (mask 0) after them, the layout of multi-turn RLHF / RLVR rollouts. The
# run logs where its time goes (perf/*) so that Amdahl's law can be read off TensorBoard.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on CPU runs only in its interpreter

import copy
import functools
import random
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from torch.distributions.categorical import Categorical
from torch.utils.tensorboard import SummaryWriter

import rl_triton


@dataclass
class Args:
    exp_name: str = "llm_ppo"
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be enabled by default (when available)"""
    cpu_threads: int = 1
    """torch's threads on a CPU device (0: torch's default): the model is so small that more
    threads cost more in synchronization than they compute (docs/trainers.md)"""
    log_dir: str = "runs"
    """where the TensorBoard runs go"""

    # the game
    num_numbers: int = 16
    """K: the hidden number is drawn uniformly from [0, K)"""
    max_turns: int = 5
    """M: the game ends after M guesses (or at the first correct one)"""
    obs_len: int = 1
    """tokens per environment reply: the verdict, then obs_len - 1 filler tokens (long observations)"""
    response_len: int = 0
    """rows are right-padded to at least this many tokens (the long-row measurements)"""
    turn_cost: float = 0.0
    """the score is 1 for a solved game, minus turn_cost per guess"""

    # the model
    d_model: int = 64
    """width of the transformer"""
    n_layers: int = 2
    """number of pre-LN transformer blocks"""
    n_heads: int = 4
    """attention heads per block"""

    # Algorithm specific arguments
    estimator: Literal["ppo", "grpo"] = "ppo"
    """`ppo`: value head and token-level GAE; `grpo`: group-relative advantages, no value loss"""
    credit_backend: Literal["loop", "compile", "triton", "auto"] = "auto"
    """credit assignment: a verl-shaped token loop (GRPO: a loop over groups), rl_triton's torch
    backend under torch.compile, the Triton kernels, or rl_triton's choice (Triton on CUDA)"""
    compile_backend: str = "inductor"
    """the torch.compile backend used by `--credit-backend compile`"""
    fused_head: bool = False
    """compute the clipped surrogate and the entropy bonus with `rl_triton.linear_policy_loss`
    from the transformer's last hidden states and the policy head (docs/semantics.md §11): no
    [tokens, vocabulary] logits in the update"""
    packed: bool = False
    """PPO: hand rl_triton the rows packed with cu_seqlens (padding removed), then scatter back"""
    group_size: int = 8
    """GRPO: G samples share a hidden number and form a group"""
    num_episodes: int = 64
    """games per iteration (the batch of rows)"""
    total_episodes: int = 100000
    """games over the whole run"""
    learning_rate: float = 1e-3
    """the learning rate of the optimizer"""
    anneal_lr: bool = True
    """Toggle learning rate annealing"""
    gamma: float = 1.0
    """the discount factor per decision token"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches (of rows)"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    ent_coef: float = 0.05
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function (PPO)"""
    kl_coef: float = 0.0
    """PPO: per-token KL penalty in the rewards against the frozen initial model (0: no reference)"""
    max_grad_norm: float = 1.0
    """the maximum norm for the gradient clipping"""

    # to be filled in runtime
    num_iterations: int = 0
    """the number of iterations (computed in runtime)"""


# Vocabulary: the environment's words and structural tokens first, then one token per number.
HIGHER, LOWER, CORRECT, FILL, BOS, PAD = range(6)
NUM_SPECIAL = 6


def row_len(args):
    """Tokens per response row: M turns of a guess and its reply, padded to --response-len."""
    return max(args.response_len, args.max_turns * (1 + args.obs_len))


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention, then an MLP, each on a residual."""

    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(self.ln2(x))


class Policy(nn.Module):
    """Decoder-only transformer with a policy head over the K number tokens (the model's turns are
    guesses: constrained decoding) and a value head, both read at every position."""

    def __init__(self, args):
        super().__init__()
        d = args.d_model
        self.tok_emb = nn.Embedding(NUM_SPECIAL + args.num_numbers, d)
        self.pos_emb = nn.Embedding(1 + row_len(args), d)
        self.blocks = nn.ModuleList(Block(d, args.n_heads) for _ in range(args.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.policy_head = nn.Linear(d, args.num_numbers)
        self.value_head = nn.Linear(d, 1)
        # a near-uniform first policy: the run starts from the random guesser's success rate
        nn.init.normal_(self.policy_head.weight, std=0.01)
        nn.init.zeros_(self.policy_head.bias)

    def body(self, tokens):
        """The last hidden states, before the heads."""
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, tokens):
        x = self.body(tokens)
        return self.policy_head(x), self.value_head(x).squeeze(-1)


@torch.no_grad()
def play(model, hidden, args):
    """B games in lockstep, the environment in vectorized torch. Each turn the model samples a
    guess (temperature 1) and the environment appends its reply: HIGHER / LOWER / CORRECT, then
    obs_len - 1 FILL tokens. A game ends at CORRECT or after M guesses; the rest of its row is PAD.
    Returns the sequences [B, 1 + T] (BOS, the prompt, then the response row), the decision mask
    of the response rows [B, T], the guesses made and whether the game was solved."""
    B, T, turn_len = hidden.shape[0], row_len(args), 1 + args.obs_len
    seq = torch.full((B, 1 + T), PAD, dtype=torch.long, device=hidden.device)
    seq[:, 0] = BOS
    mask = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
    active = torch.ones(B, dtype=torch.bool, device=hidden.device)
    turns = torch.zeros(B, dtype=torch.long, device=hidden.device)
    fill = torch.full((B, args.obs_len - 1), FILL, dtype=torch.long, device=hidden.device)
    for turn in range(args.max_turns):
        t = turn * turn_len  # the response index of this turn's guess
        logits, _ = model(seq[:, : 1 + t])  # no KV cache: M short forward passes
        guess = Categorical(logits=logits[:, -1]).sample()
        verdict = torch.where(guess == hidden, CORRECT, torch.where(guess < hidden, HIGHER, LOWER))
        reply = torch.cat([(guess + NUM_SPECIAL)[:, None], verdict[:, None], fill], 1)
        seq[:, 1 + t: 1 + t + turn_len] = torch.where(active[:, None], reply, PAD)
        mask[:, t] = active
        turns += active
        active &= guess != hidden
        if not active.any():  # like generation stopping when every row has ended
            break
    return seq, mask, turns, ~active


def gae_loop(rewards, values, mask, *, gamma, lam):
    """A token loop of the shape verl's compute_gae_advantage_return has: reverse over the row,
    carrying the next decision token's value and trace across masked tokens, as if deleted
    (semantics §7). Each response ends its episode: nothing to bootstrap from after its last
    decision token."""
    B, T = rewards.shape
    nextvalues = torch.zeros(B, device=rewards.device)
    lastgaelam = torch.zeros(B, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        gaelam = delta + gamma * lam * lastgaelam
        nextvalues = torch.where(mask[:, t], values[:, t], nextvalues)
        lastgaelam = torch.where(mask[:, t], gaelam, lastgaelam)
        advantages[:, t] = lastgaelam
    advantages = torch.where(mask, advantages, 0.0)  # semantics §7: 0 off decisions (verl: carried)
    return advantages, torch.where(mask, advantages + values, 0.0)


def whiten_loop(x, mask, eps=1e-8):
    """verl's masked_whiten on the decision tokens: unbiased variance, eps inside the rsqrt."""
    kept = x[mask]
    return torch.where(mask, (x - kept.mean()) * torch.rsqrt(kept.var() + eps), 0.0)


def grpo_loop(scores, mask, *, group_size, eps=1e-6):
    """GRPO's outcome advantage one group at a time (verl's loop over prompts), on every token."""
    advantages = torch.empty_like(scores)
    for start in range(0, scores.shape[0], group_size):
        group = scores[start: start + group_size]
        advantages[start: start + group_size] = (group - group.mean()) / (group.std() + eps)
    return advantages[:, None] * mask


def make_credit_assignment(args):
    """The one thing `--credit-backend` changes. PPO: (rewards, values, mask) -> (whitened
    advantages, returns); GRPO: (scores, mask) -> advantages, on the tokens."""
    compiled = args.credit_backend == "compile"
    backend = "torch" if compiled else args.credit_backend
    wrap = functools.partial(torch.compile, backend=args.compile_backend) if compiled else (lambda f: f)
    if args.estimator == "grpo":
        if args.credit_backend == "loop":
            return functools.partial(grpo_loop, group_size=args.group_size)
        return wrap(functools.partial(rl_triton.group_advantages, group_size=args.group_size,
                                      backend=backend))

    if args.credit_backend == "loop":
        def loop_credit(rewards, values, mask):
            advantages, returns = gae_loop(rewards, values, mask, gamma=args.gamma, lam=args.gae_lambda)
            return whiten_loop(advantages, mask), returns
        return loop_credit

    gae = wrap(functools.partial(rl_triton.gae, gamma=args.gamma, lam=args.gae_lambda, backend=backend))
    whiten = wrap(functools.partial(rl_triton.masked_whiten, backend=backend))

    def credit(rewards, values, mask):
        B = rewards.shape[0]
        if not args.packed:
            advantages, returns = gae(rewards, values, torch.zeros_like(mask), mask=mask,
                                      last_value=torch.zeros(B, device=rewards.device), time_dim=1)
            return whiten(advantages, mask), returns
        # one segment per row, up to its last decision token: the padding (and the closing reply,
        # which no estimator reads) removed
        keep = mask.flip(1).cummax(1).values.flip(1)
        cu_seqlens = F.pad(torch.cumsum(keep.sum(1), 0), (1, 0))
        m = mask[keep]
        adv, ret = gae(rewards[keep], values[keep], torch.zeros_like(m), mask=m,
                       cu_seqlens=cu_seqlens, last_value=torch.zeros(B, device=rewards.device))
        advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
        advantages[keep], returns[keep] = whiten(adv, m), ret
        return advantages, returns
    return credit


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args: Args):
    if args.estimator == "grpo":
        assert args.group_size >= 2 and args.num_episodes % args.group_size == 0, \
            "GRPO needs groups of at least two samples that divide --num-episodes"
        assert not args.packed and args.kl_coef == 0, "--packed and --kl-coef are PPO's"
    args.num_iterations = max(1, args.total_episodes // args.num_episodes)
    run_name = f"GuessNumber-K{args.num_numbers}-M{args.max_turns}__{args.exp_name}__{args.credit_backend}__{args.seed}__{int(time.time())}"
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
    if device.type == "cpu" and args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    model = Policy(args).to(device)
    reference = copy.deepcopy(model).requires_grad_(False) if args.kl_coef > 0 else None
    optimizer = optim.Adam(model.parameters(), lr=args.learning_rate, eps=1e-5)
    credit_assignment = make_credit_assignment(args)
    B, K, turn_len = args.num_episodes, args.num_numbers, 1 + args.obs_len
    per_number = args.group_size if args.estimator == "grpo" else 1  # GRPO: a group per number

    global_step = 0  # games played
    start_time = last_report = time.time()
    for iteration in range(1, args.num_iterations + 1):
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / args.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # rollout: play the games, then score the rows in one forward pass (old log-probs, values)
        rollout_start = time.perf_counter()
        hidden = torch.randint(K, (B // per_number,), device=device).repeat_interleave(per_number)
        seq, mask, turns, solved = play(model, hidden, args)
        global_step += B
        tokens, responses = seq[:, :-1], seq[:, 1:]  # the output at position t scores token t + 1
        actions = (responses - NUM_SPECIAL).clamp(0, K - 1)  # number tokens; the rest is masked
        with torch.no_grad():
            logits, values = model(tokens)
            logprobs = torch.log_softmax(logits, -1).gather(-1, actions[..., None]).squeeze(-1)
        scores = solved.float() - args.turn_cost * turns
        # the outcome score on the last decision token, as verl and OpenRLHF place it
        rewards = torch.zeros_like(values).scatter_(1, ((turns - 1) * turn_len)[:, None], scores[:, None])
        if reference is not None:
            with torch.no_grad():
                ref_logprobs = torch.log_softmax(reference(tokens)[0], -1).gather(-1, actions[..., None]).squeeze(-1)
            ref_kl = torch.where(mask, logprobs - ref_logprobs, 0.0)
            rewards -= args.kl_coef * ref_kl
        synchronize(device)
        rollout_ms = (time.perf_counter() - rollout_start) * 1e3

        # credit assignment, timed between device synchronizations
        update_start = time.perf_counter()
        synchronize(device)
        credit_start = time.perf_counter()
        with torch.no_grad():
            if args.estimator == "ppo":
                advantages, returns = credit_assignment(rewards, values, mask)
            else:
                advantages = credit_assignment(scores, mask=mask)
        synchronize(device)
        credit_ms = (time.perf_counter() - credit_start) * 1e3

        # clipped surrogate, entropy (and value loss) as token means over the decision tokens
        clipfracs = []
        for epoch in range(args.update_epochs):
            for mb in torch.randperm(B, device=device).chunk(args.num_minibatches):
                mb_mask = mask[mb]
                n_tokens = mb_mask.sum()
                if args.fused_head:  # the same loss from the hidden states and the head's weights
                    x = model.body(tokens[mb])
                    new_values = model.value_head(x).squeeze(-1)
                    loss, metrics = rl_triton.linear_policy_loss(
                        x, model.policy_head.weight, actions[mb], logprobs[mb], advantages[mb],
                        mb_mask, bias=model.policy_head.bias, entropy_coef=args.ent_coef,
                        clip_low=args.clip_coef)
                    pg_loss, entropy_loss = metrics["pg_loss"], metrics["entropy"]
                    approx_kl = metrics["approx_kl"]
                    clipfracs += [metrics["clip_fraction"].item()]
                else:
                    new_logits, new_values = model(tokens[mb])
                    log_p = torch.log_softmax(new_logits, -1)
                    newlogprob = log_p.gather(-1, actions[mb][..., None]).squeeze(-1)
                    logratio = torch.where(mb_mask, newlogprob - logprobs[mb], 0.0)
                    ratio = logratio.exp()
                    with torch.no_grad():
                        approx_kl = torch.where(mb_mask, (ratio - 1) - logratio, 0.0).sum() / n_tokens
                        clipfracs += [(((ratio - 1.0).abs() > args.clip_coef) & mb_mask).sum().item() / n_tokens.item()]

                    mb_advantages = advantages[mb]
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                    pg_loss = torch.where(mb_mask, torch.max(pg_loss1, pg_loss2), 0.0).sum() / n_tokens
                    entropy = -(log_p.exp() * log_p).sum(-1)
                    entropy_loss = torch.where(mb_mask, entropy, 0.0).sum() / n_tokens
                    loss = pg_loss - args.ent_coef * entropy_loss
                # the value loss and the step: one place for both paths
                if args.estimator == "ppo":
                    v_loss = 0.5 * torch.where(mb_mask, (new_values - returns[mb]) ** 2, 0.0).sum() / n_tokens
                    loss = loss + args.vf_coef * v_loss

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
        synchronize(device)
        update_ms = (time.perf_counter() - update_start) * 1e3

        writer.add_scalar("charts/success_rate", solved.float().mean().item(), global_step)
        writer.add_scalar("charts/episodic_return", scores.mean().item(), global_step)
        writer.add_scalar("charts/mean_turns", turns.float().mean().item(), global_step)
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        writer.add_scalar("charts/episodes_per_second", global_step / (time.time() - start_time), global_step)
        writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
        writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
        writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
        writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
        if args.estimator == "ppo":
            writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
        if reference is not None:
            writer.add_scalar("losses/ref_kl", (ref_kl.sum() / mask.sum()).item(), global_step)
        writer.add_scalar("perf/rollout_ms", rollout_ms, global_step)
        writer.add_scalar("perf/credit_ms", credit_ms, global_step)
        writer.add_scalar("perf/update_ms", update_ms, global_step)
        writer.add_scalar("perf/credit_share", credit_ms / update_ms, global_step)
        writer.add_scalar("perf/iteration_ms", rollout_ms + update_ms, global_step)
        writer.add_scalar("perf/decision_fraction", mask.float().mean().item(), global_step)
        if iteration == 1 or time.time() - last_report > 10 or iteration == args.num_iterations:
            last_report = time.time()
            print(f"iteration={iteration} episodes={global_step} success_rate={solved.float().mean():.3f} "
                  f"mean_turns={turns.float().mean():.2f} rollout_ms={rollout_ms:.1f} "
                  f"credit_ms={credit_ms:.2f} update_ms={update_ms:.1f}", flush=True)

    writer.close()
    return model, f"{args.log_dir}/{run_name}"


if __name__ == "__main__":
    train(tyro.cli(Args))
