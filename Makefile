# Two commands on a fresh machine: `make demo` and `make test`. Each does its own setup.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
DEFAULT_MODEL := smollm2-135m

.PHONY: setup demo test test-gpu model clean-venv

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

clean-venv:
	rm -rf $(VENV)
