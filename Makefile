# Two commands on a fresh machine: `make demo` (federated FGRPO on the embedded SmolLM2-135M, CPU) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-slow test-flower

# torch==2.13.0 first: it is the CPU build, and pip keeps it; an unpinned torch would pull a multi-GB CUDA build.
# The flower extra too: the Flower tests run with the suite.
$(VENV)/.installed: setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,flower]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/trl-federated run --config examples/configs/quickstart.yaml

test: install
	$(BIN)/python -m pytest

test-slow: install
	$(BIN)/python -m pytest -m slow

# A real SuperLink and two SuperNodes on 127.0.0.1, and `flwr run` on the Simulation Engine: examples/flower with 2 and
# 4 simulated SuperNodes, tests/flower_app with 2 clients in parallel (marked slow: about a minute each on 2 CPU cores).
test-flower: install
	$(BIN)/python -m pytest -m slow tests/test_flower.py tests/test_flower_simulation.py
