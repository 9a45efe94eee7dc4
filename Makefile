# Two commands do everything on a fresh machine (see README):
#   make demo   the main job: GRPO + LoRA on a tiny model with vLLM (examples/tiny-grpo.yaml)
#   make test   set-up, build, the unit and integration tests, lint, and the CUDA compile check when
#               nvcc is present (a few minutes)
# Other targets: test-e2e (the end-to-end tier: real vLLM engines, ~8 min; CI runs it), lint,
# install, build, bench, cuda-check, gpu (on the GPU machine), clean.

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

# Set-up commands write to $(SETUP_LOG), not the terminal (pip's and CMake's output matters only when
# they fail): `$(LOGGED) cmd args` runs cmd, and on failure shows the log's tail and where it is.
SETUP_LOG := $(VENV)/install.log
LOGGED = sh -c '"$$@" >> $(SETUP_LOG) 2>&1 || { tail -n 40 $(SETUP_LOG); echo "failed: $$*"; \
	echo "(whole log: $(SETUP_LOG))"; exit 1; }' --

NATIVE_SOURCES := $(shell find csrc cmake -type f) CMakeLists.txt setup.py
INSTALLED := $(VENV)/.installed
BUILT := $(VENV)/.built

.PHONY: demo test test-fast no-nvcc test-e2e lint install build bench cuda-check gpu clean

DEMO_CONFIG := examples/tiny-grpo.yaml
DEMO_ARGS ?=  # overrides, e.g. make demo DEMO_ARGS="--model.dtype=bfloat16 --train.steps=80"

demo: $(BUILT)
	@$(PY) -m driver.train $(DEMO_CONFIG) $(DEMO_ARGS)

# The end-to-end tier (tests marked slow: each run starts vLLM) is test-e2e; CI runs both. The CUDA
# compile check (nvcc, one compiler process per file) runs beside the mostly single-threaded tests;
# each one's output is shown when it finishes.
CUDA_CHECK_IF_NVCC := $(if $(shell command -v nvcc 2>/dev/null),cuda-check,no-nvcc)

test: $(BUILT) lint
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-fast $(CUDA_CHECK_IF_NVCC)

test-fast: $(BUILT)
	$(PY) -m pytest tests -q -m "not slow"

no-nvcc:
	@echo "nvcc not found: skipping the CUDA compile check"

test-e2e: $(BUILT)
	$(PY) -m pytest tests -q -m slow

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .

install: $(INSTALLED)

# $(INSTALLED): third-party packages only (pyproject's dependencies and the cpu/test/bench extras);
# $(BUILT): the extension, built once on a fresh clone and again when native sources change.
$(INSTALLED): pyproject.toml
	@echo "setting up $(VENV): torch, vLLM for CPU and the other packages (log: $(SETUP_LOG))"
	@$(PYTHON_BOOTSTRAP) -m venv $(VENV)
	@$(LOGGED) $(PIP) install --upgrade pip
	@$(LOGGED) $(PIP) install $(TORCH_SPEC) $(BUILD_DEPS)
	@$(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
		print('\n'.join(p['dependencies'] + [d for e in ('cpu', 'test', 'bench') for d in p['optional-dependencies'][e]]))" \
		> $(VENV)/requirements.txt
	@$(LOGGED) $(PIP) install -r $(VENV)/requirements.txt
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

# Perf gate, one pytest session (README "Benchmarks and the performance gate"): time ours against
# the baselines side by side, print the report, check the floors (re-timing a failed rule once);
# exit 1 on a regression. The results stay in $(BENCH_JSON) for benchmarks.report / benchmarks.gate.
bench: $(BUILT)
	$(PY) -m pytest --benchmark --benchmark-json=$(BENCH_JSON) -q

# Every .cu compiled by nvcc for sm_80 and sm_90a (and the CUDA bindings against torch's headers),
# without a GPU and with a CPU-only torch.
cuda-check: $(INSTALLED)
	$(VENV)/bin/cmake -S . -B $(CUDA_CHECK_DIR) -G Ninja -DPYKERNELS_CUDA_COMPILE_CHECK=ON \
		-DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) > /dev/null
	+$(VENV)/bin/cmake --build $(CUDA_CHECK_DIR)  # "+": ninja shares make's job slots under make test

# On the GPU machine: its image already has torch with CUDA, so build against the interpreter on
# PATH (no venv, no downloads) and run the tests and the GPU benchmarks there.
gpu:
	python -m pip install --no-build-isolation --no-deps -e .
	python -c "import pykernels; info = pykernels.build_info(); print(info); assert info['cuda'], 'no CUDA kernels built'"
	python -m pytest tests -q
	mkdir -p $(BUILD_DIR)
	python -m pytest --benchmark --benchmark-json=$(BENCH_JSON) -q
	python -m benchmarks.report $(BENCH_JSON) --markdown

clean:
	rm -rf $(BUILD_DIR) pykernels/_C*.so *.egg-info $(BUILT)
