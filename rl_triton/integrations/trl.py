"""TRL integration (checked against TRL 1.16.0, `trl/trainer/grpo_trainer.py`, installed in CI).

A `GRPOTrainer` whose loss runs on rl_triton, for every `loss_type` of TRL 1.16.0 ("grpo",
"bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"; semantics §10) and
`importance_sampling_level` ("token", "sequence"), one line::

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

__all__ = ["grpo_loss", "GRPOTrainerMixin", "GRPOTrainer", "LOSS_TYPES", "TRL_VERSION"]

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
    # the loss in the inputs' promoted float type (TRL's torch arithmetic), at least float32
    dtype = torch.float64 if torch.float64 in [t.dtype for t in (
        per_token_logps, old, advantages, ref_per_token_logps, importance_sampling_ratio)
        if isinstance(t, Tensor)] else torch.float32
    if weights is not None:  # TRL's masks come as the completion mask's (integer) type
        weights = weights.expand(B, T) if weights.is_floating_point() else \
            weights.to(dtype).expand(B, T)
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
    if loss_type in _CLIPPED:
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
    """Put before `trl.GRPOTrainer` in a subclass (`class T(GRPOTrainerMixin, trl.GRPOTrainer)`):
    its `_compute_loss` is TRL 1.16.0's with the loss, the KL term and the clip metrics on
    rl_triton (`grpo_loss`); the rest of the method (log-probabilities, masks, entropy bonus,
    auxiliary loss, metric reduction over processes) follows TRL's code line for line. A mixin
    rather than a class built from `trl.GRPOTrainer`, so that it goes on any GRPOTrainer subclass
    and importing this module needs no TRL."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import trl
        if trl.__version__ != TRL_VERSION:
            import warnings
            warnings.warn(f"rl_triton's GRPOTrainerMixin reproduces TRL {TRL_VERSION}'s "
                          f"GRPOTrainer._compute_loss; TRL {trl.__version__} is installed",
                          stacklevel=2)

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else \
            completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in _MODEL_INPUTS})
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask,
                                                      1 - self.top_entropy_quantile)
        advantages = inputs["advantages"]
        adv2 = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old = inputs.get("old_per_token_logps")
        off_policy_mask = None
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps",
                                  per_token_logps.detach() if old is None else old)
            off_policy_mask = self.get_off_policy_mask(
                advantages=adv2, per_token_logps=per_token_logps,
                sampling_per_token_logps=sampling, mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold)
        args = self.args
        if self.loss_type == "vespo":
            is_ratio = inputs.get("importance_sampling_ratio")
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
        else:
            is_ratio = None
        mode = "train" if self.model.training else "eval"
        train = mode == "train"
        ga = self.current_gradient_accumulation_steps if train else 1
        loss, metrics = grpo_loss(
            per_token_logps, old, advantages, mask, loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            epsilon=self.epsilon_low, epsilon_high=self.epsilon_high, delta=args.delta,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
            beta=self.beta, ref_per_token_logps=inputs.get("ref_per_token_logps"),
            use_bias_correction_kl=args.use_bias_correction_kl,
            importance_sampling_ratio=is_ratio, off_policy_mask=off_policy_mask,
            entropy_mask=entropy_mask, max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes, gradient_accumulation_steps=ga,
            steps_per_generation=args.steps_per_generation if train else 1)
        divided = self.loss_type not in ("cispo", "dapo", "vespo")
        policy_loss = loss.detach() * ga if divided else loss.detach()

        if self._entropy_bonus_enabled:  # TRL's entropy bonus and its adaptive controller
            effective_mask = mask if entropy_mask is None else mask * entropy_mask
            entropy_loss = ((entropies * effective_mask).sum()
                            / effective_mask.sum().clamp(min=1.0) / ga)
            if self.use_adaptive_entropy:
                apply_coef = self.entropy_coef if \
                    self._last_world_entropy <= args.entropy_target else 0.0
            else:
                apply_coef = self.entropy_coef
            loss = loss - apply_coef * entropy_loss
            self._metrics[mode]["policy_loss"].append(
                self.accelerator.gather(policy_loss).nanmean().item())
            if self.use_adaptive_entropy and train:
                stats = torch.stack([(entropies * effective_mask).sum(),
                                     effective_mask.sum()]).detach()
                self._entropy_window_stats = stats if self._entropy_window_stats is None \
                    else self._entropy_window_stats + stats
                if self.accelerator.sync_gradients:
                    window = self.accelerator.reduce(self._entropy_window_stats,
                                                     reduction="sum")
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
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / ga
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss).mean().item())

        # the metrics: rl_triton's local means, reduced over processes as TRL's
        # global_masked_mean (sum and count); TRL's [B, 1] values count sequences
        n_tokens = mask.sum().float()
        rows = torch.tensor(float(mask.shape[0]), device=mask.device)
        seq_flags = self.importance_sampling_level == "sequence" and advantages.dim() == 1

        def log_mean(name, value, count):
            totals = self.accelerator.reduce(torch.stack([value.float() * count, count]),
                                             reduction="sum")
            self._metrics[mode][name].append((totals[0] / totals[1].clamp(min=1.0)).item())

        if self.beta != 0.0:
            log_mean("kl", metrics["kl"], n_tokens)
        ent = (entropies * mask).sum()
        totals = self.accelerator.reduce(torch.stack([ent, n_tokens]), reduction="sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        if self.loss_type in _CLIPPED:
            for name in ("clip_ratio/low_mean", "clip_ratio/high_mean",
                         "clip_ratio/region_mean"):
                log_mean(name, metrics[name], rows if seq_flags else n_tokens)
            new = per_token_logps.detach()
            lo, hi = _clipped_per_sequence(new, new if old is None else old.detach(),
                                           advantages, mask != 0,
                                           self.importance_sampling_level, self.epsilon_low,
                                           self.epsilon_high, args.delta, _metric_dtype(new))
            self._metrics[mode]["clip_ratio/low_min"].append(
                _nan_extreme(self.accelerator.gather(lo), torch.min).item())
            self._metrics[mode]["clip_ratio/high_max"].append(
                _nan_extreme(self.accelerator.gather(hi), torch.max).item())
        elif self.loss_type == "cispo":
            log_mean("cispo_clip_ratio", metrics["cispo_clip_ratio"],
                     rows if seq_flags else n_tokens)
        elif self.loss_type == "vespo":
            log_mean("vespo/phi_seq_mean", metrics["vespo/phi_seq_mean"],
                     rows if advantages.dim() == 1 else n_tokens)
        return loss


# the multimodal inputs `_compute_loss` hands to the model, as TRL 1.16.0 does
_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                 "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                 "mm_token_type_ids", "image_position_ids")


def _metric_dtype(x):
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def __getattr__(name):
    # `GRPOTrainer`, built on first use so that importing this module does not import TRL
    if name == "GRPOTrainer":
        import trl
        cls = type("GRPOTrainer", (GRPOTrainerMixin, trl.GRPOTrainer), {
            "__module__": __name__,
            "__doc__": "trl.GRPOTrainer with its loss on rl_triton (GRPOTrainerMixin)."})
        globals()["GRPOTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
