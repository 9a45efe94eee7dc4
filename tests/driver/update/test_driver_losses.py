"""driver.update.losses against float64 oracles written as explicit loops over sequences and tokens.

The policy-loss oracle runs its loop on 0-d float64 tensors with Python branches for min and clamp,
so autograd gives an independent gradient to compare with.
"""

import math
from dataclasses import replace

import pytest
import torch

from driver.update.losses import (StepNormalizers, all_zero, connected_zero, importance_weights,
                                  off_policy_sequence_mask, policy_loss)

T = 7
LENGTHS = (7, 3, 5, 1, 6, 0, 4, 2)  # unequal, one empty completion
MICRO_BATCHES = ((0, 3), (3, 6), (6, 8))  # sizes 3 / 3 / 2
EQUAL_TOKEN_LENGTHS = (7, 3, 2, 5, 4, 3, 6, 6)  # 12 tokens in each of MICRO_BATCHES
ADVANTAGES = (0.8, -0.6, 1.3, -1.1, 0.0, 0.5, -0.9, 1.7)  # both signs, one zero
MAX_COMPLETION_LENGTH = 9  # the sampling limit, longer than this batch's T
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
# (dtype, atol, rtol) against the float64 oracle fed the same (rounded) inputs
TOLERANCES = [(torch.float32, 1e-5, 1e-5), (torch.float64, 1e-12, 1e-12)]
CONFIGS = {
    "symmetric_clip": dict(epsilon_low=0.2, epsilon_high=0.2, beta=0.0, use_ref=False, use_is=False),
    "clip_higher_kl_is": dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.04, use_ref=True, use_is=True),
    "ref_without_beta": dict(epsilon_low=0.15, epsilon_high=0.3, beta=0.0, use_ref=True, use_is=False),
}


