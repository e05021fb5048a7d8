# Kiln's two commands:  `make run` (set up + run the default pipeline)  and  `make test` (set up + run every test).
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed

.PHONY: run test test-fast setup clean bench

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3 ...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# torch is installed first and exactly: a looser request lets pip resolve a multi-GB CUDA build.
# What pip and the build print goes to $(INSTALL_LOG), its end to the terminal only when a step fails.
INSTALL_LOG := $(VENV)/install.log
PIP := $(BIN)/python -m pip install --quiet

$(STAMP): $(BIN)/python pyproject.toml setup.py infra/system-packages.sh
	bash infra/system-packages.sh
	@echo "installing Kiln and its dependencies into $(VENV) (log: $(INSTALL_LOG))"
	@{ $(PIP) --upgrade pip && $(PIP) torch==2.13.0 && $(PIP) -e ".[dev]"; } > $(INSTALL_LOG) 2>&1 \
		|| { tail -n 40 $(INSTALL_LOG); echo "install failed: see $(INSTALL_LOG)"; exit 1; }
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/kiln run $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Everything but whole-pipeline runs, tests that start an engine (Slurm, Ray, a server, a browser) and
# multi-process torch.distributed tests: the tier to run on every change (README, "Testing").
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not cluster and not distributed" $(PYTEST_ARGS)

# The hot-path benchmarks at a small size (dedup, clean overhead, train step, data scale), one table of
# ratios with the machine's load, in at most 10 minutes (benchmarks/bench.py). The anchors Kiln does not
# need itself (rensa) come from the `bench` extra, installed here.
bench: setup
	@$(PIP) -e ".[bench]" >> $(INSTALL_LOG) 2>&1 || { tail -n 20 $(INSTALL_LOG); echo "install failed: see $(INSTALL_LOG)"; exit 1; }
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf kiln-work .pytest_cache
