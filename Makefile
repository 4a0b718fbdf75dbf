# Two commands on a fresh machine:
#   make demo   set up, capture the tiny CPU training example, analyse it, write reports
#   make test   set up and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build that this workplace ships; override on other machines.
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= out/demo

.PHONY: setup demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,agent]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	@mkdir -p $(DEMO_OUT)
	$(BIN)/python examples/tiny_train.py --steps 12 --slow-step 7 --profile $(DEMO_OUT)/trace.json.gz
	$(BIN)/aiprof analyze $(DEMO_OUT)/trace.json.gz --out $(DEMO_OUT)

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/ingest.py

clean:
	rm -rf out .pytest_cache
