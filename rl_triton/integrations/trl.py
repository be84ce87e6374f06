"""TRL integration: the loss of `GRPOTrainer._compute_loss` (checked against TRL 1.9.0,
`trl/trainer/grpo_trainer.py`), one `rl_triton.policy_loss` call, for every `loss_type` of semantics
§10 ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo") and `importance_sampling_level`
("token", "sequence"), with its KL term (`beta`, `use_bias_correction_kl`), the vLLM
importance-sampling correction (`importance_sampling_ratio`) and the metrics it logs::

    loss, metrics = rl_triton.integrations.trl.grpo_loss(
        per_token_logps, old_per_token_logps, advantages, completion_mask,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, num_items_in_batch=n_tokens)

This is the loss, not a trainer: a `GRPOTrainer` subclass calling it from `_compute_loss` (which
also computes the log-probabilities, the entropy bonus and the auxiliary losses) is not part of
rl_triton. TRL's other loss types ("luspo", "vespo"), the off-policy mask and the entropy mask
are not here (the two masks multiply the per-token loss: pass them inside
`importance_sampling_ratio`). Importing this module does not import TRL.
"""
from __future__ import annotations

import torch

import rl_triton
from ..ops import _losses

__all__ = ["grpo_loss", "LOSS_TYPES"]

Tensor = torch.Tensor
# the rl_triton backend these functions call ("auto": the Triton kernels on CUDA, torch on CPU)
backend = "auto"
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


def grpo_loss(per_token_logps: Tensor, old_per_token_logps, advantages: Tensor, mask: Tensor, *,
              loss_type: str = "dapo", importance_sampling_level: str = "token",
              epsilon: float = 0.2, epsilon_high=None, delta=None,
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              beta: float = 0.0, ref_per_token_logps=None, use_bias_correction_kl: bool = False,
              importance_sampling_ratio=None, max_completion_length=None,
              num_items_in_batch=None, num_processes: int = 1,
              gradient_accumulation_steps: int = 1, sequence_extremes: bool = False):
    """TRL's GRPO loss `[B, T]` -> `(loss, metrics)`, as `GRPOTrainer._compute_loss` returns it
    in training mode (divided by `gradient_accumulation_steps` where TRL divides).

    `old_per_token_logps=None`: the new ones, detached (TRL's single-iteration case);
    `advantages`: `[B]` or `[B, T]`; `mask`: the completion mask (times the tool mask).
    Aggregation by loss type, as TRL: grpo / sapo the mean over all B sequences of each one's
    token mean; bnpo the token mean; dr_grpo the token sum over B * max_completion_length;
    cispo / dapo the token sum over clamp(num_items_in_batch, 1) / num_processes.
    `metrics` (TRL's names, 0-d tensors): "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean" (clipped loss types) or "cispo_clip_ratio", and "kl" where beta != 0;
    with `sequence_extremes` also TRL's "clip_ratio/low_min" and "clip_ratio/high_max" (the
    extremes over sequences of each one's clipped fraction, NaN-ignoring; one process), which
    cost a torch pass over the tokens.
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
    if loss_type == "cispo":
        if not high >= 1.0:
            raise ValueError(f"loss_type='cispo' bounds the ratio above by epsilon_high (TRL's "
                             f"epsilon_max, e.g. 5.0); got epsilon_high={high}, below 1")
        options.update(loss_type="cispo", clip_low=float("inf"), clip_high=float(high) - 1.0)
    elif loss_type == "sapo":
        options.update(loss_type="sapo", tau_pos=float(sapo_temperature_pos),
                       tau_neg=float(sapo_temperature_neg))
    else:
        options.update(loss_type="vanilla", clip_low=float(epsilon), clip_high=float(high),
                       delta=None if delta is None else float(delta))
    if loss_type in ("grpo", "sapo"):
        agg, counts, ga = "seq-mean-token-mean", dict(global_batch_size=B), True
    elif loss_type == "bnpo":
        agg, counts, ga = "token-mean", {}, True
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        agg, counts, ga = "token-mean", dict(batch_num_tokens=B * max_completion_length), True
    else:
        if num_items_in_batch is None:
            raise ValueError(f"loss_type={loss_type!r} needs num_items_in_batch (the global "
                             "number of completion tokens)")
        n = torch.as_tensor(num_items_in_batch, device=per_token_logps.device).clamp(min=1.0)
        agg, counts, ga = "token-mean", dict(batch_num_tokens=n / num_processes), False
    weights = importance_sampling_ratio
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
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
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
            metrics.update(_extremes(per_token_logps.detach(), old.detach(), advantages, m,
                                     level, epsilon, high, delta, dtype))
    elif loss_type == "cispo":
        value = ours["clip_fraction_positive"]
        if level == "sequence" and adv_rows:
            r = _coef(per_token_logps.detach(), old.detach(), m, level)[:, 0]
            value = ((r > high) & (advantages > 0)).to(dtype).mean()
        metrics["cispo_clip_ratio"] = value
    return loss, metrics


def _coef(new, old, m, level):
    """TRL's coef_1: exp of the log-ratio, or of its mean over the sequence ([B, 1])."""
    d = torch.where(m, new - old, 0.0)
    if level == "token":
        return d.exp()
    return (d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).exp()


def _extremes(new, old, advantages, m, level, low, high, delta, dtype):
    """TRL's clip_ratio/low_min and high_max: per sequence the clipped fraction over its tokens
    (its one flag at sequence level with [B] advantages), the NaN-ignoring min / max."""
    r = _coef(new, old, m, level)
    if delta is not None:
        r = r.clamp(max=delta)
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    lo, hi = (r < 1 - low) & (adv < 0), (r > 1 + high) & (adv > 0)

    def per_sequence(flag):
        if flag.shape[1] == 1:
            return flag[:, 0].to(dtype)
        return (flag.to(dtype) * m).sum(-1) / m.sum(-1)  # NaN for an empty sequence, as TRL

    def extreme(x, fn):
        ok = ~torch.isnan(x)
        return fn(x[ok]) if ok.any() else x.new_tensor(float("nan"))

    return {"clip_ratio/low_min": extreme(per_sequence(lo), torch.min),
            "clip_ratio/high_max": extreme(per_sequence(hi), torch.max)}


def _plan_like(agg, m, counts):
    from ..ops.policy_loss import _plan
    return _plan(agg, m, None, tuple(m.shape), 1, counts.get("batch_num_tokens"),
                 counts.get("global_batch_size"), None)


def _scaled(x, factor):
    return x if factor is None else x * factor
