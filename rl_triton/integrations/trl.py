"""TRL integration (checked against TRL 1.16.0, `trl/trainer/grpo_trainer.py`, installed in CI).

A `GRPOTrainer` whose loss runs on rl_triton, for every `loss_type` of semantics §10 ("grpo",
"bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo") and `importance_sampling_level`
("token", "sequence"), one line::

    from rl_triton.integrations.trl import GRPOTrainer   # instead of `from trl import GRPOTrainer`

or, on a trainer class of your own, the mixin: `class MyTrainer(GRPOTrainerMixin, MyGRPOTrainer)`.
Its `_compute_loss` is TRL's (the model's log-probabilities and entropies, the entropy and
off-policy masks, the entropy bonus, the auxiliary loss, the metrics TRL logs) with the policy
loss and its KL term one `grpo_loss` call. The loss alone::

    loss, metrics = rl_triton.integrations.trl.grpo_loss(
        per_token_logps, old_per_token_logps, advantages, completion_mask,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, num_items_in_batch=n_tokens)

TRL computes the group advantages inline in `_generate_and_score_completions` (a 600-line method
that also generates and scores), so the trainer keeps TRL's advantages: rl_triton's
`group_advantages` computes the same rows (docs/llm.md). Importing this module does not import
TRL; `GRPOTrainer` imports it on first use.
"""
from __future__ import annotations

import math

import torch

import rl_triton
from ..ops import _losses

__all__ = ["grpo_loss", "gamma_weights", "GRPOTrainerMixin", "GRPOTrainer", "LOSS_TYPES",
           "TRL_VERSION"]

