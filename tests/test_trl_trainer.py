"""rl_triton.integrations.trl.GRPOTrainer against TRL's own GRPOTrainer (TRL 1.16.0, installed by
tools/install_extras.sh into .ci/frameworks; rl_triton.testing.import_trl) on a tiny randomly
initialized Qwen2 built from a config and a word-level tokenizer built here: nothing downloaded.

One trainer of rl_triton's class, built once; one batch prepared by TRL itself (generation,
rewards, group advantages), then given old / reference / rollout log-probabilities, a tool mask
with a masked span mid-row and a fully masked row. For every loss_type x importance_sampling_level
(and the options that touch the loss: KL with its bias correction, the vLLM ratio, delta, the
off-policy and entropy masks, the entropy bonus, gradient accumulation, eval mode), TRL's
`GRPOTrainer._compute_loss` and ours run on that trainer and batch: the same loss, gradients of
every parameter, logged metrics and entropy-controller state.
"""
import copy
from collections import defaultdict

import pytest
import torch

from rl_triton import testing
from rl_triton.integrations import trl as our_trl

try:
    trl = testing.import_trl()
except ImportError as e:  # CI installs it (tools/install_extras.sh)
    pytest.skip(f"TRL is not importable: {e}", allow_module_level=True)

import rl_triton  # noqa: E402

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
B_GEN, T_MAX = 6, 7  # completions per step (3 prompts x 2 generations), max completion length


def reward(completions, **kwargs):
    # deterministic in the text, different across completions of a prompt
    return [float(sum(map(ord, c)) % 7) / 3.0 for c in completions]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from datasets import Dataset
    import pyarrow as pa
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(62)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1)
    model = Qwen2ForCausalLM(config)
    prompts = [" ".join(f"w{(7 * i + j) % 62 + 2}" for j in range(2 + i % 3)) for i in range(6)]
    # a fingerprint given: datasets 5.2's own (dill) fails on pyarrow's types here
    data = Dataset(pa.table({"prompt": prompts}), fingerprint="tiny-prompts")
    args = trl.GRPOConfig(output_dir=str(tmp_path_factory.mktemp("grpo")),
                          per_device_train_batch_size=B_GEN, num_generations=2,
                          max_completion_length=T_MAX, report_to="none", use_cpu=True,
                          save_strategy="no", max_steps=1, logging_steps=1, seed=0)
    trainer = our_trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
                                  train_dataset=data, processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._prepare_inputs(batch)
    # what TRL logged of this batch (in generation order), before test_train_step adds more
    logged = {"rewards": torch.tensor(list(trainer._logs["rewards"]["reward"])),
              "advantages": torch.tensor(list(trainer._logs["advantages"]))}
    return trainer, dict(inputs, logged=logged)


def test_class():
    assert issubclass(our_trl.GRPOTrainer, trl.GRPOTrainer)
    assert our_trl.GRPOTrainer.__mro__[1] is our_trl.GRPOTrainerMixin
    assert trl.__version__ == our_trl.TRL_VERSION == testing.TRL


def test_advantages_are_group_advantages(setup):
    """TRL's advantages of the prepared batch (scale_rewards="group") are
    rl_triton.group_advantages of its rewards, as docs/llm.md's table says (both as TRL logs
    them, in generation order: the batch itself comes shuffled)."""
    trainer, inputs = setup
    rewards, logged = inputs["logged"]["rewards"], inputs["logged"]["advantages"]
    assert rewards.shape == logged.shape == (B_GEN,)
    want = rl_triton.group_advantages(rewards, group_size=trainer.num_generations, eps=1e-4)
    assert rewards.std() > 0
    torch.testing.assert_close(logged, want, rtol=1e-6, atol=1e-6)
    assert sorted(inputs["advantages"].tolist()) == pytest.approx(sorted(logged.tolist()))


