# The pagedserve gateway: the OpenAI HTTP API in front of the Redis queue. No torch, no
# Triton, no transformers: the gateway tokenizes with `tokenizers` and renders chat
# templates with jinja2 (pagedserve/gateway/tokenizer.py).
#
#   docker build -f ops/gateway.Dockerfile -t pagedserve-gateway .
#
# BASE_IMAGE: any Debian-like image with Python 3.11+, or without Python (then Debian's
# python3 is installed). ops/build-local.sh builds it FROM local/debian:bookworm, and puts
# the CA bundle pip needs there into ops/local/ (used only in the build stage).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS python
# A base without a Python that can make a venv (Debian, Ubuntu) gets the distribution's.
RUN if ! python3 -m venv /tmp/venv-check >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
        && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi; \
    rm -rf /tmp/venv-check \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin pagedserve \
    && mkdir -p /models \
    && chown pagedserve:pagedserve /models

FROM python AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY ops/local/ /tmp/local/
COPY ops/requirements.py /src/ops/requirements.py
COPY pyproject.toml README.md /src/
# The requirements first (a layer that survives edits of the code), then pagedserve itself
# without dependencies: pyproject's list, less what only the engine needs.
RUN set -e; \
    if [ -f /tmp/local/ca-certificates.crt ]; then export PIP_CERT=/tmp/local/ca-certificates.crt; fi; \
    python3 -m venv /opt/venv; \
    python3 /src/ops/requirements.py /src/pyproject.toml --exclude torch triton transformers safetensors ninja \
        > /tmp/requirements.txt; \
    /opt/venv/bin/pip install --quiet -r /tmp/requirements.txt
COPY pagedserve /src/pagedserve
RUN set -e; \
    if [ -f /tmp/local/ca-certificates.crt ]; then export PIP_CERT=/tmp/local/ca-certificates.crt; fi; \
    /opt/venv/bin/pip install --quiet --no-deps /src; \
    ! /opt/venv/bin/python -c "import torch" 2>/dev/null

FROM python
COPY --from=build /opt/venv /opt/venv
COPY ops/healthcheck.py /opt/pagedserve/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PAGEDSERVE_CACHE_DIR=/models \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000
USER pagedserve
WORKDIR /home/pagedserve
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=10s --start-period=30s --retries=3 \
    CMD ["python3", "/opt/pagedserve/healthcheck.py", "gateway"]
ENTRYPOINT ["pagedserve"]
CMD ["gateway"]
