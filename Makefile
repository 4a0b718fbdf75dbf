# Two commands on a fresh machine:
#   make demo   set up, capture the tiny CPU training example, analyse it, write reports
#   make test   set up and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build that this workplace ships; override on other machines.
TORCH_SPEC ?= torch==2.13.0
comma := ,
DEMO_OUT ?= out/demo

# The web UI's front end (web/ -> src/aiprof/server/static/, not committed) needs node 20 + npm.
STATIC := src/aiprof/server/static/index.html
WEB_SRC := web/package.json web/package-lock.json web/index.html web/vite.config.js $(wildcard web/src/*.js web/src/*.css web/src/pages/*.js)

.PHONY: setup demo test test-latest lock bench clean browser

# Every package but torch comes from requirements/lock.txt: exact versions and their hashes, installed
# as they are (--no-deps), then checked (pip check). torch is the one exception: its build depends on
# the machine (the CPU build here, CUDA on a GPU host), so TORCH_SPEC picks it; its own dependencies
# are in the lock. `make lock` re-resolves the lock; `make test-latest` runs the suite on the newest
# versions that pyproject.toml allows, so that drift is seen on purpose.
LOCK ?= requirements/lock.txt
EXTRAS := test,agent,ui,scale,export,server

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(LOCK)
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check
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

# The newest versions pyproject.toml allows (torch too: TORCH_SPEC only seeds it), in their own venv: what the
# next `make lock` would bring in, tried before it lands.
LATEST ?= .venv-latest
test-latest: $(STATIC) browser
	rm -rf $(LATEST) && $(PY) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(LATEST)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[$(EXTRAS)]"
	$(LATEST)/bin/python -m pip list --format=freeze > $(LATEST)/versions.txt
	$(LATEST)/bin/python -m pytest -q

# Re-resolve the lock at the newest allowed versions, for Python $(LOCK_PY) on Linux x86-64 (this
# project's machines and CI), with uv (installed, pinned, in its own venv). The CPU build of torch is
# resolved from TORCH_LINKS (this workplace's wheel folder) or PyTorch's CPU index, so that the lock
# holds torch's own dependencies and no CUDA ones.
UV_VERSION ?= 0.13.9
LOCK_PY ?= 3.11
TORCH_LINKS ?= $(wildcard /opt/wheels)
TORCH_SOURCE := $(if $(TORCH_LINKS),--find-links $(TORCH_LINKS),--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
lock:
	test -x .venv-lock/bin/uv || { $(PY) -m venv .venv-lock && .venv-lock/bin/python -m pip install -q "uv==$(UV_VERSION)"; }
	echo "$(TORCH_SPEC)" > .venv-lock/torch.txt
	.venv-lock/bin/uv pip compile pyproject.toml requirements/build.in $(foreach e,$(subst $(comma), ,$(EXTRAS)),--extra $(e)) \
		--python-version $(LOCK_PY) --python-platform x86_64-manylinux_2_28 $(TORCH_SOURCE) \
		--constraint .venv-lock/torch.txt --no-emit-package torch --generate-hashes --quiet \
		--custom-compile-command "make lock" -o $(LOCK)

bench: setup
	$(BIN)/python bench/ingest.py

clean:
	rm -rf out .pytest_cache