def batch_for(trainer, inputs, seed=0):
    """The prepared batch with old / reference / rollout log-probabilities near the model's (some
    ratios beyond the clips), a tool mask with a masked span mid-row, a fully masked row, and a
    zero advantage where TRL's groups tie."""
    gen = torch.Generator().manual_seed(seed)
    x = {k: v for k, v in inputs.items() if k != "logged"}
    with torch.no_grad():
        ids = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
        att = torch.cat([x["prompt_mask"], x["completion_mask"]], 1)
        lp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att,
                                                        x["completion_ids"].size(1))[0]
    B, T = lp.shape
    x["old_per_token_logps"] = lp + 0.3 * torch.randn(B, T, generator=gen)
    x["ref_per_token_logps"] = lp + 0.2 * torch.randn(B, T, generator=gen)
    x["sampling_per_token_logps"] = lp + 0.4 * torch.randn(B, T, generator=gen)
    x["importance_sampling_ratio"] = (0.3 * torch.randn(B, T, generator=gen)).exp()
    cm = x["completion_mask"].clone()
    cm[0] = 0  # a fully masked row
    x["completion_mask"] = cm
    tool = torch.ones_like(cm)
    tool[1, 2:4] = 0  # a tool-output span mid-row
    x["tool_mask"] = tool
    adv = x["advantages"].clone()
    adv[2] = 0.0
    x["advantages"] = adv
    x["num_items_in_batch"] = (cm * tool).sum()
    return x


STATE = ("entropy_coef", "_entropy_window_stats", "_last_world_entropy")


def run(trainer, inputs, compute_loss):
    """`compute_loss` on the trainer: (loss, gradients, metrics, entropy-controller state); the
    gradients those of the parameters and, as "per_token_logps", of the model's log-probabilities
    (the loss's input)."""
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    model = trainer.model
    model.zero_grad(set_to_none=True)
    seen = []

    def logps_and_entropies(*args, **kwargs):
        out = type(trainer)._get_per_token_logps_and_entropies(trainer, *args, **kwargs)
        out[0].retain_grad()
        seen.append(out[0])
        return out

    trainer._get_per_token_logps_and_entropies = logps_and_entropies
    try:
        loss = compute_loss(trainer, model, inputs)
    finally:
        del trainer._get_per_token_logps_and_entropies
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["per_token_logps"] = seen[0].grad
    metrics = {mode: dict(m) for mode, m in trainer._metrics.items()}
    state = {k: copy.deepcopy(getattr(trainer, k, None)) for k in STATE}
    return loss.detach(), grads, metrics, state


