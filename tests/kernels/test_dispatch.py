"""pykernels.dispatch on CPU: the auto decision with the CPU kernels standing in for CUDA ones
(PYKERNELS_AUTOTUNE_CPU=1), the on-disk cache, and the per-op modes of pykernels.backend."""

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import pykernels
import pykernels.logprobs
import pykernels.lora
import pykernels.moe
import pykernels.nf4
from pykernels import backend, dispatch, dispatch_cache
from pykernels.ops import lora as ops_lora
from pykernels.ops import nf4 as ops_nf4
from pykernels.reference import logprobs as reference_logprobs
from pykernels.reference import lora as reference_lora
from pykernels.reference import moe as reference_moe

CPU = torch.device("cpu")
TOKENS = [(1, 16), (16, 16), (17, 32), (4096, 4096), (5125, 8192)]


class Planted:
    """The compiled ops namespace with some ops replaced (a wrong or failing kernel)."""

    def __init__(self, real, **replaced):
        self._real, self._replaced = real, replaced

    def __getattr__(self, name):
        return self._replaced.get(name) or getattr(self._real, name)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PYKERNELS_CACHE", str(tmp_path))
    monkeypatch.setenv(dispatch.CPU_ENV_VAR, "1")
    dispatch_cache.forget()
    with backend.kernels_mode("auto"):
        yield tmp_path
    dispatch_cache.forget()


@pytest.fixture
def timings(monkeypatch):
    """Counts the timer calls of every decision (a cached choice makes none)."""
    calls = []

    def counting_timer(fn, warmup=1, iters=3):
        calls.append(fn)
        return dispatch.statistics.median([_time(fn) for _ in range(2)])

    monkeypatch.setattr(dispatch, "cpu_timer", counting_timer)
    return calls


def _time(fn):
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _nf4_weight(rows=64, cols=128):
    return pykernels.nf4.quantize(torch.randn(rows, cols))


def _lora_args(tokens=7, in_features=83, out_features=40, r=4):
    return (torch.randn(tokens, in_features), torch.randn(out_features, in_features), torch.randn(r, in_features),
            torch.randn(out_features, r), 2.0)


def _cache_file(tmp_path):
    return json.loads((tmp_path / "dispatch.json").read_text())


# ---------------------------------------------------------------- the core: decide()
def _costed(value, cost, clock):
    def fn(x):
        clock.append(cost)
        return x * value
    return fn


def _clock_timer(clock):
    def timer(fn):
        clock.clear()
        fn()
        return clock[-1]
    return timer


def test_decide_refuses_a_wrong_kernel():
    clock = []
    decision = dispatch.decide("lora", "k", _costed(2.1, 1e-3, clock), _costed(2.0, 1.0, clock), (torch.ones(8),),
                               1e-2, _clock_timer(clock))
    assert decision.choice == "torch" and decision.mismatch and "disagrees" in decision.reason
    assert decision.error == pytest.approx(0.05, rel=1e-3) and decision.ours_ms is None


def test_decide_never_picks_a_slower_kernel_and_picks_a_faster_one():
    clock = []
    args = ("lora", "k")
    slow = dispatch.decide(*args, _costed(2.0, 2.0, clock), _costed(2.0, 1.0, clock), (torch.ones(8),), 1e-3,
                           _clock_timer(clock))
    tie = dispatch.decide(*args, _costed(2.0, 1.0, clock), _costed(2.0, 1.0, clock), (torch.ones(8),), 1e-3,
                          _clock_timer(clock))
    fast = dispatch.decide(*args, _costed(2.0, 0.5, clock), _costed(2.0, 1.0, clock), (torch.ones(8),), 1e-3,
                           _clock_timer(clock))
    assert (slow.choice, tie.choice, fast.choice) == ("torch", "torch", "ours")
    assert fast.ours_ms == 500.0 and fast.torch_ms == 1000.0 and not fast.mismatch


