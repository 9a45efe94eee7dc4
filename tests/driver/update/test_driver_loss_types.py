"""cispo, sapo, luspo, vespo, GSPO's sequence ratio, two-sided clipping, the KL estimators, the entropy
bonus and top_entropy_quantile against TRL's GRPOTrainer._compute_loss, transcribed as its formulas
(one process, one micro-batch, gradient_accumulation_steps 1, where TRL's normalizers are ours), in
float64 with autograd for the gradients."""

import math

import pytest
import torch

from driver.policy.kl import kl_estimate
from driver.update.loss_terms import LossOptions, high_entropy_mask
from driver.update.losses import StepNormalizers, importance_weights, policy_loss
from tests.driver.update.test_driver_losses import LENGTHS, MAX_COMPLETION_LENGTH, make_batch

EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
WHOLE_STEP = ((0, len(LENGTHS)),)  # one micro-batch


def trl_loss(batch, loss_type, level="token", delta=None, epsilon_high=EPSILON_HIGH, beta=0.0, use_is=False,
             entropy=None, entropy_coef=0.0, entropy_mask=None, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0),
             bias_correction_kl=False):
    """TRL's _compute_loss (trl/trainer/grpo_trainer.py, 2026-07) on a float64 leaf copy of logps."""
    logps = batch["logps"].double().clone().requires_grad_(True)
    mask = batch["mask"].double()
    old = torch.where(mask > 0, batch["old_logps"].double(), logps.detach())  # TRL's padding is benign
    advantages = batch["advantages"].double().unsqueeze(1)
    is_ratio = torch.where(mask > 0, batch["is_weights"].double(), 1.0) if use_is else None
    log_ratio = logps - old
    if level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    if beta:
        ref = torch.where(mask > 0, batch["ref_logps"].double(), logps.detach())
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if bias_correction_kl:  # use_bias_correction_kl: the unclipped ratio, before delta's clamp below
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=epsilon_high).detach() * advantages * logps
    elif loss_type in ("grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - EPSILON_LOW, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo[0], sapo[1])
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    elif loss_type == "vespo":
        with torch.no_grad():
            seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            if is_ratio is not None:
                seq_log_ratio += torch.sum(torch.clamp(torch.log(is_ratio), math.log(1e-8), 20.0) * mask, -1,
                                           keepdim=True)
            log_w = torch.clamp(seq_log_ratio, math.log(1e-8), 20.0)
            k = torch.where(advantages >= 0, vespo[0], vespo[2])
            lam = torch.where(advantages >= 0, vespo[1], vespo[3])
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        per_token_loss = -phi * advantages * logps
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if use_is and loss_type != "vespo":
        per_token_loss = per_token_loss * is_ratio
    if beta:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type in ("cispo", "dapo", "vespo"):
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    else:  # luspo with a sequence-level ratio and no IS: per_token_loss is [B, 1]
        loss = (per_token_loss[:, :1] * mask.sum(1, keepdim=True)).mean()
    if entropy_coef:
        effective = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - entropy_coef * (entropy * effective).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    return loss.detach(), logps.grad


def ours(batch, loss_type, level="token", delta=None, epsilon_high=EPSILON_HIGH, beta=0.0, use_is=False,
         entropy=None, entropy_coef=0.0, keep_tokens=None, parts=WHOLE_STEP, kl_estimator="k3",
         bias_correction_kl=False):
    """Our loss summed over the micro-batches `parts` and its gradient wrt logps."""
    logps = batch["logps"].double().clone().requires_grad_(True)
    normalizers = StepNormalizers(num_sequences=len(LENGTHS), num_tokens=int(batch["mask"].sum()),
                                  num_micro_batches=len(parts), max_completion_length=MAX_COMPLETION_LENGTH)
    options = LossOptions(importance_sampling_level=level, delta=delta, kl_estimator=kl_estimator,
                          entropy_coef=entropy_coef, bias_correction_kl=bias_correction_kl)
    total = 0.0
    for start, stop in parts:
        rows = slice(start, stop)
        loss, metrics = policy_loss(
            logps[rows], batch["old_logps"][rows], batch["advantages"][rows], batch["mask"][rows],
            loss_type=loss_type, epsilon_low=EPSILON_LOW, epsilon_high=epsilon_high, beta=beta,
            normalizers=normalizers, ref_logps=batch["ref_logps"][rows] if beta else None,
            is_weights=batch["is_weights"][rows] if use_is else None, options=options,
            entropy=entropy[rows] if entropy is not None else None,
            keep_tokens=keep_tokens[rows] if keep_tokens is not None else None)
        total = total + loss
    total.backward()
    return total.detach(), logps.grad, metrics


CASES = {
    "cispo": dict(loss_type="cispo", epsilon_high=1.3),  # a cap the ratios cross
    "cispo_is": dict(loss_type="cispo", epsilon_high=1.3, use_is=True),
    "sapo": dict(loss_type="sapo"),
    "sapo_is_kl": dict(loss_type="sapo", use_is=True, beta=0.04),
    "vespo": dict(loss_type="vespo"),
    "vespo_is": dict(loss_type="vespo", use_is=True),
    "luspo_gspo": dict(loss_type="luspo", level="sequence"),
    "gspo_dapo": dict(loss_type="dapo", level="sequence"),
    "gspo_grpo_is": dict(loss_type="grpo", level="sequence", use_is=True),
    "two_sided_clip": dict(loss_type="dapo", delta=1.25),
    # use_bias_correction_kl (DeepSeek-V3.2): the KL times the unclipped policy ratio, token or GSPO's sequence one
    "kl_bias_corrected": dict(loss_type="dapo", use_is=True, beta=0.04, bias_correction_kl=True),
    "gspo_kl_bias_corrected": dict(loss_type="grpo", level="sequence", beta=0.04, bias_correction_kl=True),
    "clipped_kl_bias_corrected": dict(loss_type="dapo", delta=1.25, beta=0.04, bias_correction_kl=True),
}


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradient_match_trl(case):
    batch = make_batch(seed=3)
    expected_loss, expected_grad = trl_loss(batch, **CASES[case])
    loss, grad, _ = ours(batch, **CASES[case])
    torch.testing.assert_close(loss, expected_loss, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=1e-10)
    assert grad.abs().sum() > 0  # the case trains something


@pytest.mark.parametrize("case", ["cispo", "sapo", "vespo_is", "luspo_gspo", "gspo_dapo"])
def test_micro_batch_split_leaves_the_step_loss_unchanged(case):
    batch = make_batch(seed=5)
    whole, whole_grad, _ = ours(batch, **CASES[case])
    split, split_grad, _ = ours(batch, **CASES[case], parts=((0, 3), (3, 6), (6, 8)))
    torch.testing.assert_close(split, whole, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(split_grad, whole_grad, atol=1e-12, rtol=1e-10)


def test_two_sided_clip_bounds_the_negative_advantage_ratio():
    """delta caps ratio x A for A < 0: a token whose ratio exploded stops pushing (gradient 0)."""
    batch = make_batch(seed=1)
    batch["advantages"][:] = -1.0
    batch["logps"] = torch.where(batch["mask"] > 0, batch["old_logps"] + 2.0, batch["logps"])  # ratio e^2 > delta
    _, grad, _ = ours(batch, loss_type="dapo", delta=1.5)
    assert grad.abs().max() == 0
    _, unbounded, _ = ours(batch, loss_type="dapo")
    assert unbounded.abs().max() > 0


def test_cispo_and_vespo_log_trl_metrics():
    batch = make_batch(seed=2)
    _, _, metrics = ours(batch, loss_type="cispo", epsilon_high=1.3)
    real = batch["mask"] > 0
    ratio = torch.where(real, batch["logps"] - batch["old_logps"], 0.0).exp()
    clipped = ((ratio > 1.3) & (batch["advantages"].unsqueeze(1) > 0) & real).sum() / real.sum()
    assert metrics.values["cispo_clip_ratio"] == pytest.approx(float(clipped))
    assert "clip_ratio/region_mean" not in metrics.values
    _, _, metrics = ours(batch, loss_type="vespo")
    assert 0 < metrics.values["vespo/phi_seq_mean"]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator):
    logps = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    real = torch.tensor([[True, True, False]])
    log_ratio = (logps - ref)[0, :2]
    expected = {"k1": log_ratio, "k2": log_ratio ** 2 / 2,
                "k3": torch.exp(-log_ratio) + log_ratio - 1}[estimator]
    values = kl_estimate(logps, ref, real, estimator)
    torch.testing.assert_close(values[0, :2], expected)
    assert values[0, 2] == 0


def test_k1_as_the_kl_term_adds_beta_times_the_mean_log_ratio():
    batch = make_batch(seed=4)
    beta = 0.1
    without, _, _ = ours(batch, loss_type="dapo")
    with_k1, _, metrics = ours(batch, loss_type="dapo", beta=beta, kl_estimator="k1")
    real = batch["mask"] > 0
    mean_k1 = (batch["logps"] - batch["ref_logps"])[real].mean()
    torch.testing.assert_close(with_k1 - without, beta * mean_k1)
    assert metrics.values["kl"] == pytest.approx(float(mean_k1))


def test_entropy_bonus_matches_trl_and_reaches_the_entropy():
    batch = make_batch(seed=6)
    generator = torch.Generator().manual_seed(0)
    entropy = torch.rand(len(LENGTHS), batch["mask"].shape[1], generator=generator, dtype=torch.float64) * 3
    expected_loss, expected_grad = trl_loss(batch, "dapo", entropy=entropy, entropy_coef=0.01)
    leaf = entropy.clone().requires_grad_(True)
    loss, grad, _ = ours(batch, "dapo", entropy=leaf, entropy_coef=0.01)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)
    real = batch["mask"] > 0
    torch.testing.assert_close(leaf.grad, torch.where(real, -0.01 / real.sum(), 0.0).double())