def make_batch(lengths=LENGTHS, dtype=torch.float64, seed=0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    num_sequences = len(lengths)
    real = torch.arange(T) < torch.tensor(lengths).unsqueeze(1)

    def noise(scale):
        return scale * torch.randn(num_sequences, T, generator=generator, dtype=torch.float64)

    old_logps = -3 * torch.rand(num_sequences, T, generator=generator, dtype=torch.float64) - 0.1
    batch = dict(
        logps=old_logps + noise(0.35),  # wide enough that the clip acts on both sides
        old_logps=old_logps,
        ref_logps=old_logps + noise(0.3),
        advantages=torch.tensor(ADVANTAGES, dtype=torch.float64),
        is_weights=0.25 + 1.5 * torch.rand(num_sequences, T, generator=generator, dtype=torch.float64),
        mask=real.double(),
    )
    # Padding garbage that would overflow exp() if it leaked into the loss or its gradient
    batch["logps"][~real] = 0.0
    batch["old_logps"][~real] = -1e3
    batch["ref_logps"][~real] = 1e3
    batch["is_weights"][~real] = math.nan
    return {name: tensor.to(dtype) for name, tensor in batch.items()}


def oracle_policy_loss(batch, *, loss_type, epsilon_low, epsilon_high, beta, normalizers, use_ref, use_is,
                       keep=None):
    """(loss of this micro-batch as a 0-d tensor, metric values, metric counts) from a float64 leaf copy of
    batch["logps"]. keep: per sequence, TRL's off-policy mask (_compute_loss: per_token_loss * off_policy_mask
    before the importance weight and the KL term, the completion mask and every denominator unchanged)."""
    values = {name: tensor.double().tolist() for name, tensor in batch.items() if name != "logps"}
    logps = batch["logps"]
    loss_sum, sequence_means, num_tokens = 0.0, 0.0, 0
    clipped_low = clipped_high = 0
    low_fractions, high_fractions = [], []
    kl_sum = 0.0
    for i, advantage in enumerate(values["advantages"]):
        sequence_sum, sequence_tokens, sequence_low, sequence_high = 0.0, 0, 0, 0
        for t in range(T):
            if values["mask"][i][t] == 0:
                continue
            ratio = torch.exp(logps[i, t] - values["old_logps"][i][t])
            ratio_value = ratio.item()
            sequence_low += ratio_value < 1 - epsilon_low and advantage < 0
            sequence_high += ratio_value > 1 + epsilon_high and advantage > 0
            clipped_value = min(max(ratio_value, 1 - epsilon_low), 1 + epsilon_high)
            if ratio_value * advantage <= clipped_value * advantage or clipped_value == ratio_value:
                token_loss = -ratio * advantage
            else:  # the clipped term is the minimum and a constant: no gradient through this token
                token_loss = -clipped_value * advantage
            if keep is not None:
                token_loss = token_loss * float(keep[i])
            if use_is:
                token_loss = token_loss * values["is_weights"][i][t]
            if use_ref:
                ref_minus_policy = values["ref_logps"][i][t] - logps[i, t]
                k3 = torch.exp(ref_minus_policy) - ref_minus_policy - 1
                kl_sum += k3.item()
                token_loss = token_loss + beta * k3
            sequence_sum = sequence_sum + token_loss
            sequence_tokens += 1
        loss_sum = loss_sum + sequence_sum
        sequence_means = sequence_means + sequence_sum / max(sequence_tokens, 1)
        num_tokens += sequence_tokens
        clipped_low += sequence_low
        clipped_high += sequence_high
        if sequence_tokens:
            low_fractions.append(sequence_low / sequence_tokens)
            high_fractions.append(sequence_high / sequence_tokens)
    loss = {
        "grpo": sequence_means / normalizers.num_sequences,
        "bnpo": loss_sum / max(num_tokens, 1) / normalizers.num_micro_batches,
        "dr_grpo": loss_sum / (normalizers.num_sequences * normalizers.max_completion_length),
        "dapo": loss_sum / normalizers.num_tokens,
    }[loss_type]
    metrics = {"clip_ratio/low_mean": clipped_low / num_tokens, "clip_ratio/high_mean": clipped_high / num_tokens,
               "clip_ratio/region_mean": (clipped_low + clipped_high) / num_tokens}
    if use_ref:
        metrics["kl"] = kl_sum / num_tokens
    counts = dict.fromkeys(metrics, float(num_tokens))
    metrics["clip_ratio/low_min"] = min(low_fractions)
    metrics["clip_ratio/high_max"] = max(high_fractions)
    return loss, metrics, counts


def call_policy_loss(batch, rows, normalizers, *, loss_type, epsilon_low, epsilon_high, beta, use_ref, use_is,
                     keep=None):
    start, end = rows
    return policy_loss(batch["logps"][start:end], batch["old_logps"][start:end], batch["advantages"][start:end],
                       batch["mask"][start:end], loss_type=loss_type, epsilon_low=epsilon_low,
                       epsilon_high=epsilon_high, beta=beta, normalizers=normalizers,
                       ref_logps=batch["ref_logps"][start:end] if use_ref else None,
                       is_weights=batch["is_weights"][start:end] if use_is else None,
                       keep_sequences=keep[start:end] if keep is not None else None)


def gradient(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, leaf)[0] if loss.requires_grad else torch.zeros_like(leaf)


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_matches_oracle(loss_type, config, dtype, atol, rtol):
    batch = make_batch(dtype=dtype)
    batch["logps"].requires_grad_(True)
    # One micro-batch of a larger step: every normalizer must come from the step, none from the batch
    normalizers = StepNormalizers(num_sequences=13, num_tokens=71, num_micro_batches=3,
                                  max_completion_length=MAX_COMPLETION_LENGTH)
    loss, metrics = call_policy_loss(batch, (0, len(LENGTHS)), normalizers, loss_type=loss_type, **config)

    oracle_batch = dict(batch, logps=batch["logps"].detach().double().requires_grad_(True))
    expected_loss, expected_metrics, expected_counts = oracle_policy_loss(oracle_batch, loss_type=loss_type,
                                                                          normalizers=normalizers, **config)
    assert expected_metrics["clip_ratio/low_mean"] > 0 and expected_metrics["clip_ratio/high_mean"] > 0
    torch.testing.assert_close(loss.double(), expected_loss, atol=atol, rtol=rtol)
    logps_grad = gradient(loss, batch["logps"])
    assert torch.isfinite(logps_grad).all()
    assert (logps_grad[batch["mask"] == 0] == 0).all()
    torch.testing.assert_close(logps_grad.double(), gradient(expected_loss, oracle_batch["logps"]),
                               atol=atol, rtol=rtol)
    torch.testing.assert_close(metrics.values, expected_metrics, atol=atol, rtol=rtol)
    assert metrics.counts == expected_counts


KEEP = (True, False, True, False, True, True, False, True)  # drops rows of both advantage signs and an empty one


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_off_policy_mask_drops_only_the_policy_term(loss_type, config, dtype, atol, rtol):
    """TRL's off-policy mask multiplies the clipped policy term alone: a dropped sequence keeps its KL
    term, and its tokens stay in every denominator (grpo's sequence count, bnpo's token count) and metric."""
    batch = make_batch(dtype=dtype, seed=4)
    batch["logps"].requires_grad_(True)
    keep = torch.tensor(KEEP)
    normalizers = StepNormalizers(num_sequences=11, num_tokens=41, num_micro_batches=2,
                                  max_completion_length=MAX_COMPLETION_LENGTH)
    loss, metrics = call_policy_loss(batch, (0, len(LENGTHS)), normalizers, loss_type=loss_type, keep=keep, **config)
    oracle_batch = dict(batch, logps=batch["logps"].detach().double().requires_grad_(True))
    expected_loss, expected_metrics, expected_counts = oracle_policy_loss(
        oracle_batch, loss_type=loss_type, normalizers=normalizers, keep=KEEP, **config)
    torch.testing.assert_close(loss.double(), expected_loss, atol=atol, rtol=rtol)
    logps_grad = gradient(loss, batch["logps"])
    torch.testing.assert_close(logps_grad.double(), gradient(expected_loss, oracle_batch["logps"]),
                               atol=atol, rtol=rtol)
    torch.testing.assert_close(metrics.values, expected_metrics, atol=atol, rtol=rtol)
    assert metrics.counts == expected_counts
    dropped = logps_grad[1, :LENGTHS[1]]  # row 1: advantage -0.6, dropped
    if config["beta"] > 0:  # its KL term still pulls it towards the reference
        assert dropped.abs().min() > 0
    else:
        assert not dropped.any()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batch_losses_sum_to_the_full_batch_loss(loss_type, config):
    batch = make_batch(seed=1)
    batch["logps"].requires_grad_(True)
    step = dict(num_sequences=len(LENGTHS), num_tokens=sum(LENGTHS), max_completion_length=MAX_COMPLETION_LENGTH)
    full_loss, _ = call_policy_loss(batch, (0, len(LENGTHS)), StepNormalizers(num_micro_batches=1, **step),
                                    loss_type=loss_type, **config)
    split = StepNormalizers(num_micro_batches=len(MICRO_BATCHES), **step)
    summed_loss = sum(call_policy_loss(batch, rows, split, loss_type=loss_type, **config)[0] for rows in MICRO_BATCHES)
    torch.testing.assert_close(summed_loss, full_loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(gradient(summed_loss, batch["logps"]), gradient(full_loss, batch["logps"]),
                               atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_bnpo_is_the_mean_of_micro_batch_token_means(config):
    """bnpo (TRL's definition) depends on the split: it equals the step's token mean only when every
    micro-batch holds the same number of tokens."""
    for lengths, split_is_invisible in ((LENGTHS, False), (EQUAL_TOKEN_LENGTHS, True)):
        batch = make_batch(lengths, seed=2)
        batch["logps"].requires_grad_(True)
        step = dict(num_sequences=len(lengths), num_tokens=sum(lengths), max_completion_length=T)
        split = StepNormalizers(num_micro_batches=len(MICRO_BATCHES), **step)
        summed_loss = sum(call_policy_loss(batch, rows, split, loss_type="bnpo", **config)[0]
                          for rows in MICRO_BATCHES)
        expected = 0.0
        for start, end in MICRO_BATCHES:
            micro_batch = {name: tensor[start:end] for name, tensor in batch.items()}
            micro_batch["logps"] = micro_batch["logps"].detach()
            expected += oracle_policy_loss(micro_batch, loss_type="bnpo", normalizers=split, **config)[0]
        torch.testing.assert_close(summed_loss, torch.as_tensor(expected, dtype=torch.float64),
                                   atol=1e-12, rtol=1e-12)

        full_loss, _ = call_policy_loss(batch, (0, len(lengths)), StepNormalizers(num_micro_batches=1, **step),
                                        loss_type="bnpo", **config)
        assert torch.isclose(summed_loss, full_loss, atol=1e-12, rtol=1e-12) == split_is_invisible
        if split_is_invisible:
            torch.testing.assert_close(gradient(summed_loss, batch["logps"]), gradient(full_loss, batch["logps"]),
                                       atol=1e-12, rtol=1e-12)


ZERO_ROWS_CONFIGS = {name: config for name, config in CONFIGS.items() if config["beta"] == 0}


@pytest.mark.parametrize("config", ZERO_ROWS_CONFIGS.values(), ids=ZERO_ROWS_CONFIGS.keys())
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_removing_zero_advantage_rows_keeps_loss_and_gradient(loss_type, config):
    """The zero-advantage filter's premise: with beta = 0 a row of advantage 0 adds exactly 0, so the
    micro-batch without it gives the same loss and gradient, bnpo once its tokens are counted back."""
    batch = make_batch(seed=3)
    batch["advantages"][[0, 5]] = 0.0  # with ADVANTAGES[4] = 0: three zero rows, two in one micro-batch
    batch["logps"].requires_grad_(True)
    step = StepNormalizers(num_sequences=len(LENGTHS), num_tokens=sum(LENGTHS), num_micro_batches=len(MICRO_BATCHES),
                           max_completion_length=MAX_COMPLETION_LENGTH)
    for start, end in MICRO_BATCHES:
        full_loss, _ = call_policy_loss(batch, (start, end), step, loss_type=loss_type, **config)
        kept = [row for row in range(start, end) if batch["advantages"][row] != 0]
        removed_tokens = sum(LENGTHS[row] for row in range(start, end) if row not in kept)
        kept_batch = {name: tensor[kept] for name, tensor in batch.items()}
        kept_loss, _ = call_policy_loss(kept_batch, (0, len(kept)),
                                        replace(step, micro_batch_filtered_tokens=removed_tokens),
                                        loss_type=loss_type, **config)
        torch.testing.assert_close(kept_loss, full_loss, atol=1e-12, rtol=1e-12)
        full_grad = gradient(full_loss, batch["logps"])
        assert not full_grad[[row for row in range(start, end) if row not in kept]].any()
        torch.testing.assert_close(gradient(kept_loss, batch["logps"])[kept], full_grad[kept], atol=1e-12, rtol=1e-12)


def test_kl_metric_only_with_reference():
    batch = make_batch()
    normalizers = StepNormalizers(num_sequences=8, num_tokens=28, num_micro_batches=1, max_completion_length=T)
    arguments = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0, use_is=False)
    _, without_ref = call_policy_loss(batch, (0, 8), normalizers, use_ref=False, **arguments)
    loss_with_ref, with_ref = call_policy_loss(batch, (0, 8), normalizers, use_ref=True, **arguments)
    assert "kl" not in without_ref.values
    assert with_ref.values["kl"] > 0
    # beta = 0: the reference is measured but does not enter the loss
    torch.testing.assert_close(loss_with_ref, call_policy_loss(batch, (0, 8), normalizers, use_ref=False,
                                                               **arguments)[0], atol=0, rtol=0)


# ---------------------------------------------------------------- importance weights

IS_LENGTHS = (7, 4, 0, 5, 2)
IS_CAP = 2.0


def make_sampling_batch(dtype):
    """(old_logps, sampling_logps, mask) with token ratios and sequence ratios on both sides of IS_CAP."""
    generator = torch.Generator().manual_seed(3)
    real = torch.arange(T) < torch.tensor(IS_LENGTHS).unsqueeze(1)
    old_logps = -3 * torch.rand(len(IS_LENGTHS), T, generator=generator, dtype=torch.float64)
    log_gap = 0.3 * torch.randn(len(IS_LENGTHS), T, generator=generator, dtype=torch.float64)
    log_gap[0, 2] = math.log(3.0)  # one token ratio of 3 > cap
    log_gap[1, :4] = -0.5  # a sequence ratio far below cap
    log_gap[3, :2] = 0.9  # a sequence ratio of ~ e^1.8 > cap
    sampling_logps = old_logps - log_gap
    sampling_logps[~real] = -math.inf  # what an engine may leave there; must not leak
    return old_logps.to(dtype), sampling_logps.to(dtype), real.to(dtype)


def oracle_importance_weights(old_logps, sampling_logps, mask, level, mode, cap):
    old_logps, sampling_logps, mask = old_logps.double().tolist(), sampling_logps.double().tolist(), mask.tolist()
    weights = [[0.0] * T for _ in old_logps]
    ratios, gaps, zeroed, num_tokens = [], [], 0, 0
    for i in range(len(old_logps)):
        tokens = [t for t in range(T) if mask[i][t] > 0]
        sequence_ratio = math.exp(sum(old_logps[i][t] - sampling_logps[i][t] for t in tokens))
        if level == "sequence_product" and tokens:
            ratios.append(sequence_ratio)
        for t in tokens:
            gap = old_logps[i][t] - sampling_logps[i][t]
            ratio = {"token": math.exp(gap), "sequence_product": sequence_ratio, "none": 1.0}[level]
            if level != "sequence_product":
                ratios.append(ratio)
            gaps.append(abs(gap))
            num_tokens += 1
            if level == "none":
                weights[i][t] = 1.0
            elif mode == "truncate":
                weights[i][t] = min(ratio, cap)
            else:
                weights[i][t] = ratio if ratio <= cap else 0.0
                zeroed += ratio > cap
    metrics = {
        "sampling/importance_sampling_ratio/min": min(ratios),
        "sampling/importance_sampling_ratio/mean": sum(ratios) / len(ratios),
        "sampling/importance_sampling_ratio/max": max(ratios),
        "sampling/sampling_logp_difference/mean": sum(gaps) / len(gaps),
        "sampling/sampling_logp_difference/max": max(gaps),
        "sampling/masked_fraction": zeroed / num_tokens,
    }
    counts = {"sampling/importance_sampling_ratio/mean": float(len(ratios)),
              "sampling/sampling_logp_difference/mean": float(num_tokens),
              "sampling/masked_fraction": float(num_tokens)}
    return torch.tensor(weights, dtype=torch.float64), metrics, counts


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence_product", "none"])
def test_importance_weights_match_oracle(level, mode, dtype, atol, rtol):
    old_logps, sampling_logps, mask = make_sampling_batch(dtype)
    old_logps.requires_grad_(True)
    weights, metrics = importance_weights(old_logps, sampling_logps, mask, level=level, mode=mode, cap=IS_CAP)
    expected_weights, expected_metrics, expected_counts = oracle_importance_weights(
        old_logps.detach(), sampling_logps, mask, level, mode, IS_CAP)
    assert not weights.requires_grad
    torch.testing.assert_close(weights.double(), expected_weights, atol=atol, rtol=rtol)
    assert (weights[mask == 0] == 0).all()
    assert (weights[expected_weights == 0] == 0).all()  # masked tokens are exactly 0, not merely small
    torch.testing.assert_close(metrics.values, expected_metrics, atol=atol, rtol=rtol)
    assert metrics.counts == expected_counts
    if level != "none":  # the data exercises the cap
        assert expected_metrics["sampling/importance_sampling_ratio/max"] > IS_CAP
        if mode == "mask":
            assert expected_metrics["sampling/masked_fraction"] > 0
        else:
            assert (expected_weights == IS_CAP).any()


def test_importance_weights_reject_bad_arguments():
    old_logps, sampling_logps, mask = make_sampling_batch(torch.float32)
    good = dict(level="token", mode="mask", cap=2.0)
    for overrides, argument in ((dict(level="tokens"), "level"), (dict(mode="clip"), "mode"), (dict(cap=0.0), "cap")):
        with pytest.raises(ValueError, match=argument):
            importance_weights(old_logps, sampling_logps, mask, **(good | overrides))
    with pytest.raises(ValueError, match="sampling_logps"):
        importance_weights(old_logps, sampling_logps[:, :-1], mask, level="token", mode="mask", cap=2.0)


# ---------------------------------------------------------------- off-policy sequence mask

def test_off_policy_sequence_mask():
    # Per sequence: advantage, constant sampling - policy gap per token (dyadic: exact), length
    cases = [(0.5, 5.0, 3),   # positive advantage: kept whatever the drift
             (-0.5, 0.5, 4),  # negative, mean KL == threshold: kept
             (-0.5, 2.0, 2),  # negative, mean KL > threshold: dropped
             (0.0, 3.0, 5),   # zero advantage counts as non-negative: kept
             (-1.0, 9.0, 0)]  # empty completion: mean KL 0, kept
    mask = (torch.arange(T) < torch.tensor([length for _, _, length in cases]).unsqueeze(1)).float()
    policy_logps = -torch.arange(len(cases) * T, dtype=torch.float32).reshape(len(cases), T) / 4
    sampling_logps = policy_logps + torch.tensor([gap for _, gap, _ in cases]).unsqueeze(1)
    sampling_logps[mask == 0] = 100.0  # padding garbage
    advantages = torch.tensor([advantage for advantage, _, _ in cases])

    keep_expected = []
    for i, (advantage, _, _) in enumerate(cases):
        gaps = [(sampling_logps[i, t] - policy_logps[i, t]).item() for t in range(T) if mask[i, t] > 0]
        mean_kl = sum(gaps) / len(gaps) if gaps else 0.0
        keep_expected.append(advantage >= 0 or mean_kl <= 0.5)
    assert keep_expected == [True, True, False, True, True]

    keep, metrics = off_policy_sequence_mask(advantages, sampling_logps, policy_logps, mask, threshold=0.5)
    assert keep.dtype == torch.bool and keep.tolist() == keep_expected
    assert metrics.values == {"off_policy_mask/dropped_fraction": pytest.approx(1 / 5)}
    assert metrics.counts == {"off_policy_mask/dropped_fraction": 5.0}
    keep, _ = off_policy_sequence_mask(advantages, sampling_logps, policy_logps, mask, threshold=0.25)
    assert keep.tolist() == [True, False, False, True, True]
    keep, metrics = off_policy_sequence_mask(advantages, sampling_logps, policy_logps, mask, threshold=None)
    assert keep.all() and metrics.values["off_policy_mask/dropped_fraction"] == 0.0
    with pytest.raises(ValueError, match="advantages"):
        off_policy_sequence_mask(advantages[:-1], sampling_logps, policy_logps, mask, threshold=0.5)


# ---------------------------------------------------------------- skipped micro-batches

def test_connected_zero_reaches_every_trainable_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)
    half = torch.nn.Parameter(torch.full((83,), 60000.0, dtype=torch.float16))  # its fp16 sum overflows
    parameters = list(model.parameters()) + [half]
    loss = connected_zero(parameters)
    assert loss.dim() == 0 and loss.item() == 0.0
    loss.backward()
    assert model[0].bias.grad is None
    for parameter in parameters:
        if parameter.requires_grad:
            assert parameter.grad is not None
            assert parameter.grad.shape == parameter.shape and (parameter.grad == 0).all()
    with pytest.raises(ValueError, match="parameters"):
        connected_zero([model[0].bias])


def test_all_zero():
    assert all_zero(torch.zeros(9))
    assert all_zero(-torch.zeros(9))
    assert not all_zero(torch.tensor([0.0, 0.0, 1e-30]))
    assert not all_zero(torch.tensor([0.0, math.nan]))


# ---------------------------------------------------------------- argument checks

def policy_loss_arguments(**overrides):
    batch = make_batch(dtype=torch.float32)
    arguments = dict(logps=batch["logps"], old_logps=batch["old_logps"], advantages=batch["advantages"],
                     mask=batch["mask"], loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, beta=0.0,
                     normalizers=StepNormalizers(8, 28, 1, T), ref_logps=None, is_weights=None, keep_sequences=None)
    return arguments | overrides


BAD_POLICY_LOSS_ARGUMENTS = [
    (dict(loss_type="ppo"), "loss_type"),
    (dict(logps=torch.zeros(8 * T)), "logps"),
    (dict(old_logps=torch.zeros(8, T + 1)), "old_logps"),
    (dict(mask=torch.zeros(7, T)), "mask"),
    (dict(advantages=torch.zeros(8, 1)), "advantages"),
    (dict(beta=0.1), "ref_logps"),
    (dict(beta=-0.1), "beta"),
    (dict(epsilon_low=-0.2), "epsilon_low"),
    (dict(ref_logps=torch.zeros(8, 3), beta=0.1), "ref_logps"),
    (dict(is_weights=torch.zeros(8)), "is_weights"),
    (dict(normalizers=StepNormalizers(5, 28, 1, T)), "num_sequences"),
    (dict(keep_sequences=torch.ones(8)), "keep_sequences"),
    (dict(keep_sequences=torch.ones(7, dtype=torch.bool)), "keep_sequences"),
]


@pytest.mark.parametrize("overrides,argument", BAD_POLICY_LOSS_ARGUMENTS,
                         ids=[f"{index}-{arg}" for index, (_, arg) in enumerate(BAD_POLICY_LOSS_ARGUMENTS)])
def test_policy_loss_bad_arguments_name_the_argument(overrides, argument):
    arguments = policy_loss_arguments(**overrides)
    logps, old_logps, advantages, mask = (arguments.pop(name) for name in ("logps", "old_logps", "advantages", "mask"))
    with pytest.raises(ValueError, match=argument):
        policy_loss(logps, old_logps, advantages, mask, **arguments)


@pytest.mark.parametrize("field", ["num_sequences", "num_micro_batches", "max_completion_length", "num_tokens",
                                   "micro_batch_filtered_tokens"])
def test_step_normalizers_reject_bad_counts(field):
    counts = dict(num_sequences=8, num_tokens=28, num_micro_batches=3, max_completion_length=T)
    with pytest.raises(ValueError, match=field):
        StepNormalizers(**(counts | {field: -1}))