def test_decide_turns_a_failing_kernel_into_torch_but_not_a_bad_input():
    def broken(x):
        raise RuntimeError("no kernel image for sm_120")

    decision = dispatch.decide("moe", "k", broken, torch.neg, (torch.ones(2),), 1e-3, dispatch.cpu_timer)
    assert decision.choice == "torch" and decision.mismatch and "sm_120" in decision.reason
    with pytest.raises(ValueError, match="bad input"):
        dispatch.decide("moe", "k", torch.neg, lambda x: (_ for _ in ()).throw(ValueError("bad input")),
                        (torch.ones(2),), 1e-3, dispatch.cpu_timer)


def test_relative_error_sees_nan_and_shape_mismatch():
    ones = torch.ones(3)
    assert dispatch.relative_error(ones, ones) == 0
    assert dispatch.relative_error(torch.tensor([1.0, float("nan"), 1.0]), ones) == float("inf")
    assert dispatch.relative_error(torch.ones(4), ones) == float("inf")
    assert dispatch.relative_error((ones, ones * 2), (ones, ones * 2.2)) == pytest.approx(0.2 / 2.2)


@pytest.mark.parametrize("tokens, bucket", TOKENS)
def test_token_bucket_is_the_next_power_of_two_from_16(tokens, bucket):
    assert dispatch.token_bucket(tokens) == bucket


# ---------------------------------------------------------------- through the public functions
def test_a_wrong_kernel_is_disabled_for_its_op_only_with_one_warning(monkeypatch, isolated, timings):
    real = ops_nf4.ops
    monkeypatch.setattr(ops_nf4, "ops", Planted(real, nf4_dequantize=lambda *a: real.nf4_dequantize(*a) + 1))
    weight = _nf4_weight()
    with pytest.warns(RuntimeWarning) as caught:
        out = pykernels.nf4.dequantize(weight)
    message = str(caught[0].message)
    assert len(caught) == 1 and "disabling our nf4 kernel" in message
    assert "shape=(64, 128)" in message and "max error" in message and "float32" in message
    torch.testing.assert_close(out, ops_nf4._dequantize_reference(weight, torch.float32), rtol=0, atol=0)
    other = _nf4_weight(32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timed = len(timings)
        torch.testing.assert_close(pykernels.nf4.dequantize(other), ops_nf4._dequantize_reference(other, torch.float32))
        assert len(timings) == timed  # torch from now on, no new check
        pykernels.lora.lora_linear(*_lora_args())  # lora still decided normally: no warning
    decisions = next(iter(_cache_file(isolated)["entries"].values()))
    assert set(decisions["disabled"]) == {"nf4"}
    assert any(key.startswith("lora float32 tokens<=16 in=83 out=40 r=4 dense") for key in decisions["decisions"])


def test_a_call_into_out_decides_on_fresh_outputs(monkeypatch, isolated, timings):
    """Both sides writing into the caller's one buffer would each be compared with itself and a wrong
    kernel would pass: the decision runs into fresh outputs, and the call then fills the buffer."""
    real = ops_nf4.ops
    monkeypatch.setattr(ops_nf4, "ops", Planted(real, nf4_dequantize=lambda *a: real.nf4_dequantize(*a) + 1))
    weight, buffer = _nf4_weight(), torch.zeros(64, 128)
    with pytest.warns(RuntimeWarning, match="disabling our nf4 kernel"):
        assert pykernels.nf4.dequantize(weight, out=buffer) is buffer
    torch.testing.assert_close(buffer, ops_nf4._dequantize_reference(weight, torch.float32), rtol=0, atol=0)


def test_the_chosen_side_runs_the_whole_op_including_backward(monkeypatch):
    real = ops_lora.ops

    def refuse(*args):
        raise AssertionError("our backward must not run after torch was chosen")

    monkeypatch.setattr(ops_lora, "ops", Planted(real, lora_linear=lambda *a: (real.lora_linear(*a)[0] * 2,
                                                                               real.lora_linear(*a)[1]),
                                                 lora_linear_backward=refuse))
    x, weight, lora_A, lora_B, scaling = _lora_args()
    lora_A.requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="disabling our lora kernel"):
        y = pykernels.lora.lora_linear(x, weight, lora_A, lora_B, scaling, dropout=0.1)
    y.sum().backward()
    assert lora_A.grad is not None and lora_A.grad.abs().sum() > 0


