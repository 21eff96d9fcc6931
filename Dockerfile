# syntax=docker/dockerfile:1
# pagedserve on an NVIDIA GPU: `docker build -t pagedserve:0.1.0 .`, then
#   docker run --gpus all -p 8000:8000 -v /path/to/hf-model:/models/model:ro pagedserve:0.1.0
# Flags after the image name replace CMD, e.g. `serve --max-num-seqs 128 --dtype bfloat16`.

# The base image and the Python build must match: both stages use the same one, so the venv's
# interpreter (/usr/bin/python3.12 on Ubuntu 24.04) exists in the runtime stage.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build

# The Linux x86_64 torch wheel on PyPI is the CUDA build; it brings its CUDA libraries as
# nvidia-* wheels, so the host needs only a driver recent enough for them.
ARG TORCH_VERSION=2.13.0
# flash-attn has no generic wheel on PyPI, and building it from source
# (`pip install flash-attn --no-build-isolation`) needs nvcc (a -devel base image), and
# takes a long time. The fast way is the prebuilt wheel from the flash-attn GitHub releases
# (https://github.com/Dao-AILab/flash-attention/releases) whose name matches this image's
# torch, CUDA major version, Python (cp312) and C++ ABI, passed as
#   --build-arg FLASH_ATTN_WHEEL=https://github.com/Dao-AILab/flash-attention/releases/download/<tag>/<wheel>.whl
# Left empty, it is not installed and the torch attention backend serves.
ARG FLASH_ATTN_WHEEL=""

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# Apt packages follow the base image's Ubuntu release; exact pins would break whenever the
# archive moves on, so the image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: it is by far the largest and changes least often.
RUN pip install --no-cache-dir --upgrade "pip==25.2" \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}"

# The wheel's URL is its pin.
# hadolint ignore=DL3013
RUN if [ -n "${FLASH_ATTN_WHEEL}" ]; then pip install --no-cache-dir "${FLASH_ATTN_WHEEL}"; fi

WORKDIR /src
COPY pyproject.toml README.md ./
COPY config ./config
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
# A regular (not editable) install: the runtime stage gets the venv and nothing from /src.
RUN pip install --no-cache-dir . && pagedserve serve --help > /dev/null


FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive

# curl for the HEALTHCHECK; python3 is the interpreter the venv points at.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 curl ca-certificates \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv

# A fixed uid, so that Kubernetes' runAsNonRoot can check it and volumes can be chowned to it.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/pagedserve pagedserve \
    && mkdir -p /models /var/cache/pagedserve \
    && chown pagedserve:pagedserve /var/cache/pagedserve

# Every setting is also a `pagedserve serve` flag; flags win over these.
# PAGEDSERVE_CACHE_DIR is where converted models are written, so it must be writable.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PAGEDSERVE_MODEL=/models/model \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000 \
    PAGEDSERVE_DEVICE=cuda \
    PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve

# Mount a Hugging Face model folder (config.json, *.safetensors, tokenizer files) at /models/model.
VOLUME /models

USER 10001
WORKDIR /home/pagedserve
EXPOSE 8000

# The port opens only once the model is loaded; the start period covers loading a large model.
# /health answers 503 once the engine thread has died, which marks the container unhealthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/health"]

ENTRYPOINT ["pagedserve"]
CMD ["serve"]