Tensor = torch.Tensor
# the rl_triton backend these functions call ("auto": the Triton kernels on CUDA, torch on CPU)
backend = "auto"
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# the TRL whose `GRPOTrainer._compute_loss` this module reproduces (tests/test_trl_trainer.py)
TRL_VERSION = "1.16.0"
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def grpo_loss(per_token_logps: Tensor, old_per_token_logps, advantages: Tensor, mask: Tensor, *,
              loss_type: str = "dapo", importance_sampling_level: str = "token",
              epsilon: float = 0.2, epsilon_high=None, delta=None,
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
              vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
              beta: float = 0.0, ref_per_token_logps=None, use_bias_correction_kl: bool = False,
              importance_sampling_ratio=None, off_policy_mask=None, entropy_mask=None,
              max_completion_length=None, num_items_in_batch=None, num_processes: int = 1,
              gradient_accumulation_steps: int = 1, steps_per_generation: int = 1,
              sequence_extremes: bool = False):
    """TRL 1.16.0's GRPO loss `[B, T]` -> `(loss, metrics)`, as `GRPOTrainer._compute_loss` returns it
    in training mode (in eval mode pass `gradient_accumulation_steps=1, steps_per_generation=1`).

    `old_per_token_logps=None`: the new ones, detached (TRL's single-iteration case);
    `advantages`: `[B]` or `[B, T]`; `mask`: the completion mask (times the tool mask).
    `importance_sampling_ratio` (TRL's vLLM correction, `[B, T]` or `[B, 1]`) multiplies the
    policy term, except for vespo, whose gamma weights take it in instead (as TRL);
    `off_policy_mask` (`[B, 1]`) and `entropy_mask` (`[B, T]`), TRL's, multiply the policy term.
    Aggregation by loss type, as TRL: grpo / sapo the mean over all B sequences of each one's
    token mean; bnpo the token mean; dr_grpo the token sum over B * max_completion_length; luspo
    the mean over the B sequences of each one's token sum; cispo / dapo / vespo the token sum over
    clamp(num_items_in_batch, 1) / num_processes * gradient_accumulation_steps /
    steps_per_generation (TRL 1.16's rescaling of the generation batch's count to one
    accumulation window; the others divide by gradient_accumulation_steps). vespo is
    `-phi A x` with TRL's sequence gamma weight phi (no gradient), on `policy_loss`'s "gpg".
    `metrics` (TRL's names, 0-d tensors): "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean" (clipped loss types), "cispo_clip_ratio" or "vespo/phi_seq_mean",
    and "kl" where beta != 0; with `sequence_extremes` also TRL's "clip_ratio/low_min" and
    "clip_ratio/high_max" (the extremes over sequences of each one's clipped fraction,
    NaN-ignoring; one process), which cost a torch pass over the tokens.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}; got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError("importance_sampling_level must be 'token' or 'sequence'; got "
                         f"{importance_sampling_level!r}")
    if not isinstance(per_token_logps, Tensor) or per_token_logps.ndim != 2:
        raise ValueError("per_token_logps must be a [B, T] tensor")
    B, T = per_token_logps.shape
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    adv_rows = advantages.ndim == 1
    adv = advantages[:, None].expand(B, T) if adv_rows else advantages
    high = epsilon if epsilon_high is None else epsilon_high
    level = importance_sampling_level
    options = dict(ratio_level=level, log_ratio_clamp=None)
    weights = None if loss_type == "vespo" else importance_sampling_ratio
    if loss_type == "cispo":
        if not high >= 1.0:
            raise ValueError(f"loss_type='cispo' bounds the ratio above by epsilon_high (TRL's "
                             f"epsilon_max, e.g. 5.0); got epsilon_high={high}, below 1")
        options.update(loss_type="cispo", clip_low=float("inf"), clip_high=float(high) - 1.0)
    elif loss_type == "sapo":
        options.update(loss_type="sapo", tau_pos=float(sapo_temperature_pos),
                       tau_neg=float(sapo_temperature_neg))
    elif loss_type == "vespo":
        # TRL's per-sequence weight of the log-likelihood, with its own sequence ratio (a sum,
        # not the level's mean): the REINFORCE loss "gpg" weighted by it
        phi = _gamma_weights(advantages if not adv_rows else advantages[:, None],
                             per_token_logps - old, mask, importance_sampling_ratio,
                             vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
        options = dict(loss_type="gpg")
        weights = phi
    else:
        options.update(loss_type="vanilla", clip_low=float(epsilon), clip_high=float(high),
                       delta=None if delta is None else float(delta))
    for extra in (off_policy_mask, entropy_mask):
        if extra is not None:
            weights = extra if weights is None else weights * extra
    if loss_type in ("grpo", "sapo"):
        agg, counts, ga = "seq-mean-token-mean", dict(global_batch_size=B), True
    elif loss_type == "bnpo":
        agg, counts, ga = "token-mean", {}, True
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        agg, counts, ga = "token-mean", dict(batch_num_tokens=B * max_completion_length), True
    elif loss_type == "luspo":
        agg, counts, ga = "seq-mean-token-sum", dict(global_batch_size=B), True
    else:
        if num_items_in_batch is None:
            raise ValueError(f"loss_type={loss_type!r} needs num_items_in_batch (the global "
                             "number of completion tokens)")
        n = torch.as_tensor(num_items_in_batch, device=per_token_logps.device).clamp(min=1.0)
        n = n / num_processes
        if (gradient_accumulation_steps, steps_per_generation) != (1, 1):
            n = n * gradient_accumulation_steps / steps_per_generation
        agg, counts, ga = "token-mean", dict(batch_num_tokens=n), False
    if weights is not None and weights.shape != (B, T):
        weights = weights.expand(B, T)
    dtype = per_token_logps.dtype if per_token_logps.dtype in (torch.float32, torch.float64) \
        else torch.float32
    loss, ours = rl_triton.policy_loss(per_token_logps, old, adv, mask, aggregation=agg,
                                       weights=weights, backend=backend, out_dtype=dtype,
                                       **options, **counts)
    m = mask != 0
    metrics = {}
    if beta != 0.0:
        # TRL's k3 of (ref, new), times the importance weight with use_bias_correction_kl
        kl = rl_triton.kl_penalty(per_token_logps, ref_per_token_logps, kind="k3",
                                  backend=backend, out_dtype=dtype)
        if use_bias_correction_kl:
            kl = kl * _coef(per_token_logps, old, m, level)
        base, factor = _plan_like(agg, m, counts)
        loss = loss + beta * _scaled(_losses.aggregate(kl, m, base, None), factor)
        metrics["kl"] = _losses.masked_mean(kl.detach(), m)
    if ga:
        loss = loss / gradient_accumulation_steps
    if loss_type in CLIPPED:
        low, high_ = ours["clip_fraction_negative"], ours["clip_fraction_positive"]
        if level == "sequence" and adv_rows:  # TRL's [B, 1] flags: means over the B rows
            r = _coef(per_token_logps.detach(), old.detach(), m, level)[:, 0]
            if delta is not None:
                r = r.clamp(max=delta)
            low = ((r < 1 - epsilon) & (advantages < 0)).to(dtype).mean()
            high_ = ((r > 1 + high) & (advantages > 0)).to(dtype).mean()
        metrics.update({"clip_ratio/low_mean": low, "clip_ratio/high_mean": high_,
                        "clip_ratio/region_mean": low + high_})
        if sequence_extremes:
            lo, hi = _clipped_per_sequence(per_token_logps.detach(), old.detach(), advantages,
                                           m, level, epsilon, high, delta, dtype)
            metrics.update({"clip_ratio/low_min": _nan_extreme(lo, torch.min),
                            "clip_ratio/high_max": _nan_extreme(hi, torch.max)})
    elif loss_type == "cispo":
        value = ours["clip_fraction_positive"]
        if level == "sequence" and adv_rows:
            r = _coef(per_token_logps.detach(), old.detach(), m, level)[:, 0]
            value = ((r > high) & (advantages > 0)).to(dtype).mean()
        metrics["cispo_clip_ratio"] = value
    elif loss_type == "vespo":
        phi = phi.to(dtype)  # [B, 1], or [B, T] with [B, T] advantages: TRL's masked mean
        metrics["vespo/phi_seq_mean"] = phi.mean() if phi.shape[1] == 1 else \
            _losses.masked_mean(phi, m)
    return loss, metrics


CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@torch.no_grad()
def _gamma_weights(advantages, log_ratio, mask, importance_sampling_ratio, k_pos, lambda_pos,
                   k_neg, lambda_neg):
    """TRL 1.16's `GRPOTrainer.get_gamma_weights` (VESPO), `[B, 1]`, no gradient:
    phi(w) = exp(lambda + k log w - lambda w) of the sequence's summed log-ratio w (clamped to
    [log 1e-8, 20], plus the log of the vLLM ratio), k and lambda by the advantage's sign."""
    lower = math.log(1e-8)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if importance_sampling_ratio is not None:
        seq = seq + importance_sampling_ratio.log().clamp(lower, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _coef(new, old, m, level):
    """TRL's coef_1: exp of the log-ratio, or of its mean over the sequence ([B, 1])."""
    d = torch.where(m, new - old, 0.0)
    if level == "token":
        return d.exp()
    return (d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).exp()


def _clipped_per_sequence(new, old, advantages, m, level, low, high, delta, dtype):
    """TRL's clipped fractions per sequence (its masked_seq_mean of the low / high flags): over the
    sequence's tokens, or its one flag at sequence level with [B] advantages; NaN for an empty
    sequence, as TRL."""
    r = _coef(new, old, m, level)
    if delta is not None:
        r = r.clamp(max=delta)
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    lo, hi = (r < 1 - low) & (adv < 0), (r > 1 + high) & (adv > 0)

    def per_sequence(flag):
        if flag.shape[1] == 1:
            return flag[:, 0].to(dtype)
        return (flag.to(dtype) * m).sum(-1) / m.sum(-1)

    return per_sequence(lo), per_sequence(hi)


def _nan_extreme(x, fn):
    """TRL's nanmin / nanmax: the extreme of the values that are not NaN, NaN if none."""
    ok = ~torch.isnan(x)
    return fn(x[ok]) if ok.any() else x.new_tensor(float("nan"))


def _plan_like(agg, m, counts):
    from ..ops.policy_loss import _plan
    return _plan(agg, m, None, tuple(m.shape), 1, counts.get("batch_num_tokens"),
                 counts.get("global_batch_size"), None)


def _scaled(x, factor):
    return x if factor is None else x * factor


# ---- the trainer ---------------------------------------------------------------------------------

class GRPOTrainerMixin:
    """Put before TRL's `GRPOTrainer` (or a subclass of it) in the bases: its `_compute_loss` is
    TRL 1.16.0's, the policy loss and KL term one `grpo_loss` call (every `loss_type`, both
    `importance_sampling_level`s), everything else TRL's own steps: the log-probabilities and
    entropies (`_get_per_token_logps_and_entropies`), the entropy mask (`top_entropy_quantile`),
    the off-policy mask (`off_policy_mask_threshold`), the vLLM importance-sampling correction,
    the entropy bonus (static or adaptive), the auxiliary router loss and the metrics TRL logs,
    reduced over processes as TRL reduces them. A mixin rather than a class built from
    `trl.GRPOTrainer`, so that it goes on any GRPOTrainer subclass and needs no TRL import."""

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in _MODEL_INPUTS})
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        advantages = inputs["advantages"]
        old = inputs.get("old_per_token_logps")
        old = per_token_logps.detach() if old is None else old
        weights = entropy_mask
        if self.off_policy_mask_threshold is not None:
            off = self.get_off_policy_mask(
                advantages=advantages[:, None] if advantages.ndim == 1 else advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                mask=mask, off_policy_threshold=self.off_policy_mask_threshold)
            weights = off if weights is None else off * weights
        if self.loss_type == "vespo":
            is_ratio = inputs.get("importance_sampling_ratio")
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
        else:
            is_ratio = None
        mode = "train" if self.model.training else "eval"
        train = mode == "train"
        args = self.args
        loss, metrics = grpo_loss(
            per_token_logps, old, advantages, mask, loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level, epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high, delta=args.delta,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg, beta=self.beta,
            ref_per_token_logps=inputs.get("ref_per_token_logps"),
            use_bias_correction_kl=args.use_bias_correction_kl,
            importance_sampling_ratio=is_ratio, per_token_weights=weights,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps if train else 1,
            steps_per_generation=args.steps_per_generation if train else 1,
            sequence_extremes=True)
        accumulation = self.current_gradient_accumulation_steps if train else 1.0
        log = self._metrics[mode]
        if self._entropy_bonus_enabled:  # TRL's entropy bonus, its adaptive coefficient
            effective = mask if entropy_mask is None else mask * entropy_mask
            entropy_loss = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation
            if self.use_adaptive_entropy:
                coef = self.entropy_coef if self._last_world_entropy <= args.entropy_target else 0.0
            else:
                coef = self.entropy_coef
            loss = loss - coef * entropy_loss
            log["policy_loss"].append(self.accelerator.gather(metrics["policy_loss"]).nanmean().item())
            if self.use_adaptive_entropy and train:
                stats = torch.stack([(entropies * effective).sum(), effective.sum()]).detach()
                self._entropy_window_stats = stats if self._entropy_window_stats is None else \
                    self._entropy_window_stats + stats
                if self.accelerator.sync_gradients:
                    window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                    world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                    if world_entropy <= args.entropy_target:
                        self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta,
                                                args.entropy_coef_max)
                    else:
                        self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta,
                                                args.entropy_coef_min)
                    self._last_world_entropy = world_entropy
                    self._entropy_window_stats = None
            if train and self.accelerator.sync_gradients:
                log["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            log["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        tokens = mask.sum().float()
        # TRL's metrics are global: (sum, count) reduced over processes; a sequence-level flag
        # counts once per sequence
        sequences = torch.tensor(float(mask.shape[0]), device=tokens.device)
        per_sequence = self.importance_sampling_level == "sequence" and advantages.ndim == 1

        def global_mean(value, count):
            totals = self.accelerator.reduce(torch.stack([value.float() * count, count]),
                                             reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self.beta != 0.0:
            log["kl"].append(global_mean(metrics["kl"], tokens))
        log["entropy"].append(global_mean(_losses.masked_mean(entropies.detach(), mask != 0), tokens))
        if self.loss_type in _CLIPPED:
            count = sequences if per_sequence else tokens
            for name in ("low_mean", "high_mean", "region_mean"):
                log[f"clip_ratio/{name}"].append(global_mean(metrics[f"clip_ratio/{name}"], count))
            for name, fn in (("low_min", torch.min), ("high_max", torch.max)):
                values = self.accelerator.gather(metrics[f"clip_ratio/{name}"].reshape(1))
                ok = ~torch.isnan(values)
                log[f"clip_ratio/{name}"].append(fn(values[ok]).item() if ok.any() else float("nan"))
        elif self.loss_type == "cispo":
            count = sequences if per_sequence else tokens
            log["cispo_clip_ratio"].append(global_mean(metrics["cispo_clip_ratio"], count))
        elif self.loss_type == "vespo":
            count = sequences if advantages.ndim == 1 else tokens
            log["vespo/phi_seq_mean"].append(global_mean(metrics["vespo/phi_seq_mean"], count))
        return loss


# the multimodal inputs `_compute_loss` hands to the model, as TRL 1.16.0 does
_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                 "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                 "mm_token_type_ids", "image_position_ids")
_TRAINER = None


def __getattr__(name):
    # `GRPOTrainer`: built, and TRL imported, on first use
    global _TRAINER
    if name != "GRPOTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _TRAINER is None:
        import trl

        if trl.__version__ != TRL_VERSION:
            import warnings
            warnings.warn(f"rl_triton.integrations.trl reproduces TRL {TRL_VERSION}'s "
                          f"GRPOTrainer._compute_loss; TRL {trl.__version__} is installed",
                          stacklevel=2)
        _TRAINER = type("GRPOTrainer", (GRPOTrainerMixin, trl.GRPOTrainer),
                        {"__module__": __name__, "__doc__": "TRL's GRPOTrainer with the loss on "
                         "rl_triton (GRPOTrainerMixin)."})
    return _TRAINER
