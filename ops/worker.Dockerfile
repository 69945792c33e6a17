# A pagedserve worker: the engine, pulling requests from the Redis queue. Also runs
# `pagedserve models pull` (the `pull` extra is installed).
#
#   CPU (the defaults):
#     docker build -f ops/worker.Dockerfile -t pagedserve-worker:cpu .
#   GPU (CUDA torch and Triton):
#     docker build -f ops/worker.Dockerfile -t pagedserve-worker:cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       --build-arg EXCLUDE= --build-arg PREBUILD_CPU_KERNELS=0 .
#
# BASE_IMAGE: a Debian-like image with Python 3.11+, or without Python (then the
# distribution's python3 is installed: 3.11 on Debian bookworm, 3.12 on Ubuntu 24.04).
# TORCH_SPEC: what pip installs for torch: a requirement, or a wheel's path under /tmp/local/
# (ops/build-local.sh copies a local wheel into ops/local/). TORCH_INDEX_URL: where pip finds
# it and its dependencies. EXCLUDE: pyproject requirements left out (Triton is only for GPUs).
# PREBUILD_CPU_KERNELS: 1 (the default) compiles the CPU kernels into the image for the build
# machine's CPU, so a worker on that kind of CPU starts without a compiler run; 0 leaves it to
# each worker's first start (GPU images, or images built for other CPUs).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS python
# Python (if the base has none that can make a venv), and a C++ compiler with Python's
# headers: the CPU kernels are compiled for the CPU they run on (-march=native), and Triton
# compiles its launchers on GPUs.
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
# The CPU kernels, built once here rather than by every worker at its first start (two workers
# compiling side by side on 2 cores took over 10 minutes). The extension's name carries the
# CPU's flags and model, so a container on another kind of CPU ignores this build and compiles
# its own into the same cache (~/.cache/torch_extensions).
ARG PREBUILD_CPU_KERNELS=1
RUN if [ "$PREBUILD_CPU_KERNELS" = 1 ]; then \
        python3 -c "import logging, sys; logging.basicConfig(level=logging.INFO); \
from pagedserve.kernels.cpu_attention import cpu_kernels; sys.exit(cpu_kernels() is None)"; \
    fi
HEALTHCHECK --interval=5s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python3", "/opt/pagedserve/healthcheck.py", "worker"]
ENTRYPOINT ["pagedserve"]
CMD ["worker"]
