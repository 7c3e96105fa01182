# syntax=docker/dockerfile:1
# A Foldwise GPU worker (`foldwise worker`): takes tuning jobs from the shared database and times
# candidates on this container's GPU (--measurer cuda). Needs the NVIDIA Container Toolkit on the
# host (compose reserves the GPU; plain docker: `docker run --gpus 1 ...`).
# Build from the repository root:  docker build -f docker/worker.Dockerfile -t foldwise-worker .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Triton compiles a small C launcher for each kernel when it first runs: it needs a C compiler
# and Python's headers at run time, not only at build time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch pinned, from PyPI: the CUDA build, which brings its own CUDA libraries and Triton.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY fuser_core ./fuser_core
COPY tuner ./tuner
COPY service ./service
COPY migrations ./migrations
RUN pip install -e ".[postgres]" \
    && useradd --create-home --uid 10001 foldwise

USER foldwise
ENV FOLDWISE_CACHE_DIR=/home/foldwise/.cache/foldwise \
    FOLDWISE_TARGET=h100
# The target must be the GPU this worker runs on (h100, h200, a100); the worker checks it.
CMD ["sh", "-c", "exec foldwise worker --db \"${FOLDWISE_DB_URL:?set FOLDWISE_DB_URL to the shared database}\" --measurer cuda --target \"$FOLDWISE_TARGET\""]
