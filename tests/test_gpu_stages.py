"""The GPU stages (.ci/gpu/, `make gpu-*`) checked on a CPU machine: each stage's dry run gets as
far as its first CUDA call and prints its commands, the CUDA test selection is not empty, and the
wheel bundle's package list, closure and manifest are right (nothing is downloaded)."""

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_DIR = ROOT / ".ci" / "gpu"
STAGES = ["wheels", "kernels", "link_check", "install", "build", "test", "sanitize", "driver_runs", "bench"]


def load(name: str):
    """A stage script as a module (its own `import stage` needs .ci/gpu on sys.path). Appended, not first: the
    scripts' names (kernels, test, build, ...) must not shadow packages for the rest of this test process."""
    if str(GPU_DIR) not in sys.path:
        sys.path.append(str(GPU_DIR))
    spec = importlib.util.spec_from_file_location(f"gpu_stage_{name}", GPU_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run(name: str) -> str:
    result = subprocess.run([sys.executable, str(GPU_DIR / f"{name}.py"), "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"gpu-{name.replace('_', '-')}: dry run ok, wall time" in output, output
    assert "Traceback" not in output, output
    return output


@pytest.mark.parametrize("name", STAGES)
def test_dry_run_prints_the_commands(name):
    output = dry_run(name)
    expected = {
        "wheels": ["pip install --dry-run", "pip download --no-deps", "--python-version 3.12"],
        "install": ["pip install --no-index --find-links", "--no-deps nvidia-cutlass==4.2.0.0"],
        "kernels": ["-DPYKERNELS_KERNEL_OBJECTS_ONLY=ON", "-DPYKERNELS_CUDA_ARCHS=90a", "--build",
                    "would pack the objects into"],
        "link_check": ["cuda-torch-venv", "torch==2.11.0", "-DPYKERNELS_PREBUILT_KERNELS=", "--target _C",
                       "would import pykernels from"],
        "build": ["PYKERNELS_CUDA_ARCHS=", "MAX_JOBS=", "pip install --no-build-isolation", "build_info:",
                  "kernels: "],
        "test": ["-m 'cuda and not slow' -q", "CUDA tests selected:"],
        "sanitize": ["--tool memcheck", "--tool racecheck", "sanitize_ops.py --device cuda", "moe: ran on cpu"],
        "driver_runs": ["driver runs (", "-m driver.train", "tiny-moe-grpo.yaml", "--model.qlora=true",
                   "--rollout.backend=transformers", "--model.device=cuda", "--train.kernels=ours",
                   "--train.kernels=torch", "'--model.path=<shaped model>' --algo.zero_advantage=keep"],
        "bench": ["pytest --benchmark --benchmark-json=", "benchmarks.report", "--markdown", "benchmarks/results/"],
    }[name]
    for text in expected:
        assert text in output, f"{text!r} not in the dry run's output:\n{output}"
    assert "would run: " in output
    if name == "test":
        assert int(output.split("CUDA tests selected: ")[1].split()[0]) > 0


def test_dry_run_from_the_environment():
    result = subprocess.run([sys.executable, str(GPU_DIR / "install.py")], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "DRY_RUN": "1"}, timeout=120)
    assert result.returncode == 0 and "dry run ok" in result.stdout, result.stdout + result.stderr


def test_wheel_requirements_come_from_pyproject_with_their_pins():
    wheels = load("wheels")
    bundle, image = wheels.requirements()
    names = {wheels.requirement_name(req): req for req in bundle}
    assert names["nvidia-cutlass"] == "nvidia-cutlass==4.2.0.0"
    assert names["bitsandbytes"] == "bitsandbytes==0.50.2"
    assert names["pytest"] == "pytest>=8" and names["setuptools"] == "setuptools>=77"
    assert {"peft", "pydantic", "pyyaml", "rich", "hypothesis", "pytest-benchmark", "cmake", "ninja",
            "pybind11", "wheel"} <= names.keys()
    assert not {"torch", "transformers", "ruff", "vllm", "wandb", "mlflow-skinny", "reasoning-gym"} & names.keys()
    assert "pytest-timeout" in names  # lease.sh's per-test limit
    assert [wheels.requirement_name(req) for req in image] == ["torch", "transformers"]
    assert len(names) == len(bundle)


def fake_report(requires: dict[str, list[str]]) -> dict:
    return {"install": [{"metadata": {"name": name, "version": "1.0", "requires_dist": deps}}
                        for name, deps in requires.items()]}


def test_bundle_leaves_out_what_torch_and_transformers_require():
    wheels = load("wheels")
    report = fake_report({
        "torch": ["nvidia-cublas", "setuptools", "sympy"], "nvidia-cublas": [], "sympy": [],
        "transformers": ["numpy", "huggingface-hub"], "huggingface-hub": ["typer", "rich; extra == 'cli'"],
        "typer": ["pydantic>=2"], "pydantic": ["pydantic-core"], "pydantic-core": [], "numpy": [],
        "setuptools": [], "rich": [], "peft": ["numpy", "accelerate"], "accelerate": [],
    })
    pins = wheels.bundle_pins(report, ["setuptools>=77", "pydantic>=2.7", "numpy", "peft>=0.17"])
    # versioned requirements of ours are bundled with what they bring; numpy (unversioned) is the image's
    assert pins == ["accelerate==1.0", "peft==1.0", "pydantic-core==1.0", "pydantic==1.0", "rich==1.0",
                    "setuptools==1.0"]


def test_manifest_sizes_and_hashes(tmp_path):
    wheels = load("wheels")
    files = {"peft-0.21.2-py3-none-any.whl": b"x" * 1000,
             "nvidia_cutlass-4.2.0.0-py3-none-any.whl": b"cutlass headers",
             "torch-2.10.0-3-cp312-cp312-manylinux_2_28_x86_64.whl": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "notes.txt").write_text("not a wheel")
    manifest = wheels.write_manifest(tmp_path)
    assert manifest == json.loads((tmp_path / "MANIFEST.json").read_text())
    assert manifest["count"] == 3 and manifest["total_bytes"] == 1015
    by_name = {wheel["name"]: wheel for wheel in manifest["wheels"]}
    assert by_name["peft"]["size"] == 1000 and by_name["peft"]["version"] == "0.21.2"
    assert by_name["peft"]["sha256"] == hashlib.sha256(b"x" * 1000).hexdigest()
    assert by_name["nvidia-cutlass"]["version"] == "4.2.0.0"
    assert by_name["torch"]["version"] == "2.10.0" and by_name["torch"]["size"] == 0


def test_device_names_and_archs():
    bench, build = load("bench"), load("build")
    stage = sys.modules["stage"]  # the module the scripts import
    assert bench.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.device_slug("NVIDIA H200") == "h200"
    assert bench.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert [build.arch_of(c) for c in [(9, 0), (8, 0), (8, 6), (8, 9)]] == ["90a", "80", "86", "89"]
    with pytest.raises(stage.StageError, match="compute capability 7.5"):
        build.arch_of((7, 5))


def test_extension_loads_the_shared_libstdcxx():
    """The built extension shares torch's libstdc++ (CMakeLists.txt; a static copy segfaulted on an
    H100 image at the first error message): what gpu-build checks, on this machine's build."""
    linkage = load("linkage")
    extensions = sorted((ROOT / "pykernels").glob("_C*.so"))
    assert extensions, "no built extension under pykernels/ (make build)"
    for extension in extensions:
        assert any(name.startswith("libstdc++.so") for name in linkage.needed_libraries(extension)), extension
        assert linkage.static_libstdcxx_problem(extension) is None


def test_static_libstdcxx_is_reported(tmp_path):
    """A C library (libm, loaded by this interpreter) asks for libc, not libstdc++: it is named, with the reason."""
    linkage = load("linkage")
    maps = Path("/proc/self/maps").read_text().split()
    c_only = Path(next(word for word in maps if "/libm.so" in word or "/libm-" in word))
    assert "libc.so.6" in linkage.needed_libraries(c_only)
    assert "pytorch#109923" in linkage.static_libstdcxx_problem(c_only)
    not_elf = tmp_path / "not.so"
    not_elf.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        linkage.needed_libraries(not_elf)


def test_build_stage_fails_an_sm90a_build_without_the_hopper_gemm_core():
    build = load("build")
    ops = {"pykernels::nf4_dequantize": True, "pykernels::lora_linear": True, "pykernels::token_logprobs_forward": True,
           "pykernels::moe_grouped_linear": True}
    info = {"build_info": {"cuda": True, "cuda_archs": ["90a"], "hopper_gemm": True}, "cuda_ops": ops}
    assert not [p for p in build.check_families(info) if "Hopper" in p]
    info["build_info"]["hopper_gemm"] = False
    assert [p for p in build.check_families(info) if "Hopper" in p]
    info["build_info"]["cuda_archs"] = ["80"]
    assert not [p for p in build.check_families(info) if "Hopper" in p]


def test_the_wheels_budget_is_what_a_call_carries_beside_the_checkout(tmp_path):
    """The device tool carries the checkout's files (tracked, and untracked ones git does not ignore) and the
    wheelhouse together, 64 MiB at most: the bundle's budget is what the checkout leaves, less 1 MiB."""
    wheels = load("wheels")
    assert wheels.budget_bytes() == wheels.CARRY_BYTES - wheels.checkout_bytes() - wheels.MARGIN_BYTES
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("wheelhouse/\n")
    (tmp_path / "tracked.py").write_bytes(b"x" * 1000)
    subprocess.run(["git", "add", "tracked.py", ".gitignore"], cwd=tmp_path, check=True)
    (tmp_path / "untracked.md").write_bytes(b"y" * 500)
    (tmp_path / "wheelhouse").mkdir()
    (tmp_path / "wheelhouse" / "big.whl").write_bytes(b"z" * 10_000)  # carried as the call's `carry`, not here
    assert wheels.checkout_bytes(tmp_path) == 1000 + 500 + len("wheelhouse/\n")


def run_lease(tmp_path, stages: str) -> subprocess.CompletedProcess:
    """lease.sh with a python that does not exist: nothing is installed or built here."""
    env = {**os.environ, "OUT": str(tmp_path), "STAGES": stages, "GPU_PYTHON": str(tmp_path / "no-python")}
    return subprocess.run(["bash", str(GPU_DIR / "lease.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_lease_script_refuses_an_unknown_stage(tmp_path):
    result = run_lease(tmp_path, "tests build")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unknown stage tests (build, test, sanitize, driver, bench, breakdown, sweep, profile)" in result.stdout


def test_lease_script_with_no_stage_prints_only_the_summary(tmp_path):
    result = run_lease(tmp_path, "")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "---- stages" in result.stdout and "== " not in result.stdout


def test_lease_script_fails_when_a_stage_fails(tmp_path):
    """The build stage's python does not exist: it fails, and the script says so."""
    result = run_lease(tmp_path, "build")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "build: exit 2" in result.stdout and (tmp_path / "build.log").exists()


def test_lease_script_skips_what_the_deadline_leaves_no_time_for(tmp_path, monkeypatch):
    monkeypatch.setenv("DEADLINE_S", "5")
    result = run_lease(tmp_path, "build test")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "build: skipped, " in result.stdout and "test:" not in result.stdout  # nothing runs without a build
    assert not (tmp_path / "build.log").exists() and "(last lines)" not in result.stdout


def test_lease_script_gives_a_stage_its_limit_and_the_driver_stage_its_arguments(tmp_path):
    """A stage keeps the lease's limit for it less 10 s itself (GPU_STAGE_BUDGET_S, read by .ci/gpu/stage.py), so
    it stops with its table and wall-time line before the lease's timeout kills it (on the 2026-11-29 lease
    the driver stage, limited to 240 s, kept its own 480 s); DRIVER_ARGS reach .ci/gpu/driver_runs.py. Here
    a dry run of one driver run on the CPU under this python."""
    env = {**os.environ, "OUT": str(tmp_path), "STAGES": "driver", "GPU_PYTHON": sys.executable, "DEADLINE_S": "100",
           "DRIVER_ARGS": "--dry-run --device cpu --runs lora --steps 3"}
    result = subprocess.run(["bash", str(GPU_DIR / "lease.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    log = (tmp_path / "driver.log").read_text()
    assert result.returncode == 0, result.stdout + log
    # The limit is what the 100 s deadline leaves once the script is up (a second or two on a loaded machine: CI
    # saw 98); the stage's budget is that limit less 10 s, whatever it was.
    limit = re.search(r"== driver \(limit ([0-9]+) s\)", log)
    budget = re.search(r"gpu-driver-runs: dry run ok, wall time [0-9.]+ s \(budget ([0-9]+) s\)", log)
    assert limit and budget and 90 <= int(limit[1]) <= 100 and int(budget[1]) == int(limit[1]) - 10, log
    assert "driver runs (" in log and ": lora\n" in log and "--train.steps=3" in log


def test_lease_script_benchmarks_judge_one_run_of_the_selected_cases(tmp_path, monkeypatch):
    """The bench stage's command (its python does not exist here): no re-timing, BENCH_K as -k."""
    monkeypatch.setenv("BENCH_FILES", "lora")
    monkeypatch.setenv("BENCH_K", "4096x14336-T8192 and r16")
    run_lease(tmp_path, "bench")
    command = (tmp_path / "bench.log").read_text().splitlines()[0]
    assert "env PYKERNELS_BENCH_RETIME=0 " in command
    assert "benchmarks/test_bench_lora.py -k 4096x14336-T8192 and r16 -q" in command
    monkeypatch.delenv("BENCH_K")
    (tmp_path / "bench.log").unlink()
    run_lease(tmp_path, "bench")
    assert " -k " not in (tmp_path / "bench.log").read_text()


def test_lease_script_packs_more_than_seven_files_into_one(tmp_path):
    """The device tool returns 8 files from a call: more logs and JSONs than 7 come back as one archive."""
    for name in [f"bench-{i}.json" for i in range(5)] + ["build.log", "test.log", "sweep.log"]:
        (tmp_path / name).write_text("{}")
    result = run_lease(tmp_path, "")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lease.tgz"]
    with tarfile.open(tmp_path / "lease.tgz") as archive:
        assert len(archive.getnames()) == 8


def test_tile_sweep_names_what_it_needs(monkeypatch):
    """benchmarks/tile_sweep.py (the lease's sweep stage) refuses unknown tiles or ops by name, and a
    machine without a Hopper GPU in one line, before it builds anything."""
    from benchmarks import tile_sweep

    def refusal(*args):
        monkeypatch.setattr(sys, "argv", ["tile_sweep", *args])
        with pytest.raises(SystemExit) as exited:
            tile_sweep.main()
        return str(exited.value.code)

    assert refusal("--tiles", "128x128,64x128") == "unknown choice 64x128: --tiles takes auto, 128x128, 128x256"
    assert refusal("--logprobs-tiles", "128x256") == "unknown choice 128x256: --logprobs-tiles takes 256x128, 128x128"
    assert refusal("--logprobs-folds", "lazy") == "unknown choice lazy: --logprobs-folds takes running_max, lazy_max"
    assert refusal("--lora-forwards", "cublas,fused") == ("unknown choice fused: --lora-forwards takes extended_k, "
                                                           "cublas, extended_k@128x128, extended_k@128x256")
    assert refusal("--lora-grad-xs", "fused") == "unknown choice fused: --lora-grad-xs takes cublas, extended_k"
    assert refusal("--moe-loras", "fused") == "unknown choice fused: --moe-loras takes extra_k, separate"
    assert refusal("--moe-acts", "fused") == "unknown choice fused: --moe-acts takes separate, epilogue"
    assert refusal("--moe-gathers", "tma") == "unknown choice tma: --moe-gathers takes pass, mainloop"
    assert refusal("--nf4-forwards", "fused") == "unknown choice fused: --nf4-forwards takes dequantize, mainloop"
    assert refusal("--lora-rank-gemms", "tf32") == "unknown choice tf32: --lora-rank-gemms takes tensor_core, simt"
    assert refusal("--rasters", "m1,m3") == "unknown choice m3: --rasters takes m1, m2, m4, m8, n1, n2, n4, n8"
    assert refusal("--denses", "cublas") == "unknown choice cublas: --denses takes array, plain, plain@n1"
    assert refusal("--ops", "moe,mlp") == ("unknown op mlp: moe, lora, logprobs, logprobs_fold, lora_forward, "
                                           "lora_grad_x, lora_rank, raster, dense, moe_lora, moe_act, moe_gather, "
                                           "moe_rank_tile, qlora_forward, nf4_dequant, nf4_chunks")
    assert refusal("--moe-rank-tiles", "64") == "unknown choice 64: --moe-rank-tiles takes wide, narrow"
    assert refusal("--nf4-dequants", "threads") == "unknown choice threads: --nf4-dequants takes warps, units"
    assert refusal("--nf4-chunks", "auto,64") == "unknown choice 64: --nf4-chunks takes auto, 16"
    if not torch.cuda.is_available():
        assert "needs a compute capability 9.0 GPU" in refusal()


# The kernel knobs the sanitizer leaves on their default, and why.
UNSANITIZED_KNOBS = {
    # Its other side (16 MiB chunks) splits W only past 16 MiB; the sanitizer's shapes are one chunk
    # either way, and the CUDA tests run the QLoRA ops at cap 16 over several chunks.
    "PYKERNELS_NF4_CHUNK_MIB",
}


def test_the_sanitizer_runs_every_kernel_knobs_other_side():
    """A knob added to pykernels/dispatch_cache.py KERNEL_KNOBS picks other kernels: compute-sanitizer
    must run them too (.ci/gpu/sanitize_ops.py OTHER_SETTINGS), or this test names why not."""
    from pykernels import dispatch_cache

    sanitized = {variable for variable, _, _ in load("sanitize_ops").OTHER_SETTINGS}
    assert set(dispatch_cache.KERNEL_KNOBS.values()) - UNSANITIZED_KNOBS == sanitized


def run_profile_stage(tmp_path, ncu_script: str) -> tuple[subprocess.CompletedProcess, Path]:
    """lease.sh's profile stage with this python and a stand-in ncu (NCU) running `ncu_script`; returns
    the run and its OUT folder."""
    ncu = tmp_path / "ncu"
    ncu.write_text("#!/bin/sh\n" + ncu_script)
    ncu.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "STAGES": "profile", "GPU_PYTHON": sys.executable, "NCU": str(ncu)}
    return subprocess.run(["bash", str(GPU_DIR / "lease.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120), out


def test_lease_script_profiles_the_targets_under_ncu_and_summarizes_its_csv(tmp_path):
    """The profile stage runs benchmarks/ncu_targets.py under ncu (NCU: a stand-in that records its
    arguments and writes a CSV) and summarizes the CSV (benchmarks/ncu_summary.py) into its log."""
    result, out = run_profile_stage(
        tmp_path, "echo \"$@\" > \"$(dirname \"$0\")/ncu-args\"\n"
                  "printf '\"ID\",\"Kernel Name\",\"Metric Name\",\"Metric Unit\",\"Metric Value\"\\n'\n"
                  "printf '\"0\",\"nvjet_tst\",\"Duration\",\"usecond\",\"12.0\"\\n'\n")
    assert result.returncode == 0, result.stdout + result.stderr
    args = (tmp_path / "ncu-args").read_text()
    assert "--profile-from-start off --clock-control none --csv --page details" in args
    assert args.rstrip().endswith("-m benchmarks.ncu_targets")
    assert "| nvjet_tst | 0.012 |" in (out / "profile.log").read_text()
    assert "---- profile.log" in result.stdout and "profile: exit 0" in result.stdout


def test_lease_scripts_profile_stage_shows_why_ncu_made_no_table(tmp_path):
    """An ncu that cannot read the counters prints its error where the CSV goes: the log shows it."""
    result, out = run_profile_stage(tmp_path, "echo '==ERROR== ERR_NVGPUCTRPERM - no permission to the counters'\n"
                                              "exit 1\n")
    assert result.returncode == 1 and "profile: exit 1" in result.stdout, result.stdout + result.stderr
    log = (out / "profile.log").read_text()
    assert "no ncu CSV in the input" in log and "ERR_NVGPUCTRPERM" in log


def kernel_bundle(tmp_path: Path, key: dict) -> tuple[Path, list[Path]]:
    """A wheelhouse with a bundle of two stand-in objects packed under key, and those objects."""
    kernels = load("kernels")
    build_dir = tmp_path / "build"
    objects = [build_dir / "CMakeFiles" / "k.dir" / name for name in ("a.cu.o", "tile_sm90.cu.o")]
    for index, obj in enumerate(objects):
        obj.parent.mkdir(parents=True, exist_ok=True)
        obj.write_bytes(bytes([index]) * 1000)
    wheelhouse = tmp_path / "wheelhouse"
    kernels.pack(objects, build_dir, key, kernels.bundle_path(wheelhouse, key["archs"]))
    return wheelhouse, objects


def test_prebuilt_kernels_are_unpacked_for_a_build_of_the_same_sources(tmp_path):
    """make gpu-kernels' bundle, read back as gpu-build reads it: every object under the path
    kernel_objects.txt gives it (what CMakeLists.txt's PYKERNELS_PREBUILT_KERNELS links), byte for byte."""
    kernels = load("kernels")
    key = kernels.build_key("90a", ["csrc/moe/moe.h", "csrc/common/grouped_gemm_tile_128x256_sm90.cu",
                                    *kernels.build_files()])
    assert "cmake/sm90_sources.cmake" in key["files"] and None not in key["files"].values()
    assert "csrc/moe/moe_gemm.cu" in key["kernel_sources"]
    wheelhouse, objects = kernel_bundle(tmp_path, key)
    unpacked, how = kernels.prepare(wheelhouse, "90a", tmp_path / "unpacked")
    assert unpacked is not None, how
    assert "linking the 2 prebuilt objects" in how
    listed = (unpacked / kernels.OBJECT_LIST).read_text().split()
    assert listed == ["CMakeFiles/k.dir/a.cu.o", "CMakeFiles/k.dir/tile_sm90.cu.o"]
    assert [(unpacked / name).read_bytes() for name in listed] == [obj.read_bytes() for obj in objects]
    dry, how = kernels.prepare(wheelhouse, "90a", tmp_path / "dry", dry_run=True)
    assert dry == tmp_path / "dry" and "would link" in how and not dry.exists()


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("archs", "80", "built for archs 80, this build has 90a"),
    ("nvcc_release", "12.8", "built for nvcc release 12.8"),
    ("cutlass", "3.9.2", "built for CUTLASS version 3.9.2"),
    ("files", {"csrc/moe/moe.h": "0" * 64}, "built from other sources: csrc/moe/moe.h differ"),
    ("files", {"csrc/moe/gone.cuh": "0" * 64}, "built from other sources: csrc/moe/gone.cuh differ"),
    ("kernel_sources", ["csrc/moe/moe_gemm.cu"], "built from other kernel files: csrc/common/dense_gemm_plain_sm90.cu"),
])
def test_prebuilt_kernels_of_other_sources_or_tools_are_compiled_again(tmp_path, field, value, reason):
    """A bundle compiled from another version of a file its objects include (a header edited, or gone,
    since `make gpu-kernels`), from another set of .cu files, or for other archs, nvcc release or CUTLASS
    headers would link kernels that are not these: gpu-build compiles them, saying why."""
    kernels = load("kernels")
    key = kernels.build_key("90a", ["csrc/moe/moe.h", *kernels.build_files()])
    stale = {**key, field: {**key["files"], **value} if field == "files" else value}
    wheelhouse, _ = kernel_bundle(tmp_path, stale)
    if field == "archs":  # the bundle for another GPU is another file: asked for 90a, there is none
        unpacked, how = kernels.prepare(wheelhouse, "90a", tmp_path / "unpacked")
        assert unpacked is None and "no " in how and "kernels-90a.tar.xz" in how
        kernels.bundle_path(wheelhouse, "80").rename(kernels.bundle_path(wheelhouse, "90a"))
    unpacked, how = kernels.prepare(wheelhouse, "90a", tmp_path / "unpacked")
    assert unpacked is None and reason in how, how
    assert not (tmp_path / "unpacked").exists()


def test_the_objects_sources_are_the_files_ninja_saw_them_include():
    """`ninja -t deps` lists each object's source and every header the compiler read: the bundle tracks
    those under csrc/ (not CUTLASS's, torch's or the system's: the versions cover those), so editing a
    binding or a CPU kernel leaves it usable."""
    kernels = load("kernels")
    deps = "\n".join([
        "CMakeFiles/k.dir/csrc/moe/moe_gemm.cu.o: #deps 4, deps mtime 1 (VALID)",
        f"    {ROOT}/csrc/moe/moe_gemm.cu", f"    {ROOT}/csrc/moe/../common/dtype.h", "    /usr/include/stdio.h",
        f"    {ROOT}/.venv/lib/python3.11/site-packages/cutlass_library/source/include/cutlass/cutlass.h", "",
        "CMakeFiles/k.dir/csrc/nf4/nf4.cu.o: #deps 2, deps mtime 1 (VALID)",
        f"    {ROOT}/csrc/nf4/nf4.cu", f"    {ROOT}/csrc/common/dtype.h"])
    assert kernels.dependencies(deps) == ["csrc/common/dtype.h", "csrc/moe/moe_gemm.cu", "csrc/nf4/nf4.cu"]


def test_a_corrupt_kernel_bundle_is_compiled_around(tmp_path):
    kernels = load("kernels")
    bundle = kernels.bundle_path(tmp_path, "90a")
    bundle.parent.mkdir(parents=True)
    bundle.write_bytes(b"not xz")
    unpacked, how = kernels.prepare(tmp_path, "90a", tmp_path / "unpacked")
    assert unpacked is None and "unreadable" in how


@pytest.mark.skipif(load("kernels").find_nvcc() is None, reason="needs nvcc (CMake's CUDA language)")
def test_kernel_objects_build_lists_every_cuda_source(tmp_path):
    """CMakeLists.txt's PYKERNELS_KERNEL_OBJECTS_ONLY configures (no compile here: ~10 minutes) the
    objects of every .cu file, for the archs asked, with the flags of a CUDA build."""
    kernels = load("kernels")
    result = subprocess.run(kernels.configure_command("90a", tmp_path, Path(sys.executable)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    listed = sorted(Path(line).name for line in (tmp_path / kernels.OBJECT_LIST).read_text().split())
    assert listed == sorted(f"{path.name}.o" for path in (ROOT / "csrc").glob("*/*.cu"))
    ninja = (tmp_path / "build.ninja").read_text()
    assert "-lineinfo" in ninja and "-DPYKERNELS_SM90A_GEMM" in ninja
    assert "torch" not in ninja.lower()  # the objects do not depend on the node's torch


def driver_rows(rewards, loss=0.5):
    return [{"step": i + 1, "reward": r, "loss": loss, "grad_norm": 1.0, "time/step": 0.2, "time/generation": 0.1,
             "time/update": 0.05 if i >= 2 else 5.0, "memory/update_peak_gib": 1.5} for i, r in enumerate(rewards)]


def test_driver_stage_checks_each_run_and_times_the_speed_runs_after_their_first_calls():
    """.ci/gpu/driver_runs.py's verdict on a run's metrics.jsonl rows: every step there, loss and grad_norm
    finite, the reward of the last 10 steps above the first 10's (EBFT: its feature-matching loss below);
    the speed runs' medians leave out the first two steps (the kernels' first calls: 5 s each here), which the
    table shows apart."""
    driver = load("driver_runs")
    learnt = [0.1] * 10 + [0.5] * 10 + [0.9] * 10
    lora, ebft = driver.RUNS["lora"], driver.RUNS["ebft"]
    problems, row = driver.check_run(driver_rows(learnt), 30, lora)
    assert problems == [] and (row["first"], row["last"]) == (0.1, 0.9)
    problems, _ = driver.check_run(driver_rows(learnt[::-1]), 30, lora)
    assert problems == ["did not learn: mean reward 0.900 over the first 10 steps, 0.100 over the last"]
    falling = [{**row, "ebft/cfm_loss": row["reward"]} for row in driver_rows(learnt[::-1])]
    assert driver.check_run(falling, 30, ebft)[0] == []  # EBFT's feature-matching loss falls
    assert driver.check_run(falling[::-1], 30, ebft)[0] == [
        "did not learn: mean ebft/cfm_loss 0.100 over the first 10 steps, 0.900 over the last"]
    rows = driver_rows(learnt)
    rows[4]["grad_norm"] = float("nan")
    problems, _ = driver.check_run(rows[:-1], 30, lora)
    assert problems == ["29 metrics lines for 30 steps", "step 5: grad_norm not finite ([nan])"]
    _, ours = driver.check_run(driver_rows([0.0] * 8), 8, driver.RUNS["speed-ours"])
    _, torch_run = driver.check_run(driver_rows([0.0] * 8), 8, driver.RUNS["speed-torch"])
    assert ours["time/update"] == 0.05
    torch_run["time/update"] = 0.08
    table = driver.table({"speed-ours": (20.0, ours), "speed-torch": (21.0, torch_run)})
    assert "| speed-ours | 20 | 200.0 | 100.0 | 50.0 | 10.0 | 1.50 | reward 0.000 -> 0.000 |" in table
    assert table.endswith("torch / ours = 1.60x")


def test_driver_stage_names_an_unknown_run():
    result = subprocess.run([sys.executable, str(GPU_DIR / "driver_runs.py"), "--dry-run", "--runs", "lora,lorra"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "gpu-driver-runs: unknown runs lorra (known: lora, qlora," in result.stderr
