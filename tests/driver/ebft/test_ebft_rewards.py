"""driver.ebft.rewards and driver.ebft.advantages against float64 loops and an eigh whitening oracle."""

import itertools
import math

import pytest
import torch

from driver.ebft.advantages import ebft_advantages
from driver.ebft.rewards import RewardParts, group_rewards, reward_metrics, whiten

NUM_SAMPLES = [1, 2, 3, 5]
NUM_FEATURES = [7, 48]
NUM_PROMPTS = 3
SHAPES = list(itertools.product(NUM_SAMPLES, NUM_FEATURES))  # (n, F)
RLOO_SHAPES = list(itertools.product([2, 3, 5], NUM_FEATURES))  # rloo needs n >= 2
ALIGNMENT_COEF, DIVERSITY_COEF = 0.7, 1.3


def random_tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def oracle_whitening_matrix(gen: torch.Tensor, tol: float) -> torch.Tensor:
    """W = (gen^T gen)^{+1/2} from the eigendecomposition of the F x F second-moment matrix."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gen.T @ gen)
    largest_singular_value = torch.linalg.matrix_norm(gen, ord=2)
    keep = eigenvalues > (tol * largest_singular_value) ** 2
    inverse_root = torch.where(keep, eigenvalues.clamp_min(1e-300).rsqrt(), torch.zeros_like(eigenvalues))
    return eigenvectors @ torch.diag(inverse_root) @ eigenvectors.T


def dot(x: list[float], y: list[float]) -> float:
    return sum(a * b for a, b in zip(x, y))


def cosine(x: list[float], y: list[float]) -> float:
    return dot(x, y) / math.sqrt(dot(x, x) * dot(y, y))


def oracle_rewards(samples: list[list[float]], gt: list[float], alpha: float, beta: float):
    """(alignment, diversity, reward) of one group, written out as loops."""
    n = len(samples)
    alignment = [cosine(sample, gt) for sample in samples]
    diversity = [sum(dot(samples[j], samples[k]) for k in range(n) if k != j) / (n - 1) if n > 1 else 0.0
                 for j in range(n)]
    reward = [2 * alpha * a - 2 * beta * d for a, d in zip(alignment, diversity)]
    return alignment, diversity, reward


@pytest.mark.parametrize("num_samples,num_features", SHAPES)
def test_whitening_equals_the_inverse_square_root_of_the_second_moment_on_both_sides(num_samples, num_features):
    gen, gt = random_tensor(num_samples, num_features, seed=0), random_tensor(num_features, seed=1)
    gen_white, gt_white = whiten(gen, gt)
    weights = oracle_whitening_matrix(gen, 1e-5)
    torch.testing.assert_close(gen_white, gen @ weights, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(gt_white, gt @ weights, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("num_samples,num_features", SHAPES)
def test_whitened_samples_of_full_rank_are_orthonormal(num_samples, num_features):
    gen = random_tensor(num_samples, num_features, seed=2)
    gen_white, gt_white = whiten(gen, random_tensor(num_features, seed=3))
    identity = torch.eye(num_samples, dtype=torch.float64)
    if num_samples <= num_features:
        torch.testing.assert_close(gen_white @ gen_white.T, identity, atol=1e-10, rtol=0)
    # alignments are the components of a unit vector (gt_white lies in the samples' span)
    cosines = torch.nn.functional.cosine_similarity(gen_white, gt_white.unsqueeze(0), dim=-1)
    torch.testing.assert_close(cosines.pow(2).sum(), torch.tensor(1.0, dtype=torch.float64))


def test_duplicate_samples_keep_half_gram_entries_after_whitening():
    first, other = random_tensor(2, 48, seed=4)
    gen_white, _ = whiten(torch.stack([first, first, other]), random_tensor(48, seed=5))
    expected = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(gen_white @ gen_white.T, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("tol,rank", [(1e-5, 2), (1e-2, 1), (1e-9, 3)])
def test_singular_values_below_the_tolerance_are_cut(tol, rank):
    sample_basis, _ = torch.linalg.qr(random_tensor(3, 3, seed=6))
    feature_basis, _ = torch.linalg.qr(random_tensor(7, 3, seed=7))
    singular_values = torch.tensor([1.0, 1e-3, 1e-7], dtype=torch.float64)
    gen = sample_basis @ torch.diag(singular_values) @ feature_basis.T
    gen_white, gt_white = whiten(gen, random_tensor(7, seed=8), tol=tol)
    kept = sample_basis[:, :rank] @ feature_basis[:, :rank].T
    torch.testing.assert_close(gen_white, kept, atol=1e-8, rtol=0)
    torch.testing.assert_close(gt_white @ feature_basis[:, rank:], torch.zeros(3 - rank, dtype=torch.float64))


def test_float32_whitening_matches_float64():
    gen, gt = random_tensor(5, 48, seed=9), random_tensor(48, seed=10)
    gen64, gt64 = whiten(gen, gt)
    gen32, gt32 = whiten(gen.float(), gt.float())
    assert gen32.dtype == gt32.dtype == torch.float32
    torch.testing.assert_close(gen32.double(), gen64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gt32.double(), gt64, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("whitening", [False, True])
@pytest.mark.parametrize("num_samples,num_features", SHAPES)
def test_group_rewards_match_loops_over_each_group(num_samples, num_features, whitening):
    gen = random_tensor(NUM_PROMPTS, num_samples, num_features, seed=11)
    gt = random_tensor(NUM_PROMPTS, num_features, seed=12)
    parts = group_rewards(gen, gt, ALIGNMENT_COEF, DIVERSITY_COEF, whitening=whitening, tol=1e-5)
    for p in range(NUM_PROMPTS):
        samples, target = gen[p], gt[p]
        if whitening:
            weights = oracle_whitening_matrix(samples, 1e-5)
            samples, target = samples @ weights, target @ weights
        alignment, diversity, reward = oracle_rewards(samples.tolist(), target.tolist(),
                                                      ALIGNMENT_COEF, DIVERSITY_COEF)
        oracle = {"alignment": alignment, "diversity": diversity, "reward": reward}
        for name, expected in oracle.items():
            got = getattr(parts, name)
            torch.testing.assert_close(got[p], torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=1e-9,
                                       msg=lambda m, name=name: f"{name}: {m}")
        # CFM on the raw features whatever the whitening
        raw_mean = [sum(gen[p, j, f].item() for j in range(num_samples)) / num_samples for f in range(num_features)]
        cfm = sum((raw_mean[f] - gt[p, f].item()) ** 2 for f in range(num_features))
        assert parts.cfm[p].item() == pytest.approx(cfm, rel=1e-12)


def test_single_sample_groups_have_zero_diversity():
    parts = group_rewards(random_tensor(2, 1, 7, seed=13), random_tensor(2, 7, seed=14), 1.0, 1.0, whitening=False)
    assert torch.equal(parts.diversity, torch.zeros(2, 1, dtype=torch.float64))
    torch.testing.assert_close(parts.reward, 2 * parts.alignment)


def test_metrics_are_batch_means_with_the_factor_two():
    parts = group_rewards(random_tensor(2, 4, 7, seed=15), random_tensor(2, 7, seed=16), 1.0, 0.5, whitening=False)
    metrics = reward_metrics(parts)
    assert set(metrics) == {"ebft/alignment", "ebft/diversity", "ebft/cfm_loss", "ebft/reward"}
    assert metrics["ebft/alignment"] == pytest.approx(2 * parts.alignment.mean().item())
    assert metrics["ebft/diversity"] == pytest.approx(2 * parts.diversity.mean().item())
    assert metrics["ebft/cfm_loss"] == pytest.approx(parts.cfm.mean().item())
    assert metrics["ebft/reward"] == pytest.approx(metrics["ebft/alignment"] - 0.5 * metrics["ebft/diversity"])


@pytest.mark.parametrize("gt_shape", [(2, 8), (3, 7), (7,)])
def test_mismatched_shapes_name_the_tensor(gt_shape):
    with pytest.raises(ValueError, match="gt must have shape"):
        group_rewards(random_tensor(2, 3, 7, seed=17), torch.zeros(gt_shape, dtype=torch.float64), 1.0, 1.0, False)


def oracle_rloo(samples: list[list[float]], gt: list[float], alpha: float, beta: float) -> list[float]:
    """r_j minus the mean reward of the other samples, recomputed on the group without j."""
    _, _, reward = oracle_rewards(samples, gt, alpha, beta)
    advantages = []
    for j in range(len(samples)):
        others = [sample for k, sample in enumerate(samples) if k != j]
        _, _, others_reward = oracle_rewards(others, gt, alpha, beta)
        advantages.append(reward[j] - sum(others_reward) / len(others_reward))
    return advantages


def parts_of(num_samples: int, num_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, RewardParts]:
    gen = random_tensor(NUM_PROMPTS, num_samples, num_features, seed=seed)
    gt = random_tensor(NUM_PROMPTS, num_features, seed=seed + 1)
    return gen, gt, group_rewards(gen, gt, ALIGNMENT_COEF, DIVERSITY_COEF, whitening=False)


@pytest.mark.parametrize("num_samples,num_features", RLOO_SHAPES)
def test_rloo_subtracts_the_mean_reward_of_the_group_recomputed_without_the_sample(num_samples, num_features):
    gen, gt, parts = parts_of(num_samples, num_features, seed=18)
    advantages = ebft_advantages(parts, ALIGNMENT_COEF, DIVERSITY_COEF, "rloo")
    expected = [oracle_rloo(gen[p].tolist(), gt[p].tolist(), ALIGNMENT_COEF, DIVERSITY_COEF)
                for p in range(NUM_PROMPTS)]
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64), atol=1e-10, rtol=1e-10)


def test_rloo_of_pairs_compares_alignments_and_keeps_the_shared_diversity():
    _, _, parts = parts_of(2, 7, seed=20)
    a, d = parts.alignment, parts.diversity
    torch.testing.assert_close(d[:, 0], d[:, 1])  # phi_1 . phi_2 seen from either side
    expected = 2 * ALIGNMENT_COEF * (a - a.flip(1)) - 2 * DIVERSITY_COEF * d
    torch.testing.assert_close(ebft_advantages(parts, ALIGNMENT_COEF, DIVERSITY_COEF, "rloo"), expected)


@pytest.mark.parametrize("num_samples", [2, 3, 5])
def test_rloo_advantages_sum_to_zero_without_diversity(num_samples):
    gen, gt, _ = parts_of(num_samples, 7, seed=21)
    parts = group_rewards(gen, gt, ALIGNMENT_COEF, 0.0, whitening=False)
    advantages = ebft_advantages(parts, ALIGNMENT_COEF, 0.0, "rloo")
    torch.testing.assert_close(advantages.sum(dim=1), torch.zeros(NUM_PROMPTS, dtype=torch.float64), atol=1e-12, rtol=0)


def test_rloo_rejects_single_sample_groups():
    _, _, parts = parts_of(1, 7, seed=22)
    with pytest.raises(ValueError, match="reinforce"):
        ebft_advantages(parts, ALIGNMENT_COEF, DIVERSITY_COEF, "rloo")


@pytest.mark.parametrize("num_samples", NUM_SAMPLES)
def test_group_norm_divides_the_centred_reward_by_the_unbiased_std(num_samples):
    _, _, parts = parts_of(num_samples, 7, seed=23)
    advantages = ebft_advantages(parts, ALIGNMENT_COEF, DIVERSITY_COEF, "group_norm", eps=1e-8)
    for p, rewards in enumerate(parts.reward.tolist()):
        mean = sum(rewards) / num_samples
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (num_samples - 1)) if num_samples > 1 else 0.0
        expected = [(r - mean) / (std + 1e-8) for r in rewards]
        torch.testing.assert_close(advantages[p], torch.tensor(expected, dtype=torch.float64), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("num_samples", NUM_SAMPLES)
def test_group_norm_defaults_to_grpo_eps(num_samples):
    _, _, parts = parts_of(num_samples, 7, seed=26)
    advantages = ebft_advantages(parts, ALIGNMENT_COEF, DIVERSITY_COEF, "group_norm")
    for p, rewards in enumerate(parts.reward.tolist()):
        mean = sum(rewards) / num_samples
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (num_samples - 1)) if num_samples > 1 else 0.0
        expected = [(r - mean) / (std + 1e-4) for r in rewards]
        torch.testing.assert_close(advantages[p], torch.tensor(expected, dtype=torch.float64), atol=1e-10, rtol=1e-10)


def constant_parts(rewards: torch.Tensor) -> RewardParts:
    return RewardParts(alignment=rewards, diversity=torch.zeros_like(rewards), reward=rewards,
                       cfm=torch.zeros(rewards.shape[0], dtype=rewards.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_samples", [2, 3, 5, 8])
def test_group_norm_of_a_constant_group_is_exactly_zero(num_samples, dtype):
    # 0.1, 0.45 and 1/3 do not survive a float mean exactly: plain centring leaves ~1e-8 (float32)
    rewards = torch.tensor([[0.1], [0.45], [1 / 3]], dtype=dtype).expand(3, num_samples).contiguous()
    advantages = ebft_advantages(constant_parts(rewards), ALIGNMENT_COEF, DIVERSITY_COEF, "group_norm")
    assert (advantages == 0).all(), advantages


@pytest.mark.parametrize("num_samples", [2, 3, 5, 8])
def test_group_norm_keeps_float_noise_small(num_samples):
    """Rewards equal up to float32-feature noise (~1e-7) carry no signal: with eps = 1e-8 that noise
    became advantages of order 1; with GRPO's 1e-4 it stays of order noise / 1e-4."""
    noise = 1e-7 * random_tensor(NUM_PROMPTS, num_samples, seed=27)
    rewards = 0.7 + noise
    advantages = ebft_advantages(constant_parts(rewards), ALIGNMENT_COEF, DIVERSITY_COEF, "group_norm")
    centered = noise - noise.mean(dim=1, keepdim=True)
    expected = centered / (noise.std(dim=1, keepdim=True) + 1e-4)  # the oracle: GRPO's formula
    torch.testing.assert_close(advantages, expected, atol=1e-9, rtol=1e-6)
    assert advantages.abs().max() < 1e-2


@pytest.mark.parametrize("num_samples", NUM_SAMPLES)
def test_reinforce_uses_the_reward_itself(num_samples):
    _, _, parts = parts_of(num_samples, 7, seed=24)
    assert torch.equal(ebft_advantages(parts, ALIGNMENT_COEF, DIVERSITY_COEF, "reinforce"), parts.reward)


def test_an_unknown_estimator_is_rejected_listing_the_choices():
    _, _, parts = parts_of(3, 7, seed=25)
    with pytest.raises(ValueError, match="rloo.*group_norm.*reinforce"):
        ebft_advantages(parts, ALIGNMENT_COEF, DIVERSITY_COEF, "ppo")