def test_the_faster_correct_side_is_chosen_and_a_slow_kernel_is_not(monkeypatch, isolated):
    real = ops_lora.ops
    penalty = []  # simulated seconds: a sleep would lose to a loaded machine's stalls of the torch side

    def slow(*args):
        penalty.append(1.0)
        return real.lora_linear(*args)

    def timer(fn, warmup=1, iters=3):
        penalty.clear()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start + sum(penalty)

    monkeypatch.setattr(dispatch, "cpu_timer", timer)
    monkeypatch.setattr(ops_lora, "ops", Planted(real, lora_linear=slow))
    pykernels.lora.lora_linear(*_lora_args())
    monkeypatch.setattr(ops_lora, "ops", real)
    pykernels.logprobs.token_logprobs(torch.randn(7, 16), torch.randn(1000, 16), torch.randint(0, 1000, (7,)))
    decisions = next(iter(_cache_file(isolated)["entries"].values()))["decisions"]
    (lora,) = [d for k, d in decisions.items() if k.startswith("lora")]
    assert lora["choice"] == "torch" and lora["ours_ms"] > lora["torch_ms"] and not lora["mismatch"]
    (logprobs,) = [d for k, d in decisions.items() if k.startswith("logprobs")]
    assert logprobs["choice"] == ("ours" if logprobs["ours_ms"] < logprobs["torch_ms"] else "torch")


def test_the_cache_survives_a_restart_without_re_timing(isolated, timings):
    pykernels.lora.lora_linear(*_lora_args())
    assert len(timings) == 2
    dispatch_cache.forget()  # what a new process remembers: nothing but the file
    pykernels.lora.lora_linear(*_lora_args(tokens=9))  # same bucket (tokens <= 16)
    assert len(timings) == 2
    script = ("import pykernels.lora, torch\nfrom pykernels import dispatch\n"
              "dispatch.cpu_timer = dispatch.cuda_timer = None  # any timing would fail\n"
              "pykernels.lora.lora_linear(torch.randn(5, 83), torch.randn(40, 83), torch.randn(4, 83), "
              "torch.randn(40, 4), 2.0)\nprint('cached')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ))
    assert result.returncode == 0 and "cached" in result.stdout, result.stderr[-2000:]
    pykernels.lora.lora_linear(*_lora_args(tokens=17))  # a new bucket is decided
    assert len(timings) == 4


# A setting of each kernel knob other than its default (pykernels/dispatch_cache.py KERNEL_KNOBS).
OTHER_KERNELS = {
    "sm90_tile": "128x256", "sm90_logprobs_tile": "128x128", "sm90_raster": "n8", "sm90_dense": "plain",
    "sm90_lora_forward": "cublas", "sm90_lora_grad_x": "extended_k", "lora_rank_gemm": "simt", "nf4_chunk_mib": "16",
    "sm90_nf4_forward": "mainloop",
    "sm90_moe_lora": "separate", "nf4_dequantize": "units", "sm90_logprobs_fold": "lazy_max",
    "sm90_moe_act": "epilogue", "sm90_moe_gather": "mainloop", "moe_rank_tile": "narrow"}


def test_every_kernel_knob_has_another_setting_here():
    assert OTHER_KERNELS.keys() == dispatch_cache.KERNEL_KNOBS.keys()


@pytest.mark.parametrize("change", ["pykernels", "torch", "device", *OTHER_KERNELS])
def test_a_version_or_device_change_invalidates_the_cache(monkeypatch, isolated, timings, change):
    pykernels.lora.lora_linear(*_lora_args())
    assert len(timings) == 2
    if change == "pykernels":
        monkeypatch.setattr(pykernels, "__version__", "99.0")
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "99.0+cpu")
    elif change == "device":
        monkeypatch.setattr(dispatch_cache, "device_name", lambda device: "cpu another")
    else:  # another kernel (or other sizes of one) can change who is faster
        monkeypatch.setenv(dispatch_cache.KERNEL_KNOBS[change], OTHER_KERNELS[change])
    dispatch_cache.forget()
    pykernels.lora.lora_linear(*_lora_args())
    assert len(timings) == 4
    identities = [json.loads(key) for key in _cache_file(isolated)["entries"]]
    assert len(identities) == (2 if change == "device" else 1)  # a device's stale entry is dropped