def test_top_entropy_quantile_keeps_trls_tokens_and_their_loss():
    batch = make_batch(seed=7)
    generator = torch.Generator().manual_seed(1)
    entropy = torch.rand(len(LENGTHS), batch["mask"].shape[1], generator=generator, dtype=torch.float64)
    real = batch["mask"] > 0
    keep = high_entropy_mask(entropy, real, 0.2)
    threshold = torch.quantile(entropy[real], 0.8)  # TRL's get_high_entropy_mask
    assert torch.equal(keep, (entropy * real >= threshold) & real)
    assert 0 < keep.sum() < real.sum()
    expected_loss, expected_grad = trl_loss(batch, "dapo", entropy_mask=keep.double())
    loss, grad, _ = ours(batch, "dapo", keep_tokens=keep)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)
    assert torch.equal(high_entropy_mask(entropy, real, 1.0), real)
    top_only = high_entropy_mask(entropy, real, 0.0)
    assert top_only.sum() == 1 and entropy[top_only] == entropy[real].max()
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        high_entropy_mask(entropy, real, 1.5)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_two_sided_importance_sampling(mode):
    """TRL's vllm_importance_sampling_clip_min: below cap_min, clamp up (truncate) or drop (mask, IcePop)."""
    old = torch.log(torch.tensor([[0.2, 0.9, 1.5, 4.0]], dtype=torch.float64))
    sampling = torch.zeros_like(old)
    mask = torch.ones_like(old)
    weights, metrics = importance_weights(old, sampling, mask, level="token", mode=mode, cap=2.0, cap_min=0.5)
    expected = [0.5, 0.9, 1.5, 2.0] if mode == "truncate" else [0.0, 0.9, 1.5, 0.0]
    torch.testing.assert_close(weights[0], torch.tensor(expected, dtype=torch.float64))
    if mode == "mask":
        assert metrics.values["sampling/masked_fraction"] == 0.5
    with pytest.raises(ValueError, match="cap_min"):
        importance_weights(old, sampling, mask, level="token", mode=mode, cap=2.0, cap_min=2.0)


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="delta"):
        LossOptions(delta=0.9)
    with pytest.raises(ValueError, match="kl_estimator"):
        LossOptions(kl_estimator="k4")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        LossOptions(importance_sampling_level="sequence_product")
    batch = make_batch()
    with pytest.raises(ValueError, match="entropy is required"):
        ours(batch, "dapo", entropy_coef=0.1)
