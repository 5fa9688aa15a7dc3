# Ferry: `make serve` and `make test` set up .venv when needed, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ferry-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test lint bench clean prometheus wrk

setup: $(STAMP)

# deploy/install.sh is the one install script (the Dockerfile runs it too): it creates the venv
# with $(PYTHON), installs the pinned torch first (that pin resolves to the CPU wheel shipped on
# this disk; letting the resolver pick torch would pull a multi-GB CUDA build), then Ferry.
$(STAMP): pyproject.toml deploy/install.sh
	PYTHON=$(PYTHON) sh deploy/install.sh $(VENV) --extras test,load --editable
	touch $(STAMP)

serve: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/ferry serve --host $(HOST) --port $(PORT)

# Lint and type checks first (configured in pyproject.toml): a new finding fails CI.
test: setup prometheus lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# Prometheus + promtool (Debian package) for the end-to-end test in tests/observability.
# Installed only when missing and only as root; otherwise (or if apt fails) that test skips.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus) \
	      || echo "note: could not install prometheus; the Prometheus end-to-end test will be skipped"; \
	  else \
	    echo "note: prometheus not found and not root: run 'sudo make prometheus' (Debian package 'prometheus'), or the Prometheus end-to-end test is skipped"; \
	  fi; }

# wrk (Debian package) drives loadtests/bench_gateway.py; not needed by `make test`.
wrk:
	@command -v wrk >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wrk; \
	  else \
	    echo "wrk not found and not root: run 'sudo make wrk' (Debian package 'wrk')"; exit 1; \
	  fi; }

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build *.egg-info
