"""Under torchrun, the work rank 0's assembly needs from the sharded model runs in shares on every rank
(EBFT's features, algo.kl_in_reward's passes), EBFT's strided mode samples on every rank (with an adapter or
under full fine-tuning), and vLLM can run colocated in rank 0's process: each compared with one process (gloo on
CPU, the tiny examples); a two-rank run pushes to the Hub.
"""

import pytest

from tests.hub_stand_in import TOKEN, HubStandIn
from tests.torchrun_runs import EBFT, EBFT_STRIDED, adapter, assert_same_weights, metrics, model, train


@pytest.mark.slow
def test_two_processes_score_ebft_features_as_one_process(tmp_path, tiny_vllm_server):
    """Rank 0 scores the groups, and both ranks compute a share of the features (45 sequences a step: 22 and
    23, in 1 and 2 packed forwards of 22, so rank 0 runs a padding forward)."""
    one, two = tmp_path / "one", tmp_path / "two"
    # 5 prompts x 8 samples = 40 rows: 2 micro-batches of 22 rows, one per rank.
    ebft = ["--train.prompts_per_step=5", "--train.micro_batch_size=22", "--algo.num_iterations=1"]
    train(one, tiny_vllm_server, *ebft, example=EBFT)
    train(two, tiny_vllm_server, *ebft, processes=2, example=EBFT)
    rows_one, rows_two = metrics(one), metrics(two)
    assert len(rows_one) == len(rows_two) == 3
    for a, b in zip(rows_one, rows_two):
        for key in ("ebft/cfm_loss", "ebft/alignment", "ebft/diversity", "ebft/reward"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["sync/probe_max_abs_diff"] < 1e-3
    assert_same_weights(adapter(one), adapter(two), atol=1e-3)


@pytest.mark.slow
def test_two_processes_sample_and_train_ebft_strided_as_one_process(tmp_path):
    """Every rank samples, scores and trains whole chunks (6 documents in chunks of 2: rank 0 takes two,
    rank 1 one and a padding chunk); each chunk's generator is seeded by its step, so the blocks are the
    same at any world size, and the ranks' gradients sum to the single-process gradient."""
    one, two = tmp_path / "one", tmp_path / "two"
    strided = ["--train.prompts_per_step=6", "--train.micro_batch_size=16", "--ebft.ce_coef=0.1",
               "--algo.num_iterations=1", "--checkpoint.every=2"]
    train(one, None, *strided, example=EBFT_STRIDED)
    train(two, None, *strided, processes=2, example=EBFT_STRIDED)
    rows_one, rows_two = metrics(one), metrics(two)
    assert len(rows_one) == len(rows_two) == 3
    for a, b in zip(rows_one, rows_two):
        for key in ("ebft/cfm_loss", "ebft/alignment", "ebft/advantages_std", "ebft/advantage_abs_mean",
                    "ebft/ce_loss", "ebft/rl_loss", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key
    assert_same_weights(adapter(one), adapter(two), atol=1e-3)
    resumed = tmp_path / "resumed"  # the checkpoint of 2 ranks, resumed in one process: the same blocks
    train(resumed, None, *strided, f"--checkpoint.resume={two / 'checkpoints' / 'step-000002'}", example=EBFT_STRIDED)
    assert metrics(resumed)[0]["ebft/cfm_loss"] == pytest.approx(rows_two[2]["ebft/cfm_loss"], rel=1e-4)


@pytest.mark.slow
def test_two_processes_train_ebft_strided_with_full_fine_tuning_as_one_process_and_push_it_to_the_hub(tmp_path):
    """model.adapter: none: every weight trains, and the features come from the frozen copy of the base, sharded
    as the policy is (a rank's padding chunk runs its forwards too). Measured: every metric equal to 7 digits.
    The two ranks' run pushes to the Hub (checkpoint.push_to_hub, hub_strategy checkpoint; tests/hub_stand_in.py,
    the Hub cannot be reached here): rank 0 uploads the gathered weights of the checkpoint and of the end, and the
    final checkpoint whole, every rank's optimizer shard in it."""
    one, two = tmp_path / "one", tmp_path / "two"
    strided = ["--train.prompts_per_step=6", "--train.micro_batch_size=16", "--ebft.ce_coef=0.1",
               "--algo.num_iterations=1", "--model.adapter=none", "--train.lr=1e-3"]
    train(one, None, *strided, example=EBFT_STRIDED)
    hub = HubStandIn()
    try:
        train(two, None, *strided, "--checkpoint.push_to_hub=true", "--checkpoint.hub_model_id=me/full",
              "--checkpoint.hub_strategy=checkpoint", "--checkpoint.every=2", processes=2, example=EBFT_STRIDED,
              env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0"})
    finally:
        hub.close()
    rows_one, rows_two = metrics(one), metrics(two)
    assert len(rows_one) == len(rows_two) == 3
    for a, b in zip(rows_one, rows_two):
        for key in ("ebft/cfm_loss", "ebft/alignment", "ebft/ce_loss", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert_same_weights(model(one), model(two), atol=1e-4)
    repository = hub.repos["me/full"]
    assert repository.commits == ["model after step 2", "model after step 3"]
    for name in ("model.safetensors", "config.json"):
        assert repository.files[name] == (two / "model" / name).read_bytes(), name
    assert b"library_name: transformers" in repository.files["README.md"]
    final = two / "checkpoints" / "step-000003"
    uploaded = {name.removeprefix("last-checkpoint/"): content for name, content in repository.files.items()
                if name.startswith("last-checkpoint/")}
    assert {"optimizer/__0_0.distcp", "optimizer/__1_0.distcp", "trainer_state.pt"} <= uploaded.keys()
    assert uploaded == {path.relative_to(final).as_posix(): path.read_bytes() for path in final.rglob("*")
                        if path.is_file()}


@pytest.mark.slow
def test_two_processes_compute_the_kl_in_reward_as_one_process(tmp_path, tiny_vllm_server):
    """algo.kl_in_reward: the policy and reference passes at assembly run in shares on both ranks."""
    one, two = tmp_path / "one", tmp_path / "two"
    kl = ["--algo.kl_in_reward=true", "--algo.beta=0.5", "--train.steps=2", "--algo.num_iterations=1"]
    train(one, tiny_vllm_server, *kl)
    train(two, tiny_vllm_server, *kl, processes=2)
    rows_one, rows_two = metrics(one), metrics(two)
    assert len(rows_one) == len(rows_two) == 2
    assert rows_one[1]["rewards/kl_penalty/mean"] < 0  # the adapter moved: the second step's policy is not the base
    for a, b in zip(rows_one, rows_two):
        for key in ("rewards/kl_penalty/mean", "reward", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-7), key


@pytest.mark.slow
@pytest.mark.parametrize("trained", [["--rollout.weight_sync=adapter"],  # as under torchrun
                                     ["--model.adapter=none", "--train.lr=1e-4"]], ids=["adapter", "full"])
def test_two_processes_train_with_vllm_colocated_on_rank_0(tmp_path, trained):
    """rollout.backend = colocate under torchrun: rank 0 runs the engine in its process (vLLM's engine core
    in a child process of rank 0), as one process does, and serves the adapter gathered from the shards. Full
    fine-tuning: one process pushes its weights into an in-process engine by reference; under torchrun the
    engine runs in a process of its own (an in-process engine's process group would wait for the other ranks)
    and reloads the weights rank 0 wrote from the gathered shards at every sync."""
    one, two = tmp_path / "one", tmp_path / "two"
    colocate = ["--rollout.backend=colocate", "--train.steps=2", *trained]
    train(one, None, *colocate)
    train(two, None, *colocate, processes=2)
    rows_one, rows_two = metrics(one), metrics(two)
    assert len(rows_one) == len(rows_two) == 2
    for a, b in zip(rows_one, rows_two):
        assert a["reward"] == b["reward"]  # rank 0's engine sampled what one process's did
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["sync/probe_max_abs_diff"] < 1e-3
