# syntax=docker/dockerfile:1
# pagedserve on an NVIDIA GPU: `docker build -t pagedserve:0.1.0 .`, then
#   docker run --gpus all -p 8000:8000 -v /path/to/hf-model:/models/model:ro pagedserve:0.1.0
# Flags after the image name replace CMD, e.g. `serve --max-num-seqs 128 --dtype bfloat16`.
# The host needs an NVIDIA driver >= 580 (R580, CUDA 13.0) and the NVIDIA Container Toolkit.

# torch 2.13.0 from PyPI is a CUDA 13.0 build (it brings the cu13 NVIDIA libraries as wheels), so
# the base is CUDA 13.0: its NVIDIA_REQUIRE_CUDA makes the container toolkit refuse an older
# driver at `docker run` with a clear message, instead of torch quietly seeing no GPU. `base`,
# not `runtime`: the CUDA libraries come with torch. Both stages use the same base, so that the
# venv's interpreter (/usr/bin/python3 of the base's release) exists in the runtime stage.
# CI builds this same file on a local Debian base with the CPU torch (.ci/docker_check.sh).
ARG BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

FROM ${BASE_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
# flash-attn 4 (`flash_attn.cute`, Hopper and Blackwell) is pure Python over nvidia-cutlass-dsl:
# installed from PyPI with its `cu13` extra, which adds the DSL's CUDA 13 libraries to match
# torch's CUDA (those ran on an H100, bench/RESULTS.md). Empty: not installed (the CPU image in
# CI leaves it out).
ARG FLASH_ATTN4_VERSION=4.0.0b36
# flash-attn 2: no release wheel covers torch 2.13 (they stop at 2.10) and PyPI's `flash-attn`
# is a source build that needs nvcc. deploy/flash-attn2.Dockerfile builds a wheel for this
# torch; pass its URL or path (a wheel served to the build, e.g. from 127.0.0.1) as
#   --build-arg FLASH_ATTN_WHEEL=<wheel>
# Left empty, it is not installed. Either way the Triton paged kernel serves unless
# --attention-backend names another: it measured fastest (kernels/attention/registry.py).
ARG FLASH_ATTN_WHEEL=""
# The CPU the C++ CPU kernels are built for: an image runs on machines it was not built on, so
# not `native` (an AVX2 level; a CPU without it, or an aarch64 build, leaves them to torch ops).
ARG CPU_ARCH=x86-64-v3
# pip's own settings, for a build without the package index (CI feeds local wheels):
# e.g. --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=http://127.0.0.1:8765/
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# g++ and the Python headers build the C++ CPU kernels (below) and nothing else in this stage.
# Apt packages follow the base image's release; exact pins would break whenever the archive
# moves on, so the image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: it is by far the largest and changes least often. setuptools:
# the project builds without isolation (below), so its build requirement is installed here.
RUN pip install --no-cache-dir --upgrade "pip==25.2" "setuptools==80.9.0" \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}"

# The versions are the build arguments; the wheel's URL is its pin.
# hadolint ignore=DL3013
RUN if [ -n "${FLASH_ATTN4_VERSION}" ]; then pip install --no-cache-dir "flash-attn-4[cu13]==${FLASH_ATTN4_VERSION}"; fi \
    && if [ -n "${FLASH_ATTN_WHEEL}" ]; then pip install --no-cache-dir "${FLASH_ATTN_WHEEL}"; fi

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY config ./config
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
# A regular (not editable) install: the runtime stage gets the venv and nothing from /src. The
# C++ CPU kernels compile here, against the torch above (hence no build isolation), and must:
# the runtime never compiles them. `serve --help` imports the CLI, the server and the engine.
RUN PAGEDSERVE_BUILD_KERNELS=1 PAGEDSERVE_CPU_ARCH="${CPU_ARCH}" \
        pip install --no-cache-dir --no-build-isolation . \
    && pagedserve serve --help > /dev/null


FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive

# curl for the HEALTHCHECK; python3 is the interpreter the venv points at. gcc and the Python
# headers: Triton compiles its CUDA launcher (a small C module) at the first kernel launch, and
# every GPU attention backend stores K/V through a Triton kernel, so without them the image
# cannot serve on a GPU ("Failed to find C compiler").
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev curl ca-certificates \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv

# A fixed uid, so that Kubernetes' runAsNonRoot can check it and volumes can be chowned to it.
# Triton caches its launcher and kernels under the user's home (~/.triton), which must exist.
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
