# flash-attn 2 for the image's torch: no release wheel covers torch 2.13 and PyPI's `flash-attn`
# is a source build, which needs nvcc (a -devel base) and hours of CPU. This file builds the
# wheel once; the main Dockerfile installs it (--build-arg FLASH_ATTN_WHEEL=...). Not built by
# CI (no CUDA base can be pulled there); untested on a GPU so far.
#   docker build -f deploy/flash-attn2.Dockerfile -t pagedserve-fa2-wheel .
#   docker create --name fa2 pagedserve-fa2-wheel && docker cp fa2:/wheels ./fa2-wheels && docker rm fa2
# then serve ./fa2-wheels (e.g. `python3 -m http.server -d fa2-wheels 8765`) and build with
#   docker build --network host --build-arg FLASH_ATTN_WHEEL=http://127.0.0.1:8765/<wheel> .
ARG DEVEL_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
FROM ${DEVEL_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG FLASH_ATTN_VERSION=2.8.3
# Ampere and Hopper (flash-attn 2's targets); each architecture adds to the build's hours.
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
# Parallel nvcc jobs: each takes several GB of memory.
ARG MAX_JOBS=8

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ git \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# No build isolation: the extension must compile against this torch, the image's.
RUN pip install --no-cache-dir "pip==25.2" "setuptools==80.9.0" "wheel==0.45.1" "ninja==1.13.0" "packaging==25.0" "psutil==7.0.0" \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
        pip wheel --no-cache-dir --no-deps --no-build-isolation -w /wheels "flash-attn==${FLASH_ATTN_VERSION}"
