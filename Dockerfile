# Ferry's image: CPU by default; CUDA wheels with a build argument. Either way the install steps
# are deploy/install.sh, the script `make setup` runs, so the image and a developer's .venv
# cannot drift.
#
#   docker build -t ferry:cpu .
#   docker build -t ferry:cuda --build-arg TORCH_VARIANT=cu128 .
#
# TORCH_VARIANT names a wheel index of download.pytorch.org (cpu, cu126, cu128, ...): pick the
# CUDA one your nodes' driver supports. The CUDA wheels carry their own CUDA runtime, so the base
# image stays the same; the node only needs the NVIDIA driver (and the device plugin on Kubernetes).
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/ferry/bin:$PATH \
    FERRY_CACHE_DIR=/opt/ferry/cache

# g++ builds the chat engine's decode attention kernel (engine/decode_attention.cpp) on the
# first start, cached under the user's ~/.cache/torch_extensions; without it, SDPA runs instead.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . /src
RUN TORCH_INDEX_URL="${TORCH_INDEX_URL}" sh deploy/install.sh /opt/ferry \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/ferry ferry \
    && mkdir -p /var/lib/ferry /opt/ferry/cache \
    && chown ferry:ferry /var/lib/ferry \
    && chown -R ferry:ferry /opt/ferry/cache

# FERRY_CACHE_DIR (set above, for the build and the run alike): the built-in chat model's
# float32 copy, made by install.sh at build time, and ferry-tiny-chat when it is served.
# Never root at run time. HF_HOME is where a Hugging Face model given by id is cached (mount a
# volume there, or bake the model in, since HF_HUB_OFFLINE=1 forbids downloads at start).
USER 10001:10001
ENV HOME=/home/ferry \
    HF_HOME=/home/ferry/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    FERRY_HOST=0.0.0.0 \
    FERRY_DATA_DIR=/var/lib/ferry
WORKDIR /home/ferry
EXPOSE 8000
ENTRYPOINT ["ferry"]
CMD ["serve"]
