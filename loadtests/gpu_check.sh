#!/usr/bin/env bash
# Ferry's GPU check (issue 17, "On a GPU, when one is lent"): one run, under 8 minutes, on a
# CUDA machine that has Python 3.12 with torch, transformers, prometheus-client, aiohttp and
# uvloop but not the rest of what Ferry needs, and no internet. `make gpu-wheels` (here,
# with internet) puts those wheels and the MiniLM tokenizer in .gpu-check/ (ignored by git);
# carry that folder with the working tree, then run this from anywhere:
#
#     bash loadtests/gpu_check.sh
#
# It installs the carried wheels (no index) into a venv that sees the system's packages,
# then runs `python -m loadtests.gpu_check`, which builds the models in code (random
# weights), measures, prints a table and, when $OUT is set, writes gpu_check.json and
# gpu_check.md there. CPU smoke run: FERRY_GPU_CHECK_DEVICE=cpu FERRY_GPU_CHECK_QUICK=1.
# FERRY_GPU_CHECK_PYTHON picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
# The whole script, install included, ends within this many seconds (8 minutes is the limit).
TOTAL_S=${FERRY_GPU_CHECK_TIMEOUT_S:-460}
PY=${FERRY_GPU_CHECK_PYTHON:-$(command -v python3 || command -v python)}
CHECK_DIR=.gpu-check
NEEDS="import starlette, uvicorn, orjson, pydantic, zmq, msgspec, httpx, python_multipart, jinja2, aiohttp, prometheus_client, transformers, torch"

if ! "$PY" -c "$NEEDS" 2>/dev/null; then
  if [ ! -f "$CHECK_DIR/requirements.txt" ]; then
    echo "gpu_check: Ferry's dependencies are missing and $CHECK_DIR/ was not carried (run 'make gpu-wheels' first)" >&2
    exit 2
  fi
  VENV=${TMPDIR:-/tmp}/ferry-gpu-check-venv
  if "$PY" -m venv --system-site-packages "$VENV" 2>/dev/null && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index \
      --find-links "$CHECK_DIR/wheels" -r "$CHECK_DIR/requirements.txt"
    PY="$VENV/bin/python"
  else
    # No venv module or no ensurepip: install beside the system's packages instead.
    SITE=${TMPDIR:-/tmp}/ferry-gpu-check-site
    "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$CHECK_DIR/wheels" \
      --target "$SITE" -r "$CHECK_DIR/requirements.txt"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PY" -c "$NEEDS"
fi

export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
# The Python part keeps to its own budget (what is left less 50 s, unless
# FERRY_GPU_CHECK_BUDGET_S says) and writes its results after every phase; `timeout` is the
# backstop that keeps the whole within TOTAL_S.
LEFT=$((TOTAL_S - SECONDS - 10))
export FERRY_GPU_CHECK_BUDGET_S=${FERRY_GPU_CHECK_BUDGET_S:-$((LEFT - 50))}
echo "gpu_check: $PY ready after ${SECONDS}s; measuring for at most ${LEFT}s"
exec timeout -k 10 "$LEFT" "$PY" -m loadtests.gpu_check