def flat(d, prefix=()):
    """Nested dicts of lists, tensors, numbers (None as NaN) -> {path: float}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix + (k,)))
        elif isinstance(v, (list, tuple, torch.Tensor)):
            vs = v.flatten().tolist() if isinstance(v, torch.Tensor) else v
            out.update({prefix + (k, i): float(x) for i, x in enumerate(vs)})
            out[prefix + (k, "n")] = len(vs)
        else:
            out[prefix + (k,)] = float("nan") if v is None else float(v)
    return out


def check(trainer, inputs, **settings):
    """TRL's `_compute_loss` and ours on `trainer` with `settings` (its attributes, `args.<x>`
    for its config's): loss, gradients, metrics and the entropy controller's state."""
    saved = {}
    for k, v in settings.items():
        obj, name = (trainer.args, k[5:]) if k.startswith("args.") else (trainer, k)
        saved[k] = (obj, name, getattr(obj, name))
        setattr(obj, name, v)
    start = {k: copy.deepcopy(getattr(trainer, k, None)) for k in STATE}
    try:
        want = run(trainer, inputs, trl.GRPOTrainer._compute_loss)
        for k, v in start.items():
            setattr(trainer, k, copy.deepcopy(v))
        got = run(trainer, inputs, our_trl.GRPOTrainerMixin._compute_loss)
    finally:
        for k, v in start.items():
            setattr(trainer, k, v)
        for obj, name, v in saved.values():
            setattr(obj, name, v)
    torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=1e-7)
    assert got[1].keys() == want[1].keys() and want[1]
    # the loss's gradient to float32 rounding; the parameters' through the model's backward,
    # which amplifies those last-bit differences where the terms of a sum cancel (up to 6e-4 of
    # the tensor's largest entry in repeated runs; most stay below 1e-5): to 2e-3 of it
    lp = want[1]["per_token_logps"]
    torch.testing.assert_close(got[1]["per_token_logps"], lp, rtol=1e-6,
                               atol=1e-6 * float(lp.abs().max()))
    for n, g in want[1].items():
        torch.testing.assert_close(got[1][n], g, rtol=1e-5, atol=2e-3 * float(g.abs().max()),
                                   msg=lambda m, n=n: f"{n}: {m}")
    assert flat(got[2]) == pytest.approx(flat(want[2]), rel=1e-5, abs=1e-7, nan_ok=True), \
        (got[2], want[2])
    assert flat(got[3]) == pytest.approx(flat(want[3]), rel=1e-5, abs=1e-7, nan_ok=True), \
        (got[3], want[3])
    return want


def options(loss_type):
    eps_high = 1.2 if loss_type == "cispo" else 0.28  # cispo: TRL's epsilon_high bounds r
    return {"loss_type": loss_type, "epsilon_high": eps_high}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss(setup, loss_type, level):
    trainer, inputs = setup
    x = batch_for(trainer, inputs)
    base = dict(options(loss_type), importance_sampling_level=level)
    want = check(trainer, x, **base)
    clip = {"cispo": "cispo_clip_ratio", "sapo": "entropy",
            "vespo": "vespo/phi_seq_mean"}.get(loss_type, "clip_ratio/high_mean")
    assert clip in want[2]["train"]
    # with a KL term (bias-corrected), the vLLM ratio, gradient accumulation over 3
    check(trainer, x, beta=0.04, **{"args.use_bias_correction_kl": True}, use_vllm=True,
          vllm_importance_sampling_correction=True, current_gradient_accumulation_steps=3,
          **{"args.steps_per_generation": 3}, **base)
    # [B, T] advantages, as TRL's subclasses may give
    y = dict(x, advantages=x["advantages"][:, None] * (1 + 0.1 * torch.arange(T_MAX)))
    check(trainer, y, beta=0.04, **base)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo"])
def test_masks_and_entropy_bonus(setup, loss_type):
    """The off-policy and entropy masks, delta, the static and the adaptive entropy bonus."""
    trainer, inputs = setup
    x = batch_for(trainer, inputs, seed=1)
    base = options(loss_type)
    check(trainer, x, off_policy_mask_threshold=0.05, top_entropy_quantile=0.5, **base)
    if loss_type != "vespo":
        check(trainer, x, **{"args.delta": 1.3}, importance_sampling_level="sequence", **base)
    check(trainer, x, _entropy_bonus_enabled=True, entropy_coef=0.01, **base)
    check(trainer, x, _entropy_bonus_enabled=True, use_adaptive_entropy=True, entropy_coef=0.01,
          _last_world_entropy=0.0, _entropy_window_stats=None,
          **{"args.entropy_target": 10.0, "args.entropy_coef_delta": 0.005,
             "args.entropy_coef_max": 0.1, "args.entropy_coef_min": 0.0}, **base)


def test_eval_mode(setup):
    trainer, inputs = setup
    x = batch_for(trainer, inputs, seed=2)
    trainer.model.eval()
    try:
        for loss_type in ("bnpo", "dapo"):
            check(trainer, x, current_gradient_accumulation_steps=4, **options(loss_type))
    finally:
        trainer.model.train()


def test_train_step(setup):
    """One optimizer step of rl_triton's trainer, end to end: generation, rewards, our loss."""
    trainer, _ = setup
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        out = trainer.train()
    finally:  # the other tests (in whatever order they run) compare on a training-mode model
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_import_does_not_import_trl():
    """Importing the integration (and building the mixin) imports neither TRL nor transformers,
    TRL importable or not."""
    import os
    import subprocess
    import sys

    trl_path = os.path.dirname(os.path.dirname(trl.__file__))
    code = ("import sys; sys.path.append(sys.argv[1]); import rl_triton.integrations.trl as t; "
            "t.GRPOTrainerMixin; assert not {'trl', 'transformers'} & set(sys.modules), "
            "sorted(m for m in sys.modules if m.startswith(('trl', 'transformers')))")
    subprocess.run([sys.executable, "-c", code, trl_path], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
