# A pagedserve worker: the engine, pulling requests from the Redis queue. Also runs
# `pagedserve models pull` (the `pull` extra is installed).
#
#   CPU (the defaults):
#     docker build -f ops/worker.Dockerfile -t pagedserve-worker:cpu .
#   GPU (CUDA torch and Triton):
#     docker build -f ops/worker.Dockerfile -t pagedserve-worker:cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       --build-arg EXCLUDE= .
#
# BASE_IMAGE: a Debian-like image with Python 3.11+, or without Python (then the
# distribution's python3 is installed: 3.11 on Debian bookworm, 3.12 on Ubuntu 24.04).
# TORCH_SPEC: what pip installs for torch: a requirement, or a wheel's path under /tmp/local/
# (ops/build-local.sh copies a local wheel into ops/local/). TORCH_INDEX_URL: where pip finds
# it and its dependencies. EXCLUDE: pyproject requirements left out (Triton is only for GPUs).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS python
# Python (if the base has none that can make a venv), and a C++ compiler with Python's
# headers: the CPU attention kernel is compiled on a worker's first start (-march=native, so
# never at build time), and Triton compiles its launchers on GPUs.
RUN set -e; \
    packages="g++"; \
    python3 -m venv /tmp/venv-check >/dev/null 2>&1 || packages="$packages python3 python3-venv python3-dev"; \
    if command -v python3 >/dev/null && ! python3 -c "import sysconfig, os, sys; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then \
        packages="$packages python3-dev"; \
    fi; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /tmp/venv-check; \
    useradd --create-home --uid 10001 --shell /usr/sbin/nologin pagedserve; \
    mkdir -p /models; \
    chown pagedserve:pagedserve /models

FROM python AS build
ARG TORCH_SPEC="torch>=2.5,<2.15"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXCLUDE=triton
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY ops/local/ /tmp/local/
RUN set -e; \
    if [ -f /tmp/local/ca-certificates.crt ]; then export PIP_CERT=/tmp/local/ca-certificates.crt; fi; \
    python3 -m venv /opt/venv; \
    /opt/venv/bin/pip install --quiet --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
COPY ops/requirements.py /src/ops/requirements.py
COPY pyproject.toml README.md /src/
RUN set -e; \
    if [ -f /tmp/local/ca-certificates.crt ]; then export PIP_CERT=/tmp/local/ca-certificates.crt; fi; \
    python3 /src/ops/requirements.py /src/pyproject.toml --extra pull --exclude torch $EXCLUDE \
        > /tmp/requirements.txt; \
    /opt/venv/bin/pip install --quiet -r /tmp/requirements.txt
COPY pagedserve /src/pagedserve
RUN set -e; \
    if [ -f /tmp/local/ca-certificates.crt ]; then export PIP_CERT=/tmp/local/ca-certificates.crt; fi; \
    /opt/venv/bin/pip install --quiet --no-deps /src

FROM python
COPY --from=build /opt/venv /opt/venv
COPY ops/healthcheck.py /opt/pagedserve/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PAGEDSERVE_CACHE_DIR=/models
USER pagedserve
WORKDIR /home/pagedserve
HEALTHCHECK --interval=5s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python3", "/opt/pagedserve/healthcheck.py", "worker"]
ENTRYPOINT ["pagedserve"]
CMD ["worker"]
