# Two commands on a fresh machine: `make demo` and `make test`. Each does its own setup.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
DEFAULT_MODEL := smollm2-135m

.PHONY: setup demo test test-gpu model peers bench-quick clean-venv

setup: $(INSTALLED) model

# Re-run the install only when the dependency list changes.
$(INSTALLED): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -e '.[notebook,serve,dev]'
	touch $(INSTALLED)

model: $(INSTALLED)
	$(PY) -m minivllm models pull $(DEFAULT_MODEL) --quiet

demo: setup
	$(PY) -m minivllm generate --model $(DEFAULT_MODEL) --max-tokens 64 "The three most useful things to know about GPUs are"
	$(PY) -m minivllm generate --model $(DEFAULT_MODEL) --chat --max-tokens 96 "Explain what a KV cache is in two sentences."

test: setup
	$(PY) -m pytest -q

# On a machine with an NVIDIA GPU: only the CUDA tests.
test-gpu: setup
	$(PY) -m pytest -q -m cuda

# The peers of `minivllm bench peers` / `bench serve --start-peer`: llama-cpp-python built
# here from its sdist (no prebuilt wheel: its CPU kernels are compiled for this machine),
# with its server's extra. A few minutes on two cores; the wheel is kept for next time.
LLAMA_CPP_VERSION ?= 0.3.36
WHEELS := $(HOME)/.cache/minivllm/wheels
peers: $(INSTALLED)
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
	  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  $(PY) -m pip wheel --no-deps --no-binary llama-cpp-python -w $(WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(PY) -m pip install $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	$(PY) -m pip install sse-starlette starlette-context pydantic-settings

# Every benchmark driver once, small (minutes): `minivllm bench all --quick`.
bench-quick: setup
	$(PY) -m minivllm bench all --quick

clean-venv:
	rm -rf $(VENV)
