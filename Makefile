# Two commands on a fresh machine:
#   make demo   set up, capture the tiny CPU training example, analyse it, write reports
#   make test   set up and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build that this workplace ships; override on other machines.
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= out/demo

# The web UI's front end (web/ -> src/aiprof/server/static/, not committed) needs node 20 + npm.
STATIC := src/aiprof/server/static/index.html
WEB_SRC := web/package.json web/package-lock.json web/index.html web/vite.config.js $(wildcard web/src/*.js web/src/*.css web/src/pages/*.js)

.PHONY: setup demo test bench clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# setuptools>=77: tests/packaging builds a wheel with this venv's own (no build isolation)
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,agent,ui]"
	$(BIN)/python -m pip install -q "setuptools>=77"
	touch $@

$(STATIC): $(WEB_SRC)
	cd web && npm ci --no-audit --no-fund && npm run build

setup: $(VENV)/.installed $(STATIC)

# The UI tests drive Debian's chromium headless; install it once when missing (CI runs as root).
browser:
	@command -v chromium >/dev/null 2>&1 || { echo "installing chromium for the UI tests"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q && \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

# The agent is preloaded by `aiprof run`: the example itself has no profiling code.
demo: setup
	@rm -rf $(DEMO_OUT)/capture
	$(BIN)/aiprof run --skip 3 --iterations 6 --what kernels,python,memory --out $(DEMO_OUT) --capture-id capture \
		-- $(BIN)/python examples/tiny_train.py --steps 14 --slow-step 7
	$(BIN)/aiprof analyze $(DEMO_OUT)/capture --out $(DEMO_OUT) --html $(DEMO_OUT)/report.html

test: setup browser
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/ingest.py

clean:
	rm -rf out .pytest_cache