def test_a_corrupt_cache_is_ignored_with_a_warning_and_rewritten(isolated, timings):
    (isolated / "dispatch.json").write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="ignoring unreadable dispatch cache"):
        pykernels.lora.lora_linear(*_lora_args())
    assert len(timings) == 2 and _cache_file(isolated)["format"] == dispatch_cache.FORMAT


# ---------------------------------------------------------------- modes: torch, ours, parsing
def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))
    return calls


def test_torch_mode_calls_the_torch_path_of_that_op_only(monkeypatch, timings):
    lora_calls = _counting(monkeypatch, reference_lora, "lora_linear")
    logprob_calls = _counting(monkeypatch, reference_logprobs, "token_logprobs")
    moe_calls = _counting(monkeypatch, reference_moe, "experts_forward")
    backend.set_kernels("ours", lora="torch", moe="torch")
    pykernels.lora.lora_linear(*_lora_args())
    pykernels.logprobs.token_logprobs(torch.randn(7, 16), torch.randn(50, 16), torch.randint(0, 50, (7,)))
    top_k_weights, top_k_index = torch.rand(9, 2), torch.randint(0, 4, (9, 2))
    pykernels.moe.experts_forward(torch.randn(9, 8), top_k_index, top_k_weights, torch.randn(4, 12, 8),
                                  torch.randn(4, 8, 6))
    assert (lora_calls, logprob_calls, moe_calls) == (["lora_linear"], [], ["experts_forward"])
    assert timings == []


def test_ours_mode_never_times_or_writes_a_cache(monkeypatch, isolated):
    monkeypatch.setattr(dispatch, "decide", None)  # any decision would fail
    backend.set_kernels("ours")
    pykernels.lora.lora_linear(*_lora_args())
    pykernels.nf4.dequantize(_nf4_weight())
    pykernels.logprobs.token_logprobs(torch.randn(7, 16), torch.randn(50, 16), torch.randint(0, 50, (7,)))
    assert not (isolated / "dispatch.json").exists()


def test_auto_on_cpu_means_ours_without_the_test_hook(monkeypatch, isolated):
    monkeypatch.delenv(dispatch.CPU_ENV_VAR)
    monkeypatch.setattr(dispatch, "decide", None)
    pykernels.lora.lora_linear(*_lora_args())
    assert not (isolated / "dispatch.json").exists()


@pytest.mark.parametrize("spec, expected", [
    ("auto", dict.fromkeys(backend.OPS, "auto")),
    ("reference", dict.fromkeys(backend.OPS, "torch")),
    ("lora=torch, moe=ours", {"lora": "torch", "moe": "ours"}),
    ("ours,logprobs=torch", {**dict.fromkeys(backend.OPS, "ours"), "logprobs": "torch"}),
    ("", {}),
])
def test_the_environment_variable_is_parsed(monkeypatch, spec, expected):
    monkeypatch.setenv(backend.ENV_VAR, spec)
    assert backend.environment_modes() == expected


@pytest.mark.parametrize("spec, message", [
    ("fast", "kernels must be one of .* got 'fast'"),
    ("lorra=torch", "unknown op 'lorra'.*in 'lorra=torch'"),
    ("moe=reference", "op 'moe' must be one of .*got 'reference'"),
])
def test_bad_environment_values_name_the_op_and_value(spec, message):
    with pytest.raises(ValueError, match=f"PYKERNELS_KERNELS: .*{message}"):
        backend.parse(spec)


def test_set_kernels_per_op_and_the_old_api():
    backend.set_kernels(lora="torch")
    assert backend.modes()["lora"] == "torch" and backend.kernels() == "nf4=auto,lora=torch,moe=auto,logprobs=auto"
    with backend.kernels_mode("reference"):
        assert backend.kernels() == "reference" and backend.use_reference()
    assert backend.mode("lora") == "torch" and not backend.use_reference()
    with pytest.raises(ValueError, match="kernels for op 'moe' must be one of"):
        backend.set_kernels(moe="fast")
    with pytest.raises(ValueError, match="unknown op 'attention'"):
        backend.set_kernels(attention="torch")


