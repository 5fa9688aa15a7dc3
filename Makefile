# Ferry: `make serve` and `make test` set up .venv when needed, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.ferry-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test lint bench clean prometheus nginx wrk

setup: $(STAMP)

# torch is pinned and installed first: that pin resolves to the CPU wheel shipped on
# this disk; letting the resolver pick torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) show torch >/dev/null 2>&1 || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,load]'
	touch $(STAMP)

serve: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/ferry serve --host $(HOST) --port $(PORT)

# Lint and type checks first (configured in pyproject.toml): a new finding fails CI.
test: setup prometheus nginx lint
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

# nginx (Debian package) for the replicas-behind-a-load-balancer test in tests/deploy,
# which runs it as a child process with deploy/nginx/ferry.conf; the package's own service
# is not needed. Installed only when missing and only as root; otherwise that test skips.
nginx:
	@{ command -v nginx || test -x /usr/sbin/nginx; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx) \
	      || echo "note: could not install nginx; the nginx replicas test will be skipped"; \
	  else \
	    echo "note: nginx not found and not root: run 'sudo make nginx' (Debian package 'nginx'), or the nginx replicas test is skipped"; \
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
