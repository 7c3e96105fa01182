# syntax=docker/dockerfile:1
# The Foldwise API (REST + dashboard, `foldwise serve`). No GPU: torch is the CPU wheel; jobs
# with --measurer cuda are left to the GPU workers (docker/worker.Dockerfile).
# Build from the repository root:  docker build -f docker/api.Dockerfile -t foldwise-api .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, pinned, from PyTorch's CPU index: an unpinned torch from PyPI pulls GBs of CUDA.
ARG TORCH_VERSION=2.13.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY fuser_core ./fuser_core
COPY tuner ./tuner
COPY service ./service
COPY migrations ./migrations
# Editable install: service/db.py finds migrations/ next to the service package (/app/migrations).
# [postgres]: the PostgreSQL driver behind postgresql+psycopg:// URLs.
RUN pip install -e ".[postgres,signing]" \
    && useradd --create-home --uid 10001 foldwise

USER foldwise
ENV FOLDWISE_CACHE_DIR=/home/foldwise/.cache/foldwise
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
# The database comes from FOLDWISE_DB_URL (or --db). Bound to 0.0.0.0 the server refuses to start
# until the database holds an API token: `foldwise token create --db URL --name NAME --scopes ...`.
CMD ["foldwise", "serve", "--host", "0.0.0.0", "--port", "8000"]