def test_driver_config_maps_to_per_op_modes(monkeypatch):
    from pydantic import ValidationError

    from driver.config import Config
    from driver.policy.model import kernel_modes

    assert Config().train.kernel_modes() == dict.fromkeys(backend.OPS, "auto")
    reference = Config.model_validate({"train": {"kernels": "reference", "kernel_ops": {"logprobs": "ours"}}})
    assert reference.train.kernel_modes() == {**dict.fromkeys(backend.OPS, "torch"), "logprobs": "ours"}
    monkeypatch.setenv(backend.ENV_VAR, "nf4=ours")
    assert kernel_modes(reference)["nf4"] == "ours"  # the environment wins
    with pytest.raises(ValidationError, match="kernel_ops.lora"):
        Config.model_validate({"train": {"kernel_ops": {"lora": "fast"}}})


# ---------------------------------------------------------------- the torch baseline and the CLI
def test_grouped_mm_baseline_matches_the_reference():
    hidden, experts, inter = 16, 4, 24
    top_k_index = torch.randint(0, experts, (37, 2))
    top_k_index[0, 0] = experts + 1  # another rank's expert: dropped
    args = (torch.randn(37, hidden, dtype=torch.bfloat16), top_k_index, torch.rand(37, 2),
            torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) * 0.2,
            torch.randn(experts, hidden, inter, dtype=torch.bfloat16) * 0.2)
    from pykernels.moe_grouped_mm import experts_forward_grouped_mm

    ours = experts_forward_grouped_mm(*args)
    expected = reference_moe.experts_forward(*args, "silu", {})
    assert dispatch.relative_error(ours, expected) < dispatch.TOLERANCE[torch.bfloat16]


def _model_config(tmp_path, **extra):
    config = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
              "intermediate_size": 64, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_autotune_without_cuda_decides_nothing(isolated, capsys):
    from pykernels import autotune

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert autotune.main([_model_config(isolated), "--tokens", "64"]) == 0
    assert "no CUDA device" in capsys.readouterr().out and not (isolated / "dispatch.json").exists()


def test_autotune_on_cpu_fills_the_cache_for_every_op(isolated):
    from pykernels import autotune

    model = _model_config(isolated, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert autotune.main([model, "--tokens", "40", "--dtype", "float32", "--lora-r", "4", "--qlora",
                          "--device", "cpu"]) == 0
    keys = list(next(iter(_cache_file(isolated)["entries"].values()))["decisions"])
    assert {key.split()[0] for key in keys} == {"nf4", "lora", "moe", "logprobs"}
    assert "moe float32 tokens<=64 experts=4 top_k=2 hidden=32 inter=16 silu dense" in keys


def test_autotune_reads_a_hub_models_config_from_the_cache(isolated, monkeypatch):
    """A Hub id as model.path names it, resolved by the real huggingface_hub offline against a cache laid out as
    it writes one; an id the cache lacks is a clear error, not a traceback."""
    from huggingface_hub import constants

    from pykernels import autotune
    from tests.hub_cache import cache_with

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(isolated / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (isolated / "model").mkdir()
    snapshot = cache_with(isolated / "hub", "acme/tiny-moe", {"main": "d" * 40},
                          model=_model_config(isolated / "model", num_experts=4))["d" * 40]
    assert autotune.read_config("acme/tiny-moe") == json.loads((snapshot / "config.json").read_text())
    with pytest.raises(autotune.UsageError, match=r"acme/other's config.json is not in the Hugging Face cache"):
        autotune.read_config("acme/other")


@pytest.mark.parametrize("argv, message", [
    (["/nonexistent"], "neither a model directory"),
    (["MODEL", "--tokens", "0"], "--tokens must be >= 1"),
    (["MODEL", "--dtype", "int8"], "--dtype must be one of"),
    (["MODEL", "--device", "tpu"], "--device must be cuda"),
])
def test_autotune_bad_arguments_are_clear(isolated, capsys, argv, message):
    from pykernels import autotune

    argv = [_model_config(isolated) if arg == "MODEL" else arg for arg in argv]
    assert autotune.main([*argv, "--tokens", "64"] if "--tokens" not in argv else argv) == 2
    assert message in capsys.readouterr().err
