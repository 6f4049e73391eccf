# Two commands on a fresh machine: `make demo` and `make test`. Each does its own setup.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
DEFAULT_MODEL := smollm2-135m

.PHONY: setup demo test test-gpu test-portability model cpu-kernels peers bench-quick clean-venv wheel

setup: $(INSTALLED) model cpu-kernels

# Re-run the install only when the dependency list changes.
$(INSTALLED): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -e '.[notebook,serve,dev,ray]'
	touch $(INSTALLED)

model: $(INSTALLED)
	$(PY) -m minivllm models pull $(DEFAULT_MODEL) --quiet

# The compiled float32 CPU kernels (minivllm/kernels/cpu_gemv.cpp), built once into torch's
# extension cache (~40 s on two cores) so the first test does not pay for it; without g++
# or AVX2 this prints why and the pure-torch float32 path runs instead.
cpu-kernels: $(INSTALLED)
	$(PY) -c "from minivllm.kernels import cpu_gemv as c; print('cpu kernels:', c.isa() or c.unavailable_reason())"

demo: setup
	$(PY) -m minivllm generate --model $(DEFAULT_MODEL) --max-tokens 64 "The three most useful things to know about GPUs are"
	$(PY) -m minivllm generate --model $(DEFAULT_MODEL) --chat --max-tokens 96 "Explain what a KV cache is in two sentences."

# ruff's configuration is [tool.ruff] in pyproject.toml; it lints before any test runs.
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# The suite as other machines run it: under `taskset -c 0`, with one OpenMP thread, and the
# numerics tests under each other CPU kernel path torch offers here (ATEN_CPU_CAPABILITY).
# About 3x `make test`; pick variants with VARIANTS="one-core omp-1 cpu-avx2 cpu-default".
VARIANTS ?=
test-portability: setup
	bash scripts/test_portability.sh $(PY) $(VARIANTS)

# dist/minivllm-<version>-py3-none-any.whl with minivllm_widgets inside (what Kaggle users
# attach as a dataset; README "On Kaggle"). A pure-Python wheel needs only setuptools and
# wheel: they live in their own small venv (.venv-build, ~20 s the first time), never torch.
BUILD_VENV := .venv-build
wheel:
	test -x $(BUILD_VENV)/bin/python || $(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/python -m pip install -q 'setuptools>=68' wheel
	rm -rf build dist/minivllm-*.whl
	$(BUILD_VENV)/bin/python -m pip wheel --no-deps --no-build-isolation -q -w dist .
	@ls dist/minivllm-*.whl

# On a machine with an NVIDIA GPU: only the CUDA tests.
test-gpu: setup
	$(PY) -m pytest -q -m cuda

# The peers of `minivllm bench peers` / `bench serve --start-peer`: llama-cpp-python built
# here from its sdist, with its server's extra. About 7 minutes on two cores; the wheel is
# kept for next time. The CPU features are spelled out instead of GGML_NATIVE=ON: a native
# build on these VMs enables AMX, which the guest kernel does not grant, and the first
# llama_decode segfaults (seen on 0.3.36). AVX-512 is kept; set LLAMA_CPP_CMAKE_ARGS for
# another machine.
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
WHEELS := $(HOME)/.cache/minivllm/wheels
peers: $(INSTALLED)
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
	  CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" \
	  $(PY) -m pip wheel --no-deps --no-binary llama-cpp-python -w $(WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PY) -m pip install $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	$(PY) -m pip install sse-starlette starlette-context pydantic-settings

# Every benchmark driver once, small (minutes): `minivllm bench all --quick`.
bench-quick: setup
	$(PY) -m minivllm bench all --quick

clean-venv:
	rm -rf $(VENV)
